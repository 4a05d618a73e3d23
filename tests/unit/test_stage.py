"""The stage store: one verifier load fills every stale shard of a stage; other jobs link their result."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time
from pathlib import Path

import pytest

from draftpipe.core.io import write_text
from draftpipe.runtime.store import ShardTask, content_key, run_stage, run_stored, sibling


def make_stage(root: Path, n: int = 3) -> list[ShardTask]:
    tasks = []
    for i in range(n):
        shard = f"{i:05d}"
        inp = root / "in" / f"train_{shard}.txt"
        inp.parent.mkdir(parents=True, exist_ok=True)
        if not inp.exists():
            inp.write_text(f"prompt {i}\n")
        tasks.append(ShardTask(shard, [str(inp)], str(root / "out" / f"train_{shard}.txt")))
    return tasks


def upper(calls: list):
    def compute(tasks):
        calls.append([t.shard for t in tasks])
        for t in tasks:
            write_text(t.entry, Path(t.inputs[0]).read_text().upper())

    return compute


def job(root: Path, i: int, calls: list, n: int = 3, settings=None, share=True) -> dict:
    """What one shard job does: all tasks of the stage, this job's shard `i`."""
    tasks = make_stage(root, n)
    return run_stage(
        tasks[i], tasks, root / "store", ".txt", settings or {"t": 0.8}, "code-v1", upper(calls), share=share
    )


def test_the_first_job_fills_every_shard_and_the_others_only_link(tmp_path):
    calls = []
    first = job(tmp_path, 0, calls)
    assert first["loads"] == 1 and first["computed"] == ["00000", "00001", "00002"]
    for i in (1, 2):
        assert job(tmp_path, i, calls)["loads"] == 0
    assert calls == [["00000", "00001", "00002"]]  # one verifier load for the stage
    for i in range(3):
        out = tmp_path / "out" / f"train_{i:05d}.txt"
        assert out.read_text() == f"PROMPT {i}\n"
        assert os.stat(out).st_nlink == 2  # the output is the store entry, not a copy


def test_a_changed_input_recomputes_only_its_shard_and_drops_the_old_entry(tmp_path):
    calls = []
    for i in range(3):
        job(tmp_path, i, calls)
    (tmp_path / "in" / "train_00001.txt").write_text("prompt one, edited\n")
    (tmp_path / "out" / "train_00001.txt").unlink()  # Snakemake removes the output of a job it reruns
    assert job(tmp_path, 1, calls)["computed"] == ["00001"]
    assert (tmp_path / "out" / "train_00001.txt").read_text() == "PROMPT ONE, EDITED\n"
    assert len(list((tmp_path / "store").glob("00001.*"))) == 1  # the entry no output links is gone
    assert len(list((tmp_path / "store").glob("00000.*"))) == 1


def test_a_settings_change_is_a_new_key_and_a_touch_is_not(tmp_path):
    calls = []
    job(tmp_path, 0, calls)
    job(tmp_path, 0, calls)  # same key (e.g. the script was only touched): linked, nothing computed
    assert calls == [["00000", "00001", "00002"]]
    # outputs of shards 1, 2 link older entries, so the first job of the new run fills them too
    for i in range(1, 3):
        job(tmp_path, i, calls)
    assert job(tmp_path, 0, calls, settings={"t": 0.5})["computed"] == ["00000", "00001", "00002"]


def test_an_output_of_unknown_origin_is_left_to_its_own_job(tmp_path):
    calls = []
    tasks = make_stage(tmp_path)
    Path(tasks[2].output).parent.mkdir(parents=True, exist_ok=True)
    Path(tasks[2].output).write_text("built before the store existed\n")
    assert job(tmp_path, 0, calls)["computed"] == ["00000", "00001"]
    assert Path(tasks[2].output).read_text() == "built before the store existed\n"


def test_unshared_jobs_compute_their_own_shard_only(tmp_path):
    calls = []
    for i in range(3):
        job(tmp_path, i, calls, share=False)
    assert calls == [["00000"], ["00001"], ["00002"]]


def test_a_crash_keeps_the_finished_entries(tmp_path):
    tasks = make_stage(tmp_path)

    def crash(todo):
        write_text(todo[0].entry, "DONE\n")
        raise RuntimeError("killed while computing the second shard")

    with pytest.raises(RuntimeError):
        run_stage(tasks[0], tasks, tmp_path / "store", ".txt", {}, "c", crash)
    calls = []
    tasks = make_stage(tmp_path)
    res = run_stage(tasks[0], tasks, tmp_path / "store", ".txt", {}, "c", upper(calls))
    assert res["computed"] == ["00001", "00002"]  # shard 0 survived the crash
    assert Path(tasks[0].output).read_text() == "DONE\n"


def _concurrent_job(root: str, i: int, log: str) -> None:
    calls: list = []
    job(Path(root), i, calls)
    with open(log, "a") as fh:
        fh.write(f"{i}:{','.join(s for c in calls for s in c)}\n")


def test_concurrent_jobs_load_the_verifier_once(tmp_path):
    log = tmp_path / "calls.log"
    make_stage(tmp_path)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_concurrent_job, args=(str(tmp_path), i, str(log))) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    computed = [line.split(":")[1] for line in log.read_text().splitlines() if line.split(":")[1]]
    assert len(computed) == 1 and sorted(computed[0].split(",")) == ["00000", "00001", "00002"]


def test_keys_and_sibling_paths(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("x")
    k1 = content_key([str(a)], {"t": 1}, "c")
    assert k1 == content_key([str(a)], {"t": 1}, "c") and len(k1) == 64
    assert k1 != content_key([str(a)], {"t": 2}, "c") and k1 != content_key([str(a)], {"t": 1}, "d")
    a.write_text("y")
    assert k1 != content_key([str(a)], {"t": 1}, "c")
    assert sibling("results/completions/train_00003.jsonl", "00003", "00010") == "results/completions/train_00010.jsonl"
    with pytest.raises(ValueError, match="expected the shard id"):
        sibling("results/x_00003_00003.jsonl", "00007", "00001")


def test_a_damaged_entry_is_computed_again_not_linked(tmp_path):
    calls = []
    for i in range(3):
        job(tmp_path, i, calls)
    out = tmp_path / "out" / "train_00002.txt"
    with open(out, "r+") as fh:  # damage in place: the output and its store entry are one file
        fh.truncate(3)
    out.unlink()  # quarantined, or removed by Snakemake before the rerun
    tasks = make_stage(tmp_path)
    res = run_stage(
        tasks[2],
        tasks,
        tmp_path / "store",
        ".txt",
        {"t": 0.8},
        "code-v1",
        upper(calls),
        check=lambda p: None if p.read_text().endswith("\n") else "truncated",
    )
    assert res["computed"] == ["00002"] and out.read_text() == "PROMPT 2\n"


def test_check_jsonl_names_the_damage(tmp_path):
    from draftpipe.core.io import check_jsonl, write_jsonl

    p = tmp_path / "a.jsonl"
    write_jsonl(p, [{"a": 1}, {"b": 2}])
    assert check_jsonl(p) is None
    p.write_bytes(p.read_bytes()[:-3])
    assert check_jsonl(p) == "truncated (no final newline)"
    p.write_text('{"a": 1}\n[1]\n')
    assert check_jsonl(p) == "line 2 is not a JSON object"
    p.write_text('{"a": 1}\n{"b": \n')
    assert check_jsonl(p) == "line 2 is not valid JSON"


def test_temporary_files_of_a_killed_job_are_swept_under_the_lock(tmp_path):
    calls = []
    store = tmp_path / "store"
    store.mkdir()
    # what a SIGKILL during compute leaves: atomic_path's temporary entry, plus a finished entry of another stage
    left = store / ".00001.0123abcd.txt.tmp-x1y2"
    left.write_text("PROM")
    job(tmp_path, 0, calls)
    assert not left.exists()
    # no temporary file: the lock and one digest record per entry
    hidden = sorted(p.name for p in store.iterdir() if p.name.startswith("."))
    assert hidden == sorted([".lock", *(f".{e.name}.sha256" for e in store.glob("0000*.txt"))])
    assert len(hidden) == 4
    assert (tmp_path / "out" / "train_00000.txt").read_text() == "PROMPT 0\n"


# ------------------------------------------------------------------ a job of several outputs (the draft)


def _draft_job(root: Path, knob: str, calls: list, fail: bool = False) -> bool:
    """What the draft job does: its outputs (Snakemake removed them first) from the store, built when missing."""
    outputs = [str(root / "draft" / n) for n in ("model.safetensors", "config.json", "metrics.csv")]
    for o in outputs:
        Path(o).unlink(missing_ok=True)

    def build(paths):
        calls.append(knob)
        write_text(paths[0], f"weights {knob}\n")
        write_text(paths[1], f"config {knob}\n")
        if fail:
            raise RuntimeError(f"training failed with {knob}")
        write_text(paths[2], f"metrics {knob}\n")

    key = content_key([], {"knob": knob}, "code-v1")
    return run_stored(root / "store", key, outputs, build, what="draft")


def _draft(root: Path) -> list[str]:
    return [(root / "draft" / n).read_text() for n in ("model.safetensors", "config.json", "metrics.csv")]


def test_a_failed_rebuild_loses_nothing_and_the_old_config_links_its_result_back(tmp_path, capsys):
    calls: list = []
    assert _draft_job(tmp_path, "a", calls) is True
    assert _draft(tmp_path) == ["weights a\n", "config a\n", "metrics a\n"]
    with pytest.raises(RuntimeError, match="training failed with b"):
        _draft_job(tmp_path, "b", calls, fail=True)
    assert not (tmp_path / "draft" / "model.safetensors").exists()
    # the old config: linked back without building
    assert _draft_job(tmp_path, "a", calls) is False
    assert calls == ["a", "b"]
    assert _draft(tmp_path) == ["weights a\n", "config a\n", "metrics a\n"]
    assert "draft: found in the store" in capsys.readouterr().out
    out = tmp_path / "draft" / "model.safetensors"
    [entry] = [p for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")]
    assert os.stat(out).st_ino != os.stat(entry / "model.safetensors").st_ino  # a copy: damage to it stays there
    assert os.stat(entry / "model.safetensors").st_mode & 0o777 == 0o444
    # the failed build left no temporary directory: only the linked entry is there
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [".lock", entry.name]


def test_a_new_result_replaces_the_entries_nothing_links(tmp_path):
    calls: list = []
    _draft_job(tmp_path, "a", calls)
    _draft_job(tmp_path, "b", calls)
    assert _draft(tmp_path) == ["weights b\n", "config b\n", "metrics b\n"]
    assert len([p for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")]) == 1
    _draft_job(tmp_path, "a", calls)  # a's entry went with b's success: built again
    assert calls == ["a", "b", "a"]
    with pytest.raises(ValueError, match="distinct file names"):
        run_stored(tmp_path / "store", "k" * 64, [str(tmp_path / "x/m"), str(tmp_path / "y/m")], lambda paths: None)


def test_damage_to_the_draft_never_reaches_its_entry_and_the_rebuild_copies_it_back(tmp_path, capsys):
    calls: list = []
    _draft_job(tmp_path, "a", calls)
    out = tmp_path / "draft" / "model.safetensors"
    with open(out, "r+") as fh:  # damage in place
        fh.truncate(3)
    assert _draft_job(tmp_path, "a", calls) is False  # Snakemake removed the damaged output; the entry is sound
    assert calls == ["a"] and _draft(tmp_path) == ["weights a\n", "config a\n", "metrics a\n"]


def test_a_damaged_draft_entry_is_quarantined_and_built_again(tmp_path, capsys):
    calls: list = []
    _draft_job(tmp_path, "a", calls)
    [entry] = [p for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")]
    model = entry / "model.safetensors"
    os.chmod(model, 0o644)
    data = bytearray(model.read_bytes())
    data[2] ^= 0xFF  # flipped in place: same size, new ctime
    model.write_bytes(bytes(data))
    assert _draft_job(tmp_path, "a", calls) is True
    assert calls == ["a", "a"] and _draft(tmp_path) == ["weights a\n", "config a\n", "metrics a\n"]
    out = capsys.readouterr().out
    want = f"draft: store entry {entry.name} is damaged (model.safetensors: sha256 "
    assert want in out and "!= recorded" in out and "computing it again" in out
    [moved] = list((tmp_path / ".quarantine").glob(f"*/store/{entry.name}/model.safetensors"))
    assert moved.read_bytes() == bytes(data)  # kept for inspection, never deleted


def test_a_damaged_shard_entry_is_quarantined_before_it_is_linked(tmp_path, capsys):
    """The probe of issue 28: the output is damaged in place (it is its entry), removed by --repair, and the rerun
    recomputes the shard instead of linking the damaged bytes."""
    calls = []
    for i in range(3):
        job(tmp_path, i, calls)
    out = tmp_path / "out" / "train_00001.txt"
    assert os.stat(out).st_mode & 0o777 == 0o444  # read-only: the entry's mode
    os.chmod(out, 0o644)
    with open(out, "r+") as fh:
        fh.write("X")  # same size: only the digest tells
    out.unlink()
    res = job(tmp_path, 1, calls)
    assert res["computed"] == ["00001"] and out.read_text() == "PROMPT 1\n"
    log = capsys.readouterr().out
    assert re.search(
        r"shard 00001: store entry 00001\.\w+\.txt is damaged \(sha256 \w{12}\.\.\. != recorded \w{12}\.\.\.\); moved to ",
        log,
    )


def test_an_entry_untouched_since_its_record_is_not_hashed_again(tmp_path, monkeypatch):
    from draftpipe.formats import provenance

    entry = tmp_path / "e.bin"
    entry.write_bytes(b"abc" * 1000)
    digest = provenance.record_digest(entry)
    assert len(digest) == 64 and provenance.digest_problem(entry) is None
    reads = []
    monkeypatch.setattr(provenance, "sha256_file", lambda p: reads.append(p) or "0" * 64)
    assert provenance.digest_problem(entry) is None and reads == []
    assert provenance.digest_problem(entry, full=True) == f"sha256 {'0' * 12}... != recorded {digest[:12]}..."
    os.chmod(entry, 0o644)
    entry.write_bytes(b"abd" * 1000)
    assert provenance.digest_problem(entry) == f"sha256 {'0' * 12}... != recorded {digest[:12]}..."
    entry.write_bytes(b"ab")
    assert provenance.digest_problem(entry) == "size 2 != recorded 3000"
    provenance.digest_record_path(entry).write_text("nonsense\n")
    assert provenance.digest_problem(entry) == "digest record .e.bin.sha256 unreadable"


def test_a_job_forced_beside_another_leaves_no_stray_link(tmp_path):
    from draftpipe.runtime.store import link_output

    entry = tmp_path / "store" / "e.txt"
    entry.parent.mkdir()
    entry.write_text("x\n")
    out = tmp_path / "out" / "train_00000.txt"
    link_output(entry, str(out))
    link_output(entry, str(out))  # the second job of a forced pair: the output already is the entry
    assert sorted(p.name for p in out.parent.iterdir()) == ["train_00000.txt"]
    assert out.stat().st_ino == entry.stat().st_ino


def test_the_disk_check_counts_only_the_shards_it_must_compute(tmp_path):
    """Issue 28: a rerun was refused for lack of disk although its shards were stored and would only be linked."""
    from types import SimpleNamespace

    from draftpipe.runtime.store import stored_already

    calls = []
    job(tmp_path, 0, calls)  # stores every shard of the stage

    def planned(shard: str, t: float, exists: bool = True):
        inp = tmp_path / "in" / f"train_{shard}.txt"
        if not exists:
            inp = tmp_path / "in" / "missing.txt"
        return SimpleNamespace(
            input=[str(inp)], params={"t": t, "num_shards": 3}, wildcards=SimpleNamespace(shard=shard)
        )

    assert stored_already(planned("00001", 0.8), tmp_path / "store", ".txt", "code-v1")
    assert not stored_already(planned("00001", 0.9), tmp_path / "store", ".txt", "code-v1")  # a changed knob
    assert not stored_already(planned("00001", 0.8), tmp_path / "store", ".txt", "code-v2")  # a changed script
    assert not stored_already(planned("00001", 0.8, exists=False), tmp_path / "store", ".txt", "code-v1")


def test_a_full_disk_leaves_no_request_files_behind(tmp_path):
    """Issue 28: a hidden-state job that hit ENOSPC left ``.requests-<pid>`` (15 MB, 101 files) in the store."""
    import errno

    from draftpipe.stages.extract import REQUESTS_PREFIX, request_dir

    store = tmp_path / "store"
    store.mkdir()
    (store / f"{REQUESTS_PREFIX}12345").mkdir()  # a killed job's
    with pytest.raises(OSError, match="No space left on device"), request_dir(store) as requests:
        (requests / "00000000.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    assert list(store.iterdir()) == []


def test_a_job_forced_beside_another_writes_its_own_log(tmp_path):
    """Issue 28: the second of two jobs forced side by side (``--unlock``) truncated the first's log."""
    import subprocess
    import sys

    from conftest import REPO

    log = tmp_path / "logs" / "draft.log"
    script = (
        "import sys, time\n"
        "from draftpipe.runtime import job as runtime\n"
        "runtime.LOG_LOCK_WAIT_S = 0.5\n"
        f"runtime.redirect_output({str(log)!r})\n"
        "print(sys.argv[1], flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
    )

    def start(word: str, hold: float):
        return subprocess.Popen(
            [sys.executable, "-c", script, word, str(hold)], cwd=REPO, stderr=subprocess.PIPE, text=True
        )

    first = start("first", 4)
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = start("second", 0)
    assert second.wait(30) == 0
    assert first.wait(30) == 0
    own = tmp_path / "logs" / f"draft.log.{second.pid}"
    assert log.read_text() == "first\n" and own.read_text() == "second\n"
    assert f"draftpipe: another job is writing {log}; this job's log is {own}" in second.stderr.read()
    first.stderr.close()
    second.stderr.close()


def test_the_draft_key_covers_the_package_code_and_the_shard_keys_do_not(tmp_path):
    """After draftpipe changed, a forced rerun of the draft trains afresh (its key covers every module of the
    package) while the shard stages keep their entries (a package change must not recompute every stored shard)."""
    from draftpipe.core.layout import SOURCE_ROOT
    from draftpipe.runtime.store import code_digest, package_sources

    pkg = tmp_path / "draftpipe"
    (pkg / "core").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "core" / "io.py").write_text("A = 1\n")
    (pkg / "data" / "shipped.py").write_text("B = 1\n")
    script = tmp_path / "train_draft.py"
    script.write_text("print('train')\n")
    shard, draft = code_digest([script]), code_digest([script], package=pkg)
    assert package_sources(pkg) == [pkg / "core" / "io.py"] and draft != shard
    (pkg / "data" / "shipped.py").write_text("B = 2\n")  # shipped data is not code
    assert code_digest([script], package=pkg) == draft
    (pkg / "core" / "io.py").write_text("A = 2\n")
    assert code_digest([script], package=pkg) != draft and code_digest([script]) == shard
    (pkg / "core" / "io.py").write_text("A = 1\n")
    (pkg / "core" / "io.py").rename(pkg / "core" / "files.py")  # the same bytes under another name: a change
    assert code_digest([script], package=pkg) != draft
    installed = package_sources()
    assert SOURCE_ROOT / "draftpipe" / "runtime" / "store.py" in installed
    assert not any("data" in p.relative_to(SOURCE_ROOT / "draftpipe").parts for p in installed)


def test_a_repaired_entry_takes_its_record_along_and_the_new_one_is_recorded_and_read_only(tmp_path):
    """Issue 45's loss: ``--repair`` quarantined a damaged shard entry but left its digest record, and the entry
    computed again in its place (other bytes) kept mode 0644 and the old record, so verify called it CORRUPT."""
    from draftpipe.formats.provenance import digest_problem, digest_record_path, quarantine

    calls = []
    for i in range(3):
        job(tmp_path, i, calls)
    [entry] = (tmp_path / "store").glob("00001.*.txt")
    record = digest_record_path(entry).read_text()
    moved = dict(quarantine([entry], tmp_path))  # what `python -m draftpipe.checks.verify --repair` does
    assert not digest_record_path(entry).exists()
    assert moved[digest_record_path(entry)].read_text() == record  # the record went with its entry
    (tmp_path / "out" / "train_00001.txt").unlink()

    def other_bytes(tasks):  # a recomputation that does not give the same bytes
        for t in tasks:
            write_text(t.entry, "prompt 1, computed again\n")

    tasks = make_stage(tmp_path)
    run_stage(tasks[1], tasks, tmp_path / "store", ".txt", {"t": 0.8}, "code-v1", other_bytes)
    assert os.stat(entry).st_mode & 0o777 == 0o444
    assert digest_record_path(entry).read_text() != record
    assert digest_problem(entry, full=True) is None

"""Interruptions of a run (issue 45): a disk that fills up while a job writes, and a stop asked of Snakemake.

A full disk: one line naming the path and the space, nothing finished lost, and the plain rerun after space is
freed ends in the uninterrupted bytes. The workflow copy lives on a file system of its own, a tmpfs of 64 MiB
(``mount`` needs root: skipped elsewhere, unless ``DRAFTPIPE_REQUIRE_TMPFS=1``, which ``.ci/run`` sets). A byte
flipped in hidden-state shard 00001 makes the plain run rebuild it (the damage check of ``rules/common.smk``) while a
file fills the disk up to half the shard's size: the extraction fails for want of space. Snakemake removed the
shard before its job ran and the draft's job never ran, so the next plain run would, alone, find nothing to do; the
damage check remembers the rebuild.

A stop: SIGINT to Snakemake alone, then SIGKILL of Snakemake, each while the draft job trains; the job ends within
seconds either way (Snakemake alone waits for it to finish training).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CORES
from helpers.workflow import copy_build, damage, planned_jobs, snakemake, variant, verify

from draftpipe.core.io import free_bytes, sha256_file
from draftpipe.runtime.stops import child_pids

TARGET = "results/draft/model.safetensors"
SHARD = "results/hidden_states/train_00001.safetensors"


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 64 MiB mounted at ``tmp_path/disk``, unmounted after the test."""
    where = tmp_path / "disk"
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        why = f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}"
        if os.environ.get("DRAFTPIPE_REQUIRE_TMPFS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    yield where
    subprocess.run(["umount", "--lazy", str(where)], check=False)


def files(work: Path) -> dict[str, str]:
    """sha256 of every artifact of a tree (not manifests, logs, benchmarks or hidden folders)."""
    results = work / "results"
    return {
        str(p.relative_to(work)): sha256_file(p)
        for p in sorted(results.rglob("*"))
        if p.is_file()
        and not p.name.endswith(".manifest.json")
        and not any(part.startswith(".") or part in ("logs", "benchmarks") for part in p.relative_to(results).parts)
    }


def test_a_full_disk_stops_the_job_with_one_line_and_the_plain_rerun_ends_in_the_same_bytes(built, small_disk):
    work = small_disk / "workflow"
    copy_build(built, work)
    reference = files(built)
    damage(work / SHARD, "flip")
    shard_size = (work / SHARD).stat().st_size
    free, _ = free_bytes(work)
    assert free > shard_size, f"the tmpfs holds the tree but not another shard: {free} bytes free"
    filler = small_disk / "filler"
    with open(filler, "wb") as fh:  # written, not sparse: tmpfs counts the pages
        fh.write(b"\0" * (free - shard_size // 2))

    # the check before the run would refuse to start (the shard cannot fit): turned off, the disk fills up during
    # the job, as when something else writes to it
    unchecked = variant(work, "no-disk-check", lambda cfg: cfg["hidden_states"].update(disk_check=False))
    proc = snakemake(work, TARGET, "--configfile", unchecked, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"draftpipe: {SHARD} is damaged (sha256 " in out
    full = [line for line in out.splitlines() if line.startswith("draftpipe: disk full")]
    assert len(full) == 1, out[-3000:]
    size = r"\d+(\.\d)? [KMG]?i?B"
    assert re.fullmatch(
        r"draftpipe: disk full: rule hidden_states could not write results/\S+ \(No space left on device\); its file "
        rf"system has {size} free now; {size} were free there when the job started, and it needed more; free space "
        r"and run the same command again \(finished work is kept\)",
        full[0],
    ), full[0]
    # nothing finished was lost or changed, and no partial file is left
    now = files(work)
    assert SHARD not in now and {k: v for k, v in now.items() if k != SHARD} == {
        k: v for k, v in reference.items() if k != SHARD
    }
    assert [str(p) for p in (work / "results").rglob("*") if ".tmp-" in p.name or ".requests-" in p.name] == []

    filler.unlink()
    plan = snakemake(work, TARGET, "-n")
    assert (
        f"draftpipe: {SHARD} was found damaged (sha256 " in plan.stdout + plan.stderr
        and "its rebuild did not finish; rebuilding it and what is built from it" in plan.stdout + plan.stderr
    ), plan.stderr[-3000:]
    assert planned_jobs(work) == {"hidden_states": 1, "draft": 1}
    snakemake(work, TARGET)
    assert "draft: found in the store" in (work / "results/logs/draft.log").read_text()
    assert files(work) == reference
    clean = verify(work)
    assert clean.returncode == 0 and "0 corrupt, 0 stale" in clean.stdout, clean.stdout[-3000:]
    again = snakemake(work, TARGET, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr and "damaged" not in again.stdout + again.stderr


def _training_job(work: Path, snakemake_pid: int, timeout: float = 180) -> int:
    """The pid of the draft job's script (the child of Snakemake that runs train_draft.py), once its log shows a
    training step."""
    log = work / "results/logs/draft.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in child_pids(snakemake_pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"train_draft.py" in cmdline and log.is_file() and "draft epoch 1/" in log.read_text():
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no draft job trained within {timeout} s")


def _gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # ended, not yet reaped by its parent
            return True
        time.sleep(0.1)
    return False


def test_a_stop_asked_of_snakemake_alone_ends_the_training_job_within_seconds(built, tmp_path):
    work = copy_build(built, tmp_path / "workflow")
    # a draft the store does not hold (two epochs): its job trains
    two = variant(work, "two-epochs", lambda cfg: cfg["draft"].update(epochs=2))
    cmd = [sys.executable, "-m", "snakemake", "--cores", str(CORES), TARGET, "--configfile", two]
    for how in ("SIGINT", "SIGKILL"):
        # a session of its own: the signal reaches Snakemake only, not a terminal's process group
        proc = subprocess.Popen(
            cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        job = _training_job(work, proc.pid)
        os.kill(proc.pid, getattr(signal, how))
        assert _gone(job, 20), f"the draft job still trains 20 s after {how} to Snakemake"
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0
        if how == "SIGINT":
            # the job unwound (its clean-ups ran) and said so in the log Snakemake shows, without a traceback
            assert "Terminating processes on user request" in out, out[-3000:]
            assert "draftpipe: rule draft stopped by SIGTERM; no manifests written" in out, out[-3000:]
            assert "Traceback" not in out, out[-3000:]
        else:
            snakemake(work, "--unlock")

"""GPU allocator without GPUs: a configured device count, concurrent jobs, a SIGKILLed job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import REPO

from draftpipe.gpus import GPUAllocationError, allocate

JOB = """
import json, sys, time
sys.path.insert(0, {repo!r})
from draftpipe.gpus import allocate
n, hold, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
with allocate(n, total=8, lock_dir={locks!r}, poll=0.02) as devs:
    import os
    start = time.time()
    print("holding", flush=True)
    time.sleep(hold)
    rec = {{"n": n, "devices": devs, "env": os.environ["CUDA_VISIBLE_DEVICES"], "start": start, "end": time.time()}}
open(out, "w").write(json.dumps(rec))
"""


def job(tmp_path, n, hold, name):
    code = JOB.format(repo=str(REPO), locks=str(tmp_path / "locks"))
    return subprocess.Popen(
        [sys.executable, "-c", code, str(n), str(hold), str(tmp_path / f"{name}.json")],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_concurrent_jobs_never_share_a_device(tmp_path):
    procs = [job(tmp_path, 1, 0.3, f"one{i}") for i in range(12)] + [
        job(tmp_path, 4, 0.5, f"four{i}") for i in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    recs = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("*.json"))]
    assert len(recs) == 14
    for r in recs:
        assert len(r["devices"]) == r["n"] == len(set(r["devices"]))
        assert r["env"] == ",".join(r["devices"])
        assert all(0 <= int(d) < 8 for d in r["devices"])
    for i, a in enumerate(recs):
        for b in recs[i + 1 :]:
            overlap_in_time = a["start"] < b["end"] and b["start"] < a["end"]
            if overlap_in_time:
                assert not set(a["devices"]) & set(b["devices"]), (a, b)
    assert sum(r["n"] for r in recs) == 20  # more than 8 were asked for in total: some jobs had to wait


def test_sigkilled_job_gives_its_devices_back(tmp_path):
    hog = job(tmp_path, 8, 600, "hog")
    assert hog.stdout.readline().strip() == "holding"
    with pytest.raises(GPUAllocationError, match="no 1 free GPUs out of 8"):
        with allocate(1, total=8, lock_dir=tmp_path / "locks", timeout=0.3, env={}):
            pass
    hog.send_signal(signal.SIGKILL)
    hog.wait(timeout=10)
    env = {}
    with allocate(8, total=8, lock_dir=tmp_path / "locks", timeout=5, env=env) as devs:
        assert devs == [str(i) for i in range(8)] and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_slurm_and_visible_devices_and_limits(tmp_path):
    env = {"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "2,3"}
    with allocate(2, lock_dir=tmp_path, env=env) as devs:
        assert devs == ["2", "3"]  # the scheduler chose; nothing is locked or changed
    env = {"CUDA_VISIBLE_DEVICES": "4,6,7"}
    with allocate(2, lock_dir=tmp_path, env=env) as devs:
        assert devs == ["4", "6"] and env["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6,7"
    with pytest.raises(GPUAllocationError, match="asks for 9 GPUs but this node has 8"):
        with allocate(9, total=8, lock_dir=tmp_path, env={}):
            pass
    with allocate(0, env={}) as devs:
        assert devs == []

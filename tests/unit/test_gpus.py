"""GPU allocator without GPUs: a configured device count, concurrent jobs, a SIGKILLed job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import REPO

from draftpipe.core.gpus import GPUAllocationError, allocate

JOB = """
import json, sys, time
sys.path.insert(0, {repo!r})
from draftpipe.core.gpus import allocate
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


def test_the_lock_directory_and_files_are_the_user_s_own(tmp_path):
    """A lock directory others can write, or a lock file that is a symlink, is refused: a job never truncates the
    file a planted symlink points at, and never waits on another user's locks."""
    import os

    locks = tmp_path / "locks"
    with allocate(1, total=2, lock_dir=locks, env={}):
        pass
    assert oct(locks.stat().st_mode & 0o777) == "0o700"
    assert oct((locks / "gpu0.lock").stat().st_mode & 0o777) == "0o600"

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / "gpu0.lock").symlink_to(victim)
    with pytest.raises(GPUAllocationError) as info:
        with allocate(1, total=1, lock_dir=planted, env={}):
            pass
    assert str(info.value) == (
        f"GPU lock file {planted / 'gpu0.lock'} cannot be opened (Too many levels of symbolic links): not a plain file"
    )
    assert victim.read_text() == "keep me\n"

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(GPUAllocationError) as info:
        with allocate(1, total=1, lock_dir=shared, env={}):
            pass
    assert str(info.value) == (
        f"GPU lock directory {shared} is writable by other users (mode 777); remove it, or set DRAFTPIPE_GPU_LOCKS "
        "to a directory of your own"
    )
    link = tmp_path / "link"
    link.symlink_to(locks)
    with pytest.raises(GPUAllocationError, match="is not a directory"):
        with allocate(1, total=1, lock_dir=link, env={}):
            pass
    if os.getuid() == 0:  # root can hand a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(GPUAllocationError, match="belongs to uid 65534, not to this user"):
            with allocate(1, total=1, lock_dir=theirs, env={}):
                pass


def test_the_default_lock_directory_is_the_user_s_runtime_directory(tmp_path, monkeypatch):
    import os

    from draftpipe.core.gpus import default_lock_dir

    monkeypatch.delenv("DRAFTPIPE_GPU_LOCKS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_lock_dir() == tmp_path / "draftpipe-gpu-locks"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(default_lock_dir()) == f"/tmp/draftpipe-gpu-locks-{os.getuid()}"
    monkeypatch.setenv("DRAFTPIPE_GPU_LOCKS", str(tmp_path / "mine"))
    assert default_lock_dir() == tmp_path / "mine"

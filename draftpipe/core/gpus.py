"""Disjoint GPU sets for concurrent jobs on one node.

Snakemake's ``gpu`` resource is only a counter: with ``--resources gpu=8`` at most eight GPUs are *requested* at
once, but two ``gpu=1`` jobs both see every device (Snakemake issue #281). :func:`allocate` gives each job its own
devices: it takes an exclusive ``fcntl.flock`` on one lock file per device under a lock directory and sets
``CUDA_VISIBLE_DEVICES`` to the devices it holds. The kernel drops a process's flocks when it exits, however it
exits (SIGKILL included), so a dead job's devices come back without any cleanup.

Under SLURM (``SLURM_JOB_ID`` set) the scheduler chooses the devices (GRES binding sets ``CUDA_VISIBLE_DEVICES``)
and :func:`allocate` leaves them alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path


class GPUAllocationError(RuntimeError):
    """More devices requested than the node has, or none free before the timeout."""


def node_gpu_count() -> int:
    """Devices on this node: ``DRAFTPIPE_GPUS`` if set, else the entries of ``CUDA_VISIBLE_DEVICES`` if set,
    else what ``nvidia-smi -L`` lists, else 0."""
    if os.environ.get("DRAFTPIPE_GPUS"):
        return int(os.environ["DRAFTPIPE_GPUS"])
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return len([d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return 0


def default_lock_dir() -> Path:
    """``DRAFTPIPE_GPU_LOCKS``, else ``$XDG_RUNTIME_DIR/draftpipe-gpu-locks`` (the user's own runtime directory),
    else ``/tmp/draftpipe-gpu-locks-<uid>``: shared by every job of one user on the node, checked by
    :func:`secure_lock_dir` before use."""
    if os.environ.get("DRAFTPIPE_GPU_LOCKS"):
        return Path(os.environ["DRAFTPIPE_GPU_LOCKS"])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "draftpipe-gpu-locks"
    return Path(f"/tmp/draftpipe-gpu-locks-{os.getuid()}")


def secure_lock_dir(path: str | Path) -> Path:
    """Create the lock directory (mode 0o700) or check the one there: a real directory (not a symlink), owned by
    this user, writable by nobody else. Another user's directory at a predictable path could otherwise hold this
    user's GPUs or plant symlinks among the lock files.

    Raises:
        GPUAllocationError: naming the directory and what is wrong with it (and how to choose another:
            ``DRAFTPIPE_GPU_LOCKS``).
    """
    import stat

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        why = "is not a directory (a symlink or a file)"
    elif st.st_uid != os.getuid():
        why = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        raise GPUAllocationError(
            f"GPU lock directory {path} {why}; remove it, or set DRAFTPIPE_GPU_LOCKS to a directory of your own"
        )
    return path


def _open_lock(path: Path) -> int:
    """Open (or create, mode 0o600) a lock file without following a symlink; it must be a regular file of ours."""
    import stat

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise GPUAllocationError(f"GPU lock file {path} cannot be opened ({exc.strerror}): not a plain file") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise GPUAllocationError(f"GPU lock file {path} is not a plain file of this user")
    return fd


@contextlib.contextmanager
def allocate(
    n: int,
    *,
    total: int | None = None,
    lock_dir: str | Path | None = None,
    timeout: float = 3600.0,
    poll: float = 0.2,
    env: dict | None = None,
) -> Iterator[list[str]]:
    """Hold ``n`` devices exclusively for the duration of the block and export them as ``CUDA_VISIBLE_DEVICES``.

    Args:
        n: devices wanted (Snakemake's ``resources.gpu`` of the job); 0 yields ``[]`` and changes nothing.
        total: devices on the node (default :func:`node_gpu_count`).
        lock_dir: directory of the per-device lock files (default :func:`default_lock_dir`).
        timeout: seconds to wait for enough free devices.
        env: the environment to update (default ``os.environ``).

    Yields:
        The device ids held (strings, as in ``CUDA_VISIBLE_DEVICES``), in node order. When the caller's
        ``CUDA_VISIBLE_DEVICES`` is already set, devices are taken from that list.

    Raises:
        GPUAllocationError: ``n > total``, not enough free devices within ``timeout``, or a lock directory or
            lock file that is not this user's own (:func:`secure_lock_dir`, :func:`_open_lock`).
    """
    env = os.environ if env is None else env
    if n <= 0:
        yield []
        return
    if env.get("SLURM_JOB_ID"):
        yield [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    total = (len(visible) if visible else node_gpu_count()) if total is None else total
    ids = visible[:total] if visible else [str(i) for i in range(total)]
    if n > total:
        raise GPUAllocationError(f"job asks for {n} GPUs but this node has {total}")
    lock_dir = secure_lock_dir(lock_dir or default_lock_dir())
    deadline = time.monotonic() + timeout
    held: list[tuple[str, int]] = []
    try:
        while True:
            for dev in ids:
                if len(held) == n:
                    break
                fd = _open_lock(lock_dir / f"gpu{dev}.lock")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                held.append((dev, fd))
            if len(held) == n:
                break
            for _, fd in held:  # release partial sets, so two large jobs never deadlock each other
                os.close(fd)
            held.clear()
            if time.monotonic() > deadline:
                raise GPUAllocationError(f"no {n} free GPUs out of {total} within {timeout:.0f} s ({lock_dir})")
            time.sleep(poll)
        devices = sorted((d for d, _ in held), key=ids.index)
        previous = env.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        try:
            yield devices
        finally:
            if previous is None:
                env.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                env["CUDA_VISIBLE_DEVICES"] = previous
    finally:
        for _, fd in held:
            os.close(fd)


_HELD: list = []


def hold(n: int, **kwargs) -> list[str]:
    """:func:`allocate` for the rest of this process (a job script): the devices are released when it exits."""
    import sys

    ctx = allocate(n, **kwargs)
    devices = ctx.__enter__()
    _HELD.append(ctx)
    if n > 0:
        print(
            f"draftpipe.core.gpus: {n} GPU(s), CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}",
            file=sys.stderr,
            flush=True,
        )
    return devices


def draft_ranks(resources: dict) -> int:
    """Training ranks per node of the draft job from its ``resources.draft`` mapping: ``ranks`` when set, else one
    per GPU (``gpus``), else 1."""
    return int(resources.get("ranks") or resources.get("gpus") or 1)


def draft_world_size(resources: dict) -> int:
    """All training ranks of the draft job: ``nodes`` x :func:`draft_ranks`."""
    return int(resources.get("nodes") or 1) * draft_ranks(resources)


def slurm_resources(resources: dict) -> dict:
    """Snakemake resources of a draft job on several nodes for the SLURM executor plugin (2.8), or ``{}`` for one
    node: ``nodes: M``, ``tasks: M`` (one torchrun per node, ``--ntasks``), ``gres: gpu:N`` (N GPUs on *each* node;
    ``--gpus`` would count them over the job), ``mpi: srun`` (the job's command runs in the batch step, where the
    job script starts the ranks with ``srun``; the plugin's ``srun -n1`` would confine them to one task) and
    ``tasks_per_gpu: 0`` (no ``--ntasks-per-gpu``, which the plugin derives from ``tasks`` otherwise)."""
    nodes = int(resources.get("nodes") or 1)
    if nodes == 1:
        return {}
    out = {"nodes": nodes, "tasks": nodes, "mpi": "srun", "tasks_per_gpu": 0}
    if int(resources.get("gpus") or 0):
        out["gres"] = f"gpu:{int(resources['gpus'])}"
    return out

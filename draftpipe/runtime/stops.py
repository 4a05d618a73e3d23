"""Stopping a run when asked: SIGINT or SIGTERM to Snakemake ends its running jobs within seconds.

Snakemake 9 alone lets them run on: on SIGTERM it stops scheduling and waits for the running jobs to finish
(``JobScheduler.exit_gracefully``), and on SIGINT (``KeyboardInterrupt``) its local executor shuts its thread pool
down, which also waits for them; a draft job trains on for as long as training takes. Ctrl-C in a terminal reaches
every process of the foreground group, the jobs included, but a ``kill -INT`` or ``kill -TERM`` of Snakemake alone
(a service manager, a batch system's time limit, a user's script) reaches Snakemake only.

:func:`forward_stops`, installed from the workflow's ``onstart`` (after Snakemake has set its own handlers), sends
SIGTERM to every child process of Snakemake (the local jobs: each job script stops its servers, engines, ranks and
producer on SIGTERM, see :mod:`draftpipe.runtime.job`) and then does what Snakemake's handler did. The other way
round, a job whose Snakemake died (SIGKILL, a crash) gets SIGTERM from the kernel
(:func:`draftpipe.runtime.job.die_with_parent`, set by :func:`draftpipe.runtime.job.job`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def child_pids(pid: int | None = None) -> list[int]:
    """The live child processes of ``pid`` (default: this process), of all its threads (Linux
    ``/proc/<pid>/task/<tid>/children``); empty where ``/proc`` has no such file."""
    found: set[int] = set()
    for children in Path(f"/proc/{pid or os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found.update(int(c) for c in children.read_text().split())
    return sorted(found)


def forward_stops(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Make each of ``signals`` to this process (Snakemake's main process) first send SIGTERM to its child
    processes (:func:`child_pids`), then run the handler it had: Snakemake's (SIGTERM: stop scheduling, wait for
    the jobs; SIGINT: ``KeyboardInterrupt``, cancel, wait for the jobs), which now ends within seconds. A handler
    that was the default action is re-raised as such. Main thread only (Python's rule for ``signal.signal``).
    """
    for sig in signals:
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            for child in child_pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signal.SIGTERM)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)

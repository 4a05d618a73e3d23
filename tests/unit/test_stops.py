"""Stopping when asked (issue 45): SIGINT or SIGTERM to Snakemake reaches its jobs, and a job whose Snakemake died
stops itself. Real processes and real signals; a stand-in "Snakemake" keeps a handler that waits for its jobs, as
Snakemake 9's does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

# A process that starts a job (a Python child sleeping for 120 s), installs a handler for `sig` that, like
# Snakemake's, waits for the job to end, then `forward_stops()`; it prints the job's pid and, once the handler has
# returned or KeyboardInterrupt was raised, how the job ended.
PARENT = """
import signal, subprocess, sys, time
sys.path.insert(0, {repo!r})
from draftpipe.runtime.stops import forward_stops
sig = getattr(signal, sys.argv[1])
job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
def waits_for_jobs(signum, frame):
    print("handler", job.wait(), flush=True)
    sys.exit(0)  # Snakemake's scheduler leaves once the jobs have ended
if sig == signal.SIGTERM:
    signal.signal(sig, waits_for_jobs)
forward_stops()
try:  # the signal may arrive as soon as the pid is out
    print(job.pid, flush=True)
    time.sleep(120)
except KeyboardInterrupt:
    print("interrupted", job.wait(), flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_to_snakemake_alone_ends_its_jobs(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(repo=str(REPO)))
    parent = subprocess.Popen([sys.executable, str(script), sig], stdout=subprocess.PIPE, text=True)
    job = int(parent.stdout.readline())
    started = time.monotonic()
    os.kill(parent.pid, getattr(signal, sig))  # the parent alone, as `kill -TERM <snakemake>` does
    out, _ = parent.communicate(timeout=30)
    assert time.monotonic() - started < 10
    # the job ended by SIGTERM (returncode -15), before the parent's own handling finished
    word = "handler" if sig == "SIGTERM" else "interrupted"
    assert out.split() == [word, str(-signal.SIGTERM)], out
    with pytest.raises(ProcessLookupError):
        os.kill(job, 0)


def test_a_job_whose_parent_died_gets_sigterm(tmp_path):
    """:func:`draftpipe.runtime.job.die_with_parent`, as :func:`draftpipe.runtime.job.job` sets it: the parent
    (Snakemake) SIGKILLed, the kernel sends the job SIGTERM and its handler runs."""
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    job = (
        "import signal, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from draftpipe.runtime.job import die_with_parent\n"
        f"signal.signal(signal.SIGTERM, lambda s, f: (open({str(stopped)!r}, 'w').write('TERM'), sys.exit(0)))\n"
        "die_with_parent(signal.SIGTERM)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    starter = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {job!r}]); time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", starter])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ready.exists():
        time.sleep(0.05)
    assert ready.exists()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not stopped.exists():
        time.sleep(0.05)
    assert stopped.read_text() == "TERM"

"""Progress of a long job for the person reading its log, and one summary line per finished job on the console.

:class:`Progress` writes plain lines (no carriage returns, so a log file reads line by line)::

    completions train_00000: 120/400 requests (30%), 12.3 requests/s, elapsed 0:00:10, ETA 0:00:23, output 410 tok/s

at most every ``every`` seconds and when the work is done. :func:`vllm_progress` makes one that vLLM's offline
engine drives in place of its tqdm bar (``LLM.generate(..., use_tqdm=...)``). :func:`console` writes a job's
summary line to the terminal Snakemake runs in, while everything else of the job goes to its log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# The terminal (Snakemake's stderr) of this job, kept by draftpipe.runtime.job.redirect_output before it sends file
# descriptors 1 and 2 to the rule's log; None when nothing was redirected.
CONSOLE_FD: int | None = None


def clock_text(seconds: float | None) -> str:
    """``H:MM:SS`` of a duration in seconds (rounded down), ``?`` for None."""
    if seconds is None:
        return "?"
    s = int(max(0.0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_line(what: str, done: int, total: int | None, elapsed: float, unit: str, extra: str = "") -> str:
    """One progress line: ``what: done/total unit (pct%), rate unit/s, elapsed H:MM:SS, ETA H:MM:SS[, extra]``.

    Args:
        done, total: units done and in all (``total`` None or 0: unknown, no percentage or ETA).
        elapsed: seconds since the work started.
        extra: appended as is (e.g. ``loss 2.31``).

    The ETA assumes the rate so far: ``(total - done) / (done / elapsed)`` seconds.
    """
    rate = done / elapsed if elapsed > 0 else 0.0
    of = f"{done}/{total} {unit} ({100 * done / total:.0f}%)" if total else f"{done} {unit}"
    eta = (total - done) / rate if total and rate > 0 else (0.0 if total and done >= total else None)
    line = f"{what}: {of}, {rate:.2f} {unit}/s, elapsed {clock_text(elapsed)}, ETA {clock_text(eta)}"
    return f"{line}, {extra}" if extra else line


class Progress:
    """Counts units of work and prints :func:`progress_line` at most every ``every`` seconds, and at the end.

    Args:
        what: what the work is (``"completions train_00000"``).
        total: units in all (None: unknown).
        unit: what a unit is (``"requests"``, ``"sequences"``, ``"steps"``).
        every: seconds between lines (the first update after the start prints too).
        clock: seconds, monotonic (``time.monotonic``; a test passes its own).
        out: where a line goes (``print`` to stdout, flushed).
    """

    def __init__(
        self,
        what: str,
        total: int | None,
        unit: str,
        *,
        every: float = 10.0,
        clock: Callable[[], float] | None = None,
        out: Callable[[str], None] | None = None,
    ):
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.clock = clock or time.monotonic
        self.out = out or (lambda line: print(line, flush=True))
        self.done = 0
        self.extra = ""
        self.start = self.clock()
        self._last: float | None = None
        self.lines: list[str] = []

    @property
    def elapsed(self) -> float:
        return self.clock() - self.start

    def update(self, n: int = 1, extra: str | None = None) -> None:
        """Add ``n`` units done (``extra``: the line's tail from now on); print when due or when all are done."""
        self.done += n
        if extra is not None:
            self.extra = extra
        now = self.clock()
        finished = bool(self.total) and self.done >= self.total
        if finished or self._last is None or now - self._last >= self.every:
            self.emit(now)

    def emit(self, now: float | None = None) -> str:
        """Print the line now, whatever the interval."""
        now = self.clock() if now is None else now
        self._last = now
        line = progress_line(self.what, self.done, self.total, now - self.start, self.unit, self.extra)
        self.lines.append(line)
        self.out(line)
        return line


class _VllmBar:
    """The part of tqdm's interface vLLM's ``_run_engine`` uses (``vllm/entrypoints/common/offline.py``): built with
    ``total`` (the engine's unfinished requests: a request of ``n`` samples counts ``n``), then ``update(n)`` (the
    ``n`` completions of a finished request), ``postfix`` (its token rates), ``format_dict["elapsed"]``, ``n``,
    ``refresh()``, ``close()``."""

    def __init__(self, what: str, unit: str, every: float, total: int = 0, **_tqdm_kwargs):
        self._p = Progress(what, int(total), unit, every=every)
        self.postfix = ""

    @property
    def n(self) -> int:
        return self._p.done

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(self._p.elapsed, 1e-9), "n": self._p.done, "total": self._p.total}

    def update(self, n: int = 1) -> None:
        self._p.update(n, extra=str(self.postfix or "").replace("est. speed ", ""))

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if self._p.lines and self._p.lines[-1].startswith(f"{self._p.what}: {self._p.done}/"):
            return  # the last line already says where it ended
        self._p.emit()


def vllm_progress(what: str, *, unit: str = "requests", scale: int = 1, every: float = 10.0) -> Callable[..., object]:
    """A ``use_tqdm`` for ``vllm.LLM.generate`` that prints :func:`progress_line` lines to stdout (the job's log):
    requests done of those sent, their rate, the ETA, and vLLM's token rates (``input: X toks/s, output: Y
    toks/s``). ``scale``: completions per request (``SamplingParams.n``); above 1 the unit is completions, which is
    what vLLM counts. vLLM also calls it on the prompts it adds (``maybe_tqdm(prompts, use_tqdm=..., desc="Adding
    requests")``): they pass through."""

    def make(iterable=None, **kwargs):
        if iterable is not None:  # vLLM's "Adding requests" pass over the prompts (vllm/utils/tqdm_utils.py)
            return iterable
        return _VllmBar(what, "completions" if scale > 1 else unit, every, **kwargs)

    return make


def console(line: str) -> None:
    """Write one line to the terminal Snakemake runs in (and to the job's log): a job's summary when it ends."""
    print(line, flush=True)
    if CONSOLE_FD is not None:
        try:
            os.write(CONSOLE_FD, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
        except OSError:
            pass

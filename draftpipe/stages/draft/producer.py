"""The producer of ``hidden_states.storage: stream``: vLLM extracts the hidden states of each planned unit into the
spool, never past the disk budget (:mod:`draftpipe.stages.draft.stream` says how the trainer reads them).

Run by the draft job as ``python -m draftpipe.stages.draft.producer <spool>``; it dies with the job
(``PR_SET_PDEATHSIG``) and on SIGTERM. It reads ``<spool>/spec.json`` (the :class:`StreamSettings`, the completions
shards, ``total_seq_len``), opens the engine, waits for ``<spool>/plan.json`` (the units, in the order the trainer
reads them), then for each unit: waits until the spool's bytes plus the unit's upper bound
(:func:`draftpipe.stages.draft.stream.request_bytes`) fit the budget, extracts the unit's sequences one engine call each
(into its own request file: a sequence's states are then a function of the sequence alone, so a resumed job
re-extracts the bytes an uninterrupted one read), checks that vLLM wrote each where it was asked, writes the unit's ready
marker (holding the spool's bytes then). The prefix cache is off, so that no sequence's states depend on the
sequences before it. ``<spool>/producer.json`` records the units and tokens extracted and the peak spool bytes.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path

from draftpipe.core.io import write_json, write_text
from draftpipe.core.progress import Progress
from draftpipe.formats.captured import engine_layer_ids
from draftpipe.runtime.job import die_with_parent, engine_parallelism
from draftpipe.stages.draft.stream import (
    PLAN,
    POLL_S,
    REQUESTS,
    SPEC,
    STATS,
    StreamError,
    StreamSettings,
    extracted_length,
    read_sequences,
    ready_path,
    request_bytes,
    request_path,
    spool_bytes,
    wait_written,
)
from draftpipe.stages.extract import ExtractionError, flush_saves, open_extractor


def wait_for_room(spool: Path, need: int, budget: int) -> int:
    """Wait until the spool's bytes plus ``need`` fit ``budget``; returns the spool's bytes then.

    Raises:
        StreamError: ``need`` alone exceeds ``budget`` (the trainer could never free enough).
    """
    if need > budget:
        raise StreamError(f"a step's hidden states need {need:,} bytes, more than hidden_states.disk_budget {budget:,}")
    while (used := spool_bytes(spool)) + need > budget:
        time.sleep(POLL_S)
    return used


def produce(spool: str | Path) -> dict:
    """Extract every planned unit into ``spool`` (see the module docstring); returns the figures of
    ``producer.json``.

    Raises:
        StreamError: a unit cannot fit the budget. draftpipe.stages.extract.ExtractionError: vLLM wrote a request's
            states elsewhere than asked.
    """
    from vllm import SamplingParams

    spool = Path(spool)
    spec = json.loads((spool / SPEC).read_text())
    s = StreamSettings(**spec["settings"])
    cut = spec["total_seq_len"]
    sequences = [ids[: extracted_length(len(ids), cut)] for ids, _ in read_sequences(spec["completions"], s.max_len)]
    llm = open_extractor(
        s.verifier,
        layer_ids=engine_layer_ids(s.aux_layer_ids, s.num_layers),
        dtype=s.model_dtype,
        max_len=min(s.max_len, cut + 1),
        seed=0,
        request_dir=spool / REQUESTS,
        # no prefix cache: a step's states must not depend on the steps extracted before it (a resumed job
        # re-extracts a step in a fresh engine); samples of one prompt seldom share a step, which is shuffled
        engine={
            **engine_parallelism(s.gpus),
            **({"gpu_memory_utilization": s.gpu_memory} if s.gpus else {}),
            "enable_prefix_caching": False,
        },
    )
    while not (spool / PLAN).exists():
        time.sleep(POLL_S)
    units = json.loads((spool / PLAN).read_text())["units"]
    stats = {"units": 0, "tokens": 0, "peak_bytes": 0, "budget": s.budget}
    bar = Progress("hidden states streamed", len(units), "steps")
    for u, unit in enumerate(units):
        need = sum(request_bytes(len(sequences[g]), s) for g in unit)
        wait_for_room(spool, need, s.budget)
        paths = [str(request_path(spool, u, j)) for j in range(len(unit))]
        params = [
            SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {"hidden_states_path": p}})
            for p in paths
        ]
        # one sequence per engine call: requests sent together may start in one engine step or in two, depending on
        # when the engine core picks them up, and vLLM's states depend on the step's batch in the last bits
        outputs = [
            llm.generate([{"prompt_token_ids": sequences[g]}], [param], use_tqdm=False)[0]
            for g, param in zip(unit, params)
        ]
        flush_saves(llm, paths)  # an engine in this process writes a finished request's file at its next step
        for g, path, out in zip(unit, paths, outputs):
            got = (out.kv_transfer_params or {}).get("hidden_states_path")
            if got != path:
                raise ExtractionError(f"sample {g}: vLLM wrote its hidden states to {got!r}, expected {path!r}")
            wait_written(path)  # the engine may return before the file is on disk: count it whole
        used = spool_bytes(spool)
        stats["units"] += 1
        stats["tokens"] += sum(len(sequences[g]) for g in unit)
        stats["peak_bytes"] = max(stats["peak_bytes"], used)
        write_text(ready_path(spool, u), str(used))
        bar.update(1, extra=f"spool {used / 2**20:.1f} MiB of {s.budget / 2**20:.1f} MiB")
        write_json(spool / STATS, stats)
    write_json(spool / STATS, stats)
    return stats


def _stop(*_) -> None:
    """SIGTERM: leave (vLLM's exit handlers stop its engine processes), ignoring the SIGTERMs of that shutdown."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(argv: list[str] | None = None) -> None:
    """``python -m draftpipe.stages.draft.producer <spool>``."""
    die_with_parent()
    signal.signal(signal.SIGTERM, _stop)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[producer] %(name)s %(levelname)s %(message)s")
    produce((argv or sys.argv[1:])[0])


if __name__ == "__main__":
    main()

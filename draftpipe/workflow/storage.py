"""Where the hidden states live between vLLM and the trainer (``hidden_states.storage``): shards on disk, or a
stream within ``hidden_states.disk_budget`` (:mod:`draftpipe.stages.draft.stream`); checked when the workflow is
read."""

from __future__ import annotations

import re

from draftpipe.core.gpus import draft_world_size
from draftpipe.formats.hidden_states import engine_token_bytes
from draftpipe.workflow.config import ConfigError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(value: int | str, field: str) -> int:
    """Bytes from an integer or a size like ``200GiB``, ``512 MiB``, ``1.5TB`` (binary KiB..TiB, decimal kB..TB).

    Raises:
        ConfigError: naming ``field``, for anything else or a size below one byte.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field}: {value!r} is not a size (bytes, or e.g. 200GiB)")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.fullmatch(str(value))
        if not m or m.group(2).lower() not in UNITS:
            raise ConfigError(f"{field}: {value!r} is not a size (bytes, or e.g. 200GiB, 512MiB, 1TB)")
        n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n < 1:
        raise ConfigError(f"{field}: {value!r} is not a positive size")
    return n


def step_spool_bytes(config: dict, derived: dict) -> int:
    """Upper bound of one streamed step's request files: ``batches_per_step`` packed batches of at most
    ``total_seq_len + 1`` tokens extracted each, ``(aux + 1) x H`` states per token in the engine's dtype plus the
    token id (vLLM's connector files, :func:`draftpipe.stages.draft.stream.request_bytes`)."""
    d = config["draft"]
    per_token = engine_token_bytes(
        derived["aux_layer_ids"], derived["num_hidden_layers"], derived["hidden_size"], config["verifier"]["dtype"]
    )
    return int(d["batches_per_step"]) * (int(d["total_seq_len"]) + 1) * per_token


def check_storage(config: dict, derived: dict) -> dict:
    """Check ``hidden_states.storage`` and ``hidden_states.disk_budget``; returns ``{"storage", "disk_budget"}``
    (the budget in bytes).

    Raises:
        ConfigError: a budget that is not a size, or (``stream``) one smaller than a step's hidden states
            (:func:`step_spool_bytes`), or a draft trained by several ranks (a stream feeds one).
    """
    hs = config["hidden_states"]
    budget = parse_bytes(hs["disk_budget"], "hidden_states.disk_budget")
    if hs["storage"] == "stream":
        ranks = draft_world_size(config["resources"]["draft"])
        if ranks > 1:
            raise ConfigError(
                f"hidden_states.storage: stream feeds one training rank, but the draft trains with {ranks} "
                "(resources.draft.ranks, nodes, or one per GPU): set resources.draft.ranks: 1, or use storage: disk"
            )
        step = step_spool_bytes(config, derived)
        if budget < step:
            raise ConfigError(
                f"hidden_states.disk_budget: {hs['disk_budget']} ({budget:,} bytes) is less than one training step's "
                f"hidden states, up to {step:,} bytes (draft.batches_per_step x (draft.total_seq_len + 1) tokens); "
                "twice that lets extraction run a step ahead of training"
            )
    return {"storage": hs["storage"], "disk_budget": budget}


#: vLLM's share of each GPU's memory in a streamed draft job: its own default with the trainer on other GPUs, less
#: when the trainer shares its first GPU (the draft, its optimizer states and activations live beside vLLM there)
DISJOINT_GPU_MEMORY, SHARED_GPU_MEMORY = 0.9, 0.6


def stream_gpu_memory(resources: dict) -> float:
    """``gpu_memory_utilization`` of a streamed draft job's vLLM producer: ``resources.draft.
    stream_gpu_memory_utilization``, or :data:`SHARED_GPU_MEMORY` when the trainer shares vLLM's GPUs
    (``resources.draft.gpus: 0`` with ``resources.hidden_states.gpus`` > 0), else :data:`DISJOINT_GPU_MEMORY`."""
    chosen = resources["draft"].get("stream_gpu_memory_utilization")
    if chosen is not None:
        return float(chosen)
    shared = int(resources["hidden_states"]["gpus"]) > 0 and int(resources["draft"]["gpus"]) == 0
    return SHARED_GPU_MEMORY if shared else DISJOINT_GPU_MEMORY

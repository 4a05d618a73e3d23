"""Degenerate hidden states: a layer whose states a shard holds are all zero, or the same vector at every token.

vLLM has returned all-zero hidden states for some verifiers (vllm #46301, speculators #613). Such states pass every
check of the bytes (:func:`draftpipe.formats.hidden_states.shard_problem`: finite, the right shapes), training
"converges", and the draft accepts nothing. :func:`degenerate_layers` reads a shard once and names each layer
(each aux layer id and the last layer) whose states are all zero or constant over every token of every sample.
"""

from __future__ import annotations

from draftpipe.formats.hidden_states import dequantize_sample, iter_shard, read_shard_metadata


def degenerate_layers(path: str) -> list[str]:
    """The layers whose states are degenerate in a hidden-state shard, as one line each.

    Every sample is read (one at a time, a float8 shard dequantised with its scales) and viewed per layer:
    ``hidden_states [T, A*H]`` as ``[T, A, H]`` (aux layer ids ascending, the shard's ``aux_layer_ids``) beside
    ``verifier_last_hidden_states [T, H]`` (layer id ``num_layers``). A layer is *all zero* when its largest
    absolute value over the shard is 0, and *constant* when every token's state equals the first token's of the
    first sample (the embeddings, aux layer id 0, differ per token for any verifier; a real layer's states do too).

    Args:
        path: the shard (format of :mod:`draftpipe.formats.hidden_states`).

    Returns:
        ``[]`` for a sound shard, else e.g. ``["aux layer 2: all zero in every sample", "last layer 5: the same state
        at all 1,204 tokens"]``.

    Raises:
        ShardError: the shard's header cannot be read.
    """
    import torch

    meta = read_shard_metadata(path)
    aux = sorted(meta["aux_layer_ids"])
    names = [f"aux layer {i}" for i in aux] + [f"last layer {meta.get('num_layers', '')}".rstrip()]
    hidden = int(meta["hidden_size"])
    amax = torch.zeros(len(names))
    spread = torch.zeros(len(names))
    first = None
    tokens = 0
    for raw in iter_shard(path):
        sample = dequantize_sample(raw, torch.float32)
        states = sample["hidden_states"].float().reshape(-1, len(aux), hidden)
        x = torch.cat([states, sample["verifier_last_hidden_states"].float().reshape(-1, 1, hidden)], dim=1)
        if x.shape[0] == 0:
            continue
        if first is None:
            first = x[0]
        tokens += x.shape[0]
        amax = torch.maximum(amax, x.abs().amax(dim=(0, 2)))
        spread = torch.maximum(spread, (x - first).abs().amax(dim=(0, 2)))
    out = []
    for name, top, var in zip(names, amax.tolist(), spread.tolist()):
        if tokens and top == 0:
            out.append(f"{name}: all zero in every sample")
        elif tokens > 1 and var == 0:
            out.append(f"{name}: the same state at all {tokens:,} tokens")
    return out

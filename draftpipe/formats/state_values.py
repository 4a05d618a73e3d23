"""What the values of a hidden-state shard say about the states themselves, beyond the checks of its bytes.

vLLM has returned all-zero hidden states for some verifiers (vllm #46301, speculators #613), and batch-dependent
wrong ones (speculators #279). Such states pass every check of the bytes
(:func:`draftpipe.formats.hidden_states.shard_problem`: finite, the right shapes), training "converges", and the
draft accepts nothing. :func:`degenerate_layers` names each layer (each aux layer id and the last layer) whose
states are all zero or constant over every token of every sample; :func:`teacher_agreement` counts the answer
tokens that the verifier's own sampler, computed from the stored last-layer states, allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftpipe.formats.hidden_states import dequantize_sample, iter_shard, read_shard_metadata

if TYPE_CHECKING:
    import torch


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


#: relative rounding of a value stored in each hidden-state dtype (half a unit in the last place): the teacher check
#: at temperature 0 counts a token whose logit is within what that rounding can move a logit of the maximum
STORAGE_ROUNDING = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "float8_e4m3fn": 2.0**-4}


def answer_positions(loss_mask: torch.Tensor, tokens: int) -> torch.Tensor:
    """Positions ``j`` whose state predicts an answer token (``loss_mask[j + 1] == 1``) that is not the last of its
    answer, at most ``tokens`` of them, evenly spaced over the sample (int64 ``[n]``, ascending)."""
    import torch

    mask = loss_mask.bool()
    # the last token of each answer span is left out: the end-of-turn token a chat template closes an answer with,
    # which the verifier did not generate where max_tokens cut the answer
    closing = mask & ~torch.cat([mask[1:], mask.new_zeros(1)])
    pos = torch.nonzero((mask & ~closing)[1:]).flatten()
    if pos.numel() > tokens:
        pos = pos[torch.linspace(0, pos.numel() - 1, tokens).round().long()]
    return pos


def teacher_agreement(
    path: str,
    norm_weight: torch.Tensor,
    head_weight: torch.Tensor,
    eps: float,
    *,
    tokens: int,
    temperature: float,
    top_p: float,
) -> tuple[int, int]:
    """How many answer tokens of a shard the verifier's own sampler could have chosen, judged from the stored
    last-layer states: ``(agreeing, checked)``.

    The stored ``verifier_last_hidden_states [T, H]`` are the pre-norm output of the last layer; the verifier's
    logits are ``RMSNorm(h) @ head_weight.T`` (``h * rsqrt(mean(h^2) + eps) * norm_weight``, the Llama-family final
    norm). The state at position ``j`` predicts token ``j + 1``; only positions whose next token is an answer token
    (loss mask 1, the verifier's own output) count, about ``tokens`` of the shard, spread evenly over its samples
    (each sample with an answer gives at least one). The logits are computed on ``head_weight``'s device.
    A token agrees when it lies in the support of the sampler that generated it:

    - ``temperature`` 0: its logit is the maximum, within what rounding the state to the shard's dtype can move a
      logit (:data:`STORAGE_ROUNDING` x ``|normed h|`` x the largest row norm of ``head_weight``: Cauchy-Schwarz);
    - otherwise: the probability mass (softmax of logits / ``temperature``) of the tokens more likely than it is
      below ``top_p`` (it is in vLLM's top-p nucleus). With ``top_p`` 1 every token agrees: the caller skips the
      check then.

    Measured over every answer token: the embedded default (stories260K, temperature 0.8, top_p 0.95, bfloat16
    states) 36,881 of 36,883 (0.99995), SmolLM2 (greedy, bfloat16 states) 12,497 of 12,499; with the states shifted
    by one position 0.075 and 0.062. Only the shard's ``loss_mask``, ``input_ids`` and last-layer states are read.

    Args:
        path: the shard.
        norm_weight: float ``[H]``, the verifier's final norm.
        head_weight: float ``[V, H]``, its ``lm_head`` (or tied embeddings).
        eps: the norm's epsilon (``rms_norm_eps``).
        tokens: about how many answer tokens of the shard to check.
        temperature, top_p: the completions' sampling (``completions.temperature``, ``completions.top_p``).

    Returns:
        ``(agreeing, checked)`` token counts; ``checked`` is 0 for a shard without answer tokens.
    """
    import torch
    from safetensors import safe_open

    meta = read_shard_metadata(path)
    rounding = STORAGE_ROUNDING.get(str(meta.get("dtype")), 2.0**-8)
    head = head_weight.float()
    row_norm = float(head.norm(dim=1).max())
    agree = checked = 0
    with safe_open(path, framework="pt") as fh:  # the last-layer states only: the aux states are not read
        names = set(fh.keys())
        masks = [fh.get_tensor(f"{i:06d}.loss_mask") for i in range(meta["num_samples"])]
        counts = [int(answer_positions(m, 1 << 62).numel()) for m in masks]
        total = sum(counts)
        for i, (mask, n) in enumerate(zip(masks, counts)):
            pos = answer_positions(mask, max(1, round(tokens * n / total))) if n else mask.new_zeros(0).long()
            if not pos.numel():
                continue
            last = "verifier_last_hidden_states"
            raw = {k: fh.get_tensor(f"{i:06d}.{k}") for k in (last, f"{last}_scales") if f"{i:06d}.{k}" in names}
            h = dequantize_sample(raw)[last][pos].float().to(head.device)
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float().to(head.device)
            logits = normed @ head.T
            target = fh.get_tensor(f"{i:06d}.input_ids")[pos + 1].to(head.device)
            mine = logits.gather(1, target[:, None])
            if temperature == 0:
                slack = 2 * rounding * normed.norm(dim=1, keepdim=True) * row_norm
                ok = mine >= logits.amax(dim=1, keepdim=True) - slack
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                above = (probs * (logits > mine)).sum(dim=1, keepdim=True)
                ok = above < top_p
            agree += int(ok.sum())
            checked += int(pos.numel())
    return agree, checked

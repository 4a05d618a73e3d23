"""Attention of the EAGLE-3 draft in training, for machines without flex attention: only the blocks that attend.

speculators trains the draft on packed batches of ``T`` tokens (several documents, padded at the end) and unrolls
``k`` test-time-training (TTT) steps. At TTT step ``j`` the draft's keys are its keys of every step so far
(``DynamicCache``): ``KV = T * (j + 1)`` columns. The mask speculators builds for them
(``speculators/models/eagle3/attention.py``: ``create_combined_mask_mod``, ``extend_dense_mask_for_draft_tokens``)
lets query ``q`` attend to

- in the first ``T`` columns, the earlier tokens of its own document and itself (causal, per document);
- in each later block of ``T`` columns, only column ``q`` of that block (the draft's own token of that step).

With ``attn_implementation="sdpa"`` every query meets all ``KV`` columns: at ``T = 2048``, three TTT steps and
documents of a few hundred tokens, about 95 % of the products are masked out, and they were 85 % of a training step
on a CPU. :func:`packed_ttt_attention` computes the same softmax over only the columns that can attend: the query
rows go in chunks of :data:`CHUNK`; a chunk's keys are the span of the first block from the earliest column any of
its rows attends to, up to its last row, plus its own rows' diagonal of every later block. Masked columns
contribute ``exp(-inf) = 0`` to the softmax, so the result is the ``sdpa`` result up to the order of the
floating-point sums (tests compare them). A mask of another shape (not this structure) falls back to ``sdpa``
whole.

It is registered in transformers' attention interface as :data:`NAME` (:func:`register`) and chosen by
:func:`draftpipe.stages.draft.training.attention_implementation` where the draft trains on a CPU.
"""

from __future__ import annotations

from typing import Any

#: the ``attn_implementation`` name of :func:`packed_ttt_attention`
NAME = "draftpipe_packed_ttt"
#: query rows per chunk: small enough that a chunk spans little more than one document, large enough that the
#: per-chunk overhead stays small (chosen with ``benchmarks/draft_step.py``)
CHUNK = 64


def ttt_mask_blocks(mask, seq_len: int) -> int | None:
    """The number ``k`` of diagonal blocks after the first ``seq_len`` columns of a boolean attention mask, or None
    when the mask is not of the TTT shape (``[1, 1, T, T * (k + 1)]``, each later block exactly its diagonal).

    Args:
        mask: bool tensor ``[1, 1, T, KV]`` (True: attend), as speculators builds it for non-flex attention.
        seq_len: ``T``, the number of query rows.
    """
    import torch

    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:2] != (1, 1):
        return None
    t, kv = mask.shape[2], mask.shape[3]
    if t != seq_len or kv % t:
        return None
    k = kv // t - 1
    if k:
        later = mask[0, 0, :, t:].reshape(t, k, t)
        diag = torch.diagonal(later, dim1=0, dim2=2)  # [k, T]
        if not bool(diag.all()) or int(later.sum()) != k * t:
            return None
    return k


def packed_ttt_attention(
    module: Any,
    query,
    key,
    value,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """Attention over only the attending columns of a packed, TTT-unrolled batch (see the module docstring).

    Args:
        module: the attention module (transformers' interface; ``num_key_value_groups`` is read for GQA).
        query: ``[1, H, T, D]`` float tensor.
        key, value: ``[1, H_kv, T * (k + 1), D]`` float tensors (this and the earlier TTT steps' keys).
        attention_mask: bool ``[1, 1, T, T * (k + 1)]`` (True: attend), speculators' dense TTT mask.
        scaling: the softmax scale (``1 / sqrt(D)`` when None). ``dropout`` must be 0 (the draft trains without).

    Returns:
        ``(output, None)``: output ``[1, T, H, D]`` in the query's dtype, as transformers'
        ``sdpa_attention_forward`` returns it.

    Raises:
        ValueError: ``dropout`` is not 0.
    """
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if dropout:
        raise ValueError(f"{NAME}: dropout {dropout} is not supported (the draft trains without dropout)")
    t = query.shape[2]
    k = ttt_mask_blocks(attention_mask, t) if query.shape[0] == 1 else None
    if k is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling)
    windows = _windows(attention_mask[0, 0, :, :t], t, k)
    if windows is None:  # a query attends beyond its chunk (not causal): the whole mask, as sdpa would
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    chunk_mask, back, pad = windows
    n = chunk_mask.shape[0]

    def blocks(x, left: int):
        """``[1, H, T, D]`` -> ``[n, H, C, D]`` after ``left`` zero rows in front and padding up to ``n * C``."""
        x = F.pad(x, (0, 0, left, pad))
        return x.view(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1])[0].transpose(0, 1)

    # a chunk's keys: the `back` blocks before it and its own block of the first T columns, then its own block of
    # each later TTT block (their diagonal attends)
    def chunk_keys(x):
        first = blocks(x[:, :, :t], back * CHUNK)
        parts = [first[s : s + n] for s in range(back + 1)]
        parts += [blocks(x[:, :, j * t : (j + 1) * t], 0) for j in range(1, k + 1)]
        return torch.cat(parts, dim=2)

    q = blocks(query, 0)
    out = F.scaled_dot_product_attention(q, chunk_keys(key), chunk_keys(value), attn_mask=chunk_mask, scale=scaling)
    out = out.transpose(0, 1).reshape(1, query.shape[1], n * CHUNK, query.shape[-1])[:, :, :t]
    return out.transpose(1, 2).contiguous(), None


def _windows(first, t: int, k: int):
    """The per-chunk mask of :func:`packed_ttt_attention`, or None when a query attends past its own chunk.

    Args:
        first: bool ``[T, T]``, the first block of the mask.
    Returns:
        ``(mask [n, 1, C, (back + 1 + k) * C] bool, back, pad)``: ``back`` blocks of :data:`CHUNK` columns before
        each chunk hold every column its rows attend to; ``pad`` rows pad ``T`` to ``n * C``.
    """
    import torch
    import torch.nn.functional as F

    n = -(-t // CHUNK)
    pad = n * CHUNK - t
    rows = torch.arange(t, device=first.device)
    attends = first.any(dim=1)
    first_col = torch.where(attends, first.int().argmax(dim=1), rows)  # each row's earliest attended column
    chunk_start = rows - rows % CHUNK
    back = -(-int((chunk_start - first_col).clamp(min=0).max()) // CHUNK)
    m = F.pad(first, (back * CHUNK, pad, 0, pad))  # [n*C, (back + n) * C]
    m = m.view(n, CHUNK, back + n, CHUNK)
    idx = torch.arange(n, device=first.device)
    win = torch.stack([m[idx, :, idx + s] for s in range(back + 1)], dim=2)  # [n, C, back + 1, C]
    win = win.reshape(n, CHUNK, (back + 1) * CHUNK)
    if int(win.sum()) != int(first.sum()):
        return None
    eye = torch.eye(CHUNK, dtype=torch.bool, device=first.device).expand(n, CHUNK, CHUNK)
    mask = torch.cat([win] + [eye] * k, dim=2)
    if pad:  # each padding row attends to its own (zero) key, so that no row of the softmax is empty
        c = torch.arange(CHUNK - pad, CHUNK, device=first.device)
        mask[-1, c, back * CHUNK + c] = True
    return mask.unsqueeze(1), back, pad


def register() -> str:
    """Register :func:`packed_ttt_attention` in transformers' attention interface (idempotent); return its name."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, packed_ttt_attention)
    return NAME

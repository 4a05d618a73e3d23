"""Vocabulary maps of a draft with a smaller vocabulary than its verifier: token frequencies, d2t and t2d.

Semantics (vLLM ``llama_eagle3.py`` ``compute_logits``; speculators ``train/vocab_mapping.py``; EAGLE
``cnets.py``): the draft predicts over ``Vd`` ids; draft id ``i`` is target id ``i + d2t[i]``. The selected
target ids are the ``Vd`` most frequent loss-masked (completion) tokens, sorted ascending, so ``d2t`` is int64,
non-negative and non-decreasing and ``i + d2t[i]`` strictly increasing and ``< V``. ``t2d`` is a bool mask
``[V]`` of the selected target ids (vLLM ignores it; speculators and SGLang read it). When ``Vd == V`` there is
no mapping: vLLM refuses a ``d2t`` it has no parameter for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from draftpipe.core.io import save_safetensors

if TYPE_CHECKING:
    import torch

FORMAT = "draftpipe.vocab_maps.v1"


def count_tokens(samples: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Count loss-masked tokens over training samples.

    Args:
        samples: dicts with ``input_ids`` int64 ``[T]`` and ``loss_mask`` ``[T]`` (nonzero = counted).
        vocab_size: ``V``, the verifier's vocabulary size.

    Returns:
        int64 ``[V]`` counts.

    Raises:
        ValueError: a token id outside ``[0, V)``.
    """
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = s["input_ids"][s["loss_mask"].bool()]
        if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise ValueError(f"token id {int(ids.max())} outside the verifier vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def frequency_table(counts: torch.Tensor, selected: torch.Tensor | None, tokenizer=None):
    """A pandas table of every token id: ``token_id``, ``count``, ``frequency``, ``rank``, ``in_draft``, ``token``."""
    import pandas as pd

    n = counts.numel()
    total = int(counts.sum())
    frame = pd.DataFrame({"token_id": range(n), "count": counts.tolist()})
    frame["frequency"] = frame["count"] / total if total else 0.0
    frame["rank"] = frame["count"].rank(method="first", ascending=False).astype(int)
    frame["in_draft"] = True if selected is None else selected.tolist()
    if tokenizer is not None:
        frame["token"] = tokenizer.convert_ids_to_tokens(list(range(n)))
    return frame.sort_values("rank").reset_index(drop=True)


def build_maps(counts: torch.Tensor, draft_vocab_size: int):
    """d2t and t2d from token counts, with speculators' ``build_vocab_mappings_from_distribution``.

    Ties are broken by the smaller id; when fewer than ``Vd`` tokens were seen, the lowest unseen ids fill up.

    Returns:
        ``(d2t int64 [Vd], t2d bool [V])``, or ``(None, None)`` when ``Vd == V`` (no mapping).

    Raises:
        ValueError: ``Vd`` outside ``[1, V]``.
    """
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft.draft_vocab_size={draft_vocab_size} must be in [1, {vocab_size}] (verifier vocab)")
    if draft_vocab_size == vocab_size:
        return None, None
    freq = {i: int(c) for i, c in enumerate(counts.tolist()) if c > 0}
    return build_vocab_mappings_from_distribution(freq, draft_vocab_size, vocab_size)


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Assert the vLLM validity rules of a mapping (eagle3-checkpoint-format §2).

    Raises:
        ValueError: with the rule that failed.
    """
    import torch

    if d2t.dtype != torch.long:
        raise ValueError(f"d2t must be int64, got {d2t.dtype}")
    target = torch.arange(d2t.numel()) + d2t
    if int(target.min()) < 0 or int(target.max()) >= vocab_size:
        raise ValueError("d2t maps a draft id outside the verifier vocabulary")
    if not bool((target[1:] > target[:-1]).all()):
        raise ValueError("i + d2t[i] must be strictly increasing")
    if t2d.dtype != torch.bool or t2d.numel() != vocab_size or int(t2d.sum()) != d2t.numel():
        raise ValueError("t2d must be a bool mask of the verifier vocabulary with draft_vocab_size entries set")
    if not torch.equal(torch.nonzero(t2d).flatten(), target):
        raise ValueError("t2d and d2t disagree")


def write_maps(path: str, d2t, t2d, vocab_size: int, draft_vocab_size: int) -> None:
    """Write the maps as safetensors (``d2t``, ``t2d``; no tensors when there is no mapping), atomically, with a
    canonical header (:func:`draftpipe.core.io.save_safetensors`)."""
    tensors = {} if d2t is None else {"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}
    meta = {
        "format": FORMAT,
        "vocab_size": str(vocab_size),
        "draft_vocab_size": str(draft_vocab_size),
        "mapping": "none" if d2t is None else "d2t",
    }
    save_safetensors(path, tensors, meta)


def read_maps(path: str):
    """Read maps written by :func:`write_maps`: ``(d2t or None, t2d or None, draft_vocab_size)``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as fh:
        meta = fh.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a draftpipe vocab-map file")
    tensors = load_file(path)
    return tensors.get("d2t"), tensors.get("t2d"), int(meta["draft_vocab_size"])

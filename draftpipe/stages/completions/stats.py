"""Counts of the completions stage over all its shards (``results/completions/stats.json``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from draftpipe.formats.chat import common_template


def completion_stats(shards: dict[str, Any]) -> dict:
    """Counts of the completions stage, from its rows (``results/completions/stats.json``), in one pass.

    Args:
        shards: ``{shard path: rows}``; the rows may be any iterable (a stream of a shard too large to hold).

    Returns:
        ``{"rows", "prompts", "turns", "truncated" (rows with an answer cut by max_tokens), "rows_with_thinking"
        (rows with a thinking span in an answer), "thinking_tokens" (tokens of the thinking spans' text, by the
        verifier's tokenizer, summed over answers), "truncated_in_thinking" (rows with an answer cut inside its
        thinking span), "empty_loss_mask" (rows with no token to train on), "chat_template_sha256", "per_shard"}``.
        Plain-text rows (no chat template) count as one answer each, without thinking.

    Raises:
        TemplateDriftError: rows of two chat templates (:func:`common_template`).
    """
    first_of: dict = {}  # chat-template hash -> where it first occurs

    def count(path, rows):
        c, ids = Counter(), set()
        for i, r in enumerate(rows, start=1):
            first_of.setdefault(r.get("chat_template_sha256"), f"{path}:{i}")
            c["rows"] += 1
            ids.add(r["id"])
            turns = r.get("turns") or [{}]
            c["turns"] += len(turns)
            c["truncated"] += r.get("finish_reason") == "length"
            c["rows_with_thinking"] += any(t.get("thinking_tokens") or t.get("thinking_cut") for t in turns)
            c["thinking_tokens"] += sum(t.get("thinking_tokens", 0) for t in turns)
            c["truncated_in_thinking"] += any(t.get("thinking_cut") for t in turns)
            mask = r["loss_mask"] if "loss_mask" in r else r.get("completion_token_ids")
            c["empty_loss_mask"] += not any(mask)
        c["prompts"] = len(ids)
        return c

    keys = (
        "rows",
        "prompts",
        "turns",
        "truncated",
        "rows_with_thinking",
        "thinking_tokens",
        "truncated_in_thinking",
        "empty_loss_mask",
    )
    per = {path: count(path, rows) for path, rows in shards.items()}
    total = sum(per.values(), Counter())
    template = common_template((where, sha) for sha, where in first_of.items())
    return {
        **{k: int(total[k]) for k in keys},
        "chat_template_sha256": template,
        "per_shard": {path: {k: int(c[k]) for k in keys} for path, c in per.items()},
    }

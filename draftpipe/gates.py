"""Quality gates: checks that fail the build when an artifact is complete but not fit to train on or to ship.

A gate runs after its artifact is stored (the completions and hidden-state stores of :mod:`draftpipe.stage`), so a
failing gate loses no work: its threshold is read from the config, not from ``params:``, so raising it and
rerunning links the stored result without recomputing it. Each message names the artifact and the numbers.
"""

from __future__ import annotations


class QualityGateError(RuntimeError):
    """An artifact fails a quality gate; the message names the artifact, the measured value and the threshold."""


def truncated_rows(rows: list[dict]) -> int:
    """Rows of a completions shard cut by ``max_tokens``: ``finish_reason == "length"`` (a conversation row says
    ``length`` when any of its answers was cut, :func:`draftpipe.completions.complete_conversations`)."""
    return sum(1 for r in rows if r.get("finish_reason") == "length")


def check_truncated(rows: list[dict], max_fraction: float, artifact: str) -> float:
    """Gate ``completions.max_truncated_fraction``: at most that fraction of a shard's rows may be cut by
    ``max_tokens`` (a draft trained on cut answers never sees how the verifier ends one).

    Args:
        rows: the completion rows of one shard.
        max_fraction: the threshold in [0, 1]; 1.0 never fails.
        artifact: the shard's path, for the message.

    Returns:
        The fraction of truncated rows (0.0 for no rows).

    Raises:
        QualityGateError: the fraction is above ``max_fraction``.
    """
    cut = truncated_rows(rows)
    fraction = cut / len(rows) if rows else 0.0
    if fraction > max_fraction:
        raise QualityGateError(
            f"{artifact}: {cut} of {len(rows)} rows ({fraction:.1%}) end with finish_reason=length, above "
            f"completions.max_truncated_fraction={max_fraction}; raise completions.max_tokens (recomputes the "
            "completions) or the threshold (recomputes nothing)")
    return fraction

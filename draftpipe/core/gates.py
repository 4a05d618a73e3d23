"""Quality gates: checks that fail the build when an artifact is complete but not fit to train on or to ship.

A gate runs after its artifact is stored (the completions and hidden-state stores of :mod:`draftpipe.runtime.store`), so a
failing gate loses no work: its threshold is read from the config, not from ``params:``, so raising it and
rerunning links the stored result without recomputing it. Each message names the artifact and the numbers.
"""

from __future__ import annotations


class QualityGateError(RuntimeError):
    """An artifact fails a quality gate; the message names the artifact, the measured value and the threshold."""


def _fraction_gate(count: int, total: int, max_fraction: float, message) -> float:
    """``count / total`` (0.0 for nothing), or :class:`QualityGateError` with ``message(fraction)`` when it is above
    ``max_fraction``."""
    fraction = count / total if total else 0.0
    if fraction > max_fraction:
        raise QualityGateError(message(fraction))
    return fraction


def truncated_rows(rows: list[dict]) -> int:
    """Rows of a completions shard cut by ``max_tokens``: ``finish_reason == "length"`` (a conversation row says
    ``length`` when any of its answers was cut, :func:`draftpipe.stages.completions.conversations.complete_conversations`)."""
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
    return _fraction_gate(
        cut,
        len(rows),
        max_fraction,
        lambda f: (
            f"{artifact}: {cut} of {len(rows)} rows ({f:.1%}) end with finish_reason=length, above "
            f"completions.max_truncated_fraction={max_fraction}; raise completions.max_tokens (recomputes the "
            "completions) or the threshold (recomputes nothing)"
        ),
    )


def check_empty_masks(mask_sums: list[int], max_fraction: float, artifact: str) -> float:
    """Gate ``hidden_states.max_empty_mask_fraction``: at most that fraction of a shard's samples may have no token
    to train on (loss mask all 0: answers cut away by ``verifier.max_model_len``, or rendered outside the mask).

    Args:
        mask_sums: per sample, the number of tokens with loss mask 1.
        max_fraction: the threshold in [0, 1]; 1.0 never fails.
        artifact: the shard's path, for the message.

    Returns:
        The fraction of samples with an empty mask (0.0 for no samples).

    Raises:
        QualityGateError: the fraction is above ``max_fraction``.
    """
    empty = sum(1 for n in mask_sums if n == 0)
    return _fraction_gate(
        empty,
        len(mask_sums),
        max_fraction,
        lambda f: (
            f"{artifact}: {empty} of {len(mask_sums)} samples ({f:.1%}) have an empty loss mask, above "
            f"hidden_states.max_empty_mask_fraction={max_fraction}; raise verifier.max_model_len or check the chat "
            "template's assistant spans"
        ),
    )


def check_train_samples(mask_sums: list[int], min_samples: int, shards: list[str]) -> int:
    """Gate ``draft.min_train_samples``: the draft job trains only on at least that many samples with a token to
    learn (loss mask not all 0), so an empty training set stops the build instead of exporting random weights.

    Args:
        mask_sums: per sample of every shard, the number of tokens with loss mask 1.
        min_samples: the floor (at least 1).
        shards: the hidden-state shards read, for the message.

    Returns:
        The number of samples with a token to learn.

    Raises:
        QualityGateError: fewer than ``min_samples`` such samples.
    """
    trainable = sum(1 for n in mask_sums if n > 0)
    if trainable < max(1, min_samples):
        raise QualityGateError(
            f"draft: {trainable} of {len(mask_sums)} training samples have a token to learn in {len(shards)} "
            f"hidden-state shard(s) ({', '.join(shards[:3])}{', ...' if len(shards) > 3 else ''}), below "
            f"draft.min_train_samples={min_samples}; results/prompts/stats.json and results/completions/stats.json "
            "say what was dropped"
        )
    return trainable


def check_finite_loss(loss: float, epoch: int, step: int, batch: int) -> None:
    """Gate of draft training: a loss that is NaN or infinite stops training before a checkpoint holds it (the
    trainer checks a step's losses once the next step is queued on the device).

    Raises:
        QualityGateError: ``loss`` is not finite; names the epoch, step and batch of the step. The checkpoints of
            the steps before stay in the training state.
    """
    import math

    if not math.isfinite(loss):
        raise QualityGateError(
            f"draft training: the loss is {loss} at epoch {epoch}, step {step} (batch {batch} of the step), not "
            "finite; lower draft.lr, or check the hidden-state shards for non-finite states"
        )


def check_acceptance(summary: dict, min_length: float | None, artifact: str) -> float | None:
    """Gate ``bench.min_acceptance_length``: the served acceptance length on the eval prompts, at the largest
    ``num_speculative_tokens`` measured, must reach the threshold at every temperature and batch size.

    Args:
        summary: ``results/bench/summary.json`` (``results`` rows with ``prompt_set``, ``num_speculative_tokens``,
            ``temperature``, ``batch_size``, ``acceptance_length``).
        min_length: the threshold (tokens per verifier step, 1.0 = nothing accepted); None never fails.
        artifact: the summary's path, for the message.

    Returns:
        The lowest acceptance length checked (None when ``min_length`` is None or no eval row was measured).

    Raises:
        QualityGateError: a checked acceptance length is below ``min_length`` (or missing); names the setting.
    """
    if min_length is None:
        return None
    rows = [r for r in summary.get("results", []) if r.get("prompt_set") == "eval"]
    if not rows:
        return None
    k = max(r["num_speculative_tokens"] for r in rows)
    checked = [r for r in rows if r["num_speculative_tokens"] == k]
    worst = min(checked, key=lambda r: r.get("acceptance_length") or 0.0)
    value = worst.get("acceptance_length") or 0.0
    if value < min_length:
        raise QualityGateError(
            f"{artifact}: the served acceptance length on the eval prompts is {value:.3f} at "
            f"num_speculative_tokens={k}, temperature={worst['temperature']}, batch_size={worst['batch_size']}, below "
            f"bench.min_acceptance_length={min_length}"
        )
    return value

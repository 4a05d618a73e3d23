"""Prompts as the verifier is served them: token ids from the chat template (or plain text), fitted into the
engine's context by ``completions.too_long``; used by the completions stage, the compatibility report's live check
and the benchmark."""

from __future__ import annotations

from typing import Any

from draftpipe.formats.chat import check_chat_template, encode_prompt
from draftpipe.formats.prompts import record_where

TOO_LONG_POLICIES = ("drop", "truncate", "error")


class PromptTooLongError(ValueError):
    """A prompt leaves no room for a new token and ``completions.too_long`` is ``error``; names the prompt's file,
    line and id."""


def _check_fit(policy: str, max_model_len: int, need: int, reserve: int) -> None:
    """The settings of :func:`fit_prompt`, checked (its ValueErrors)."""
    if policy not in TOO_LONG_POLICIES:
        raise ValueError(f"completions.too_long: unknown policy {policy!r} (use drop, truncate or error)")
    if not 1 <= need < max_model_len:
        raise ValueError(f"room must be in [1, {max_model_len - 1}] for max_model_len {max_model_len}, got {need}")
    if not need <= reserve < max_model_len:
        raise ValueError(
            f"reserve must be in [{need}, {max_model_len - 1}] for max_model_len {max_model_len}, got {reserve}"
        )


def fit_prompt(
    ids: list[int],
    max_model_len: int,
    policy: str = "drop",
    where: str = "?",
    *,
    reserve: int = 1,
    need: int = 1,
    stage: str | None = None,
) -> list[int] | None:
    """Apply ``completions.too_long`` to a prompt's token ids: the one length policy of every stage that sends
    prompts to vLLM (the completions; through :func:`fit_prompts`, the live check and the benchmark).

    A prompt *fits* when it leaves room for ``need`` new tokens (the completions: at least one):
    ``len(ids) <= max_model_len - need``; such a prompt is returned unchanged, whatever the policy. For a prompt that
    does not fit:

    - ``"drop"``: return ``None`` (the caller leaves the prompt out and counts it);
    - ``"truncate"``: keep the FIRST ``max_model_len - reserve`` tokens. The beginning holds BOS, the system prompt
      and the start of the request, which a base model needs to continue sensibly; the price is that with a chat
      template the generation prompt at the end (the assistant header) is cut as well, so the verifier continues the
      user's text instead of answering it: prefer ``drop`` for chat verifiers;
    - ``"error"``: raise :class:`PromptTooLongError`.

    Args:
        ids: the prompt's token ids (:func:`encode_prompt`).
        max_model_len: the engine's context in tokens (``verifier.max_model_len``).
        policy: one of :data:`TOO_LONG_POLICIES`.
        where: the prompt, for the error message (:func:`draftpipe.formats.prompts.record_where`: file, line and id).
        reserve: room left for new tokens by ``truncate`` (``need <= reserve < max_model_len``).
        need: the new tokens a prompt must leave room for to fit (``1 <= need < max_model_len``).
        stage: the stage that generates them, named in the error (``"the live check"``); None: the completions.

    Returns:
        The ids to send (a new list), or ``None`` when the prompt is dropped.

    Raises:
        PromptTooLongError: ``policy`` is ``"error"`` and the prompt does not fit.
        ValueError: unknown ``policy``, or ``need`` or ``reserve`` outside their ranges.
    """
    _check_fit(policy, max_model_len, need, reserve)
    if len(ids) <= max_model_len - need:
        return list(ids)
    if policy == "drop":
        return None
    if policy == "truncate":
        return list(ids[: max_model_len - reserve])
    what = "a new token" if stage is None else f"the {need} new token(s) of {stage}"
    raise PromptTooLongError(
        f"completions.too_long: prompt {where} has {len(ids)} tokens, which leaves no room for {what} in "
        f"verifier.max_model_len={max_model_len} (set completions.too_long to drop or truncate to go on)"
    )


def prepare_prompts(
    records: list[dict],
    tokenizer: Any,
    *,
    max_model_len: int,
    max_tokens: int,
    too_long: str = "drop",
    chat_template: str = "auto",
    verifier: str | None = None,
) -> tuple[list[tuple[dict, list[int], int, bool]], dict]:
    """Encode prompt records for the verifier and apply ``completions.too_long`` and ``verifier.chat_template``.

    A truncated prompt keeps room for ``min(max_tokens, max_model_len // 2)`` new tokens (at least one), so its
    completion is as long as any other prompt's unless that would take more than half the context.

    Args:
        records: prompt records (``id``, ``messages``).
        tokenizer: the verifier's tokenizer.
        max_model_len: the engine's context in tokens.
        max_tokens: the completion budget (``completions.max_tokens``).
        too_long: ``drop``, ``truncate`` or ``error`` (see :func:`fit_prompt`).
        chat_template: ``auto`` or ``required`` (see :func:`check_chat_template`).
        verifier: the verifier's name for error messages.

    Returns:
        ``(kept, stats)``: ``kept`` holds ``(record, prompt ids, max new tokens, truncated)`` per prompt sent, in
        record order; ``stats`` counts ``prompts``, ``kept``, ``dropped_too_long`` (also as ``skipped_too_long``),
        ``truncated_too_long`` and ``last_user_turn_only`` (prompts sent that were reduced to their last user message,
        leaving out a system message or earlier turns, because the verifier has no chat template).

    Raises:
        PromptTooLongError, ChatTemplateError, ValueError: see :func:`fit_prompt` and :func:`check_chat_template`.
    """
    if too_long not in TOO_LONG_POLICIES:
        raise ValueError(f"completions.too_long: unknown policy {too_long!r} (use drop, truncate or error)")
    templated = check_chat_template(tokenizer, chat_template, verifier)
    reserve = max(1, min(max_tokens, max_model_len // 2))
    kept, dropped, truncated, flattened = [], 0, 0, 0
    for rec in records:
        ids = encode_prompt(tokenizer, rec["messages"])
        fitted = fit_prompt(ids, max_model_len, too_long, record_where(rec), reserve=reserve)
        if fitted is None:
            dropped += 1
            continue
        cut = len(fitted) < len(ids)
        truncated += cut
        flattened += not templated and len(rec["messages"]) > 1
        kept.append((rec, fitted, min(max_tokens, max_model_len - len(fitted)), cut))
    stats = {
        "prompts": len(records),
        "kept": len(kept),
        "dropped_too_long": dropped,
        "skipped_too_long": dropped,
        "truncated_too_long": truncated,
        "last_user_turn_only": flattened,
    }
    return kept, stats


def fit_prompts(
    encoded: list[tuple[dict, list[int]]], *, max_model_len: int, room: int, too_long: str, stage: str
) -> tuple[list[tuple[dict, list[int]]], dict]:
    """``completions.too_long`` for the stages that send already encoded prompts to vLLM to generate ``room`` new
    tokens (the compatibility report's live check, the benchmark): the same policy as the completions, counted.

    :func:`fit_prompt` with ``need = reserve = room``: a prompt fits when ``len(ids) + room <= max_model_len``
    (vLLM refuses a prompt that leaves no room); otherwise ``drop`` leaves it out, ``truncate`` keeps its first
    ``max_model_len - room`` tokens, ``error`` raises.

    Args:
        encoded: ``(record, prompt ids)`` per prompt, in order.
        max_model_len: the engine's context in tokens (``verifier.max_model_len``).
        room: the new tokens each prompt needs (``1 <= room < max_model_len``).
        too_long: one of :data:`TOO_LONG_POLICIES`.
        stage: named in the error (``"the live check"``).

    Returns:
        ``(kept, stats)``: ``kept`` the ``(record, ids)`` sent, in order; ``stats`` counts ``prompts``, ``kept``,
        ``dropped_too_long`` and ``truncated_too_long``.

    Raises:
        PromptTooLongError: ``too_long`` is ``error`` and a prompt does not fit (naming its file, line and id).
        ValueError: unknown policy, or ``room`` outside ``[1, max_model_len - 1]``.
    """
    _check_fit(too_long, max_model_len, room, room)  # also when there is no prompt
    kept, dropped, truncated = [], 0, 0
    for rec, ids in encoded:
        fitted = fit_prompt(ids, max_model_len, too_long, record_where(rec), reserve=room, need=room, stage=stage)
        if fitted is None:
            dropped += 1
            continue
        truncated += len(fitted) < len(ids)
        kept.append((rec, fitted))
    stats = {"prompts": len(encoded), "kept": len(kept), "dropped_too_long": dropped, "truncated_too_long": truncated}
    return kept, stats


def encode_and_fit(
    tokenizer: Any,
    records: list[dict],
    *,
    template_kwargs: dict,
    max_model_len: int,
    room: int,
    too_long: str,
    stage: str,
) -> tuple[list[tuple[dict, list[int]]], dict]:
    """Prompt records as the verifier is served them (:func:`draftpipe.formats.chat.encode_prompt`, with their tools and the
    rendering's ``template_kwargs``), then :func:`fit_prompts` with ``room`` new tokens (at most
    ``max_model_len - 1``): what the live check and the benchmark send to vLLM. Returns and raises as
    :func:`fit_prompts`."""
    encoded = [
        (r, encode_prompt(tokenizer, r["messages"], tools=r.get("tools"), template_kwargs=template_kwargs))
        for r in records
    ]
    room = min(room, max_model_len - 1)
    return fit_prompts(encoded, max_model_len=max_model_len, room=room, too_long=too_long, stage=stage)

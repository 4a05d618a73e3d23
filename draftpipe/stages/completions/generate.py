"""The completions of a shard: the tokenizer gate, then the verifier answers every prompt (whole conversations with a
chat template, :mod:`draftpipe.stages.completions.conversations`; the last user message as plain text without one)."""

from __future__ import annotations

from typing import Any

from draftpipe.core.progress import vllm_progress
from draftpipe.core.tokenizer_check import check_decoded, check_round_trip
from draftpipe.formats.chat import template_hash, verifier_tokenizer
from draftpipe.formats.prompts import answered_prefix, record_where
from draftpipe.inference.prompting import prepare_prompts
from draftpipe.stages.completions.conversations import complete_conversations
from draftpipe.stages.completions.settings import CompletionSettings, request_seed


def prompt_texts(records: list[dict]):
    """``(where, text)`` for every string ``content`` of every message of prompt records, ``where`` naming the
    prompt (:func:`draftpipe.formats.prompts.record_where`: source file and line, and id) and the message: what the
    tokenizer gate (:func:`draftpipe.core.tokenizer_check.check_round_trip`) checks."""
    for rec in records:
        for i, msg in enumerate(rec.get("messages") or []):
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                yield f"prompt {record_where(rec)}, message {i}", content


def tokenizer_gate(verifier: str, records: list[dict], chat_template_file: str | None = None) -> int:
    """The tokenizer gate of the completions stage, before its engine starts: the verifier's tokenizer must give
    the text of every message of ``records`` back (:func:`draftpipe.core.tokenizer_check.check_round_trip`).

    Args:
        verifier: the verifier's Hugging Face directory or hub id.
        records: prompt records (``id``, ``messages``, ``source``, ``line``).
        chat_template_file: ``verifier.chat_template_file`` (as :func:`draftpipe.formats.chat.verifier_tokenizer` takes it).

    Returns:
        How many texts were checked.

    Raises:
        draftpipe.core.tokenizer_check.TokenizerGateError: naming the verifier and the first prompt (file, line, id,
            message) that does not come back.
    """
    return check_round_trip(verifier_tokenizer(verifier, chat_template_file), prompt_texts(records), verifier)


def complete(
    llm: Any, records: list[dict], *, verifier: str, settings: CompletionSettings, progress: str | None = None
) -> tuple[list[dict], dict]:
    """Generate ``settings.samples_per_prompt`` completions per prompt record with an engine from
    :func:`draftpipe.inference.engine.open_engine`.

    One engine serves any number of calls (a stage's shards): each prompt's samples use its own seed, so they do
    not depend on which other prompts share the engine. A verifier with a chat template answers whole
    conversations (:func:`draftpipe.stages.completions.conversations.complete_conversations`: every turn with
    ``turns="all"``, thinking spans as ``reasoning`` says); one without answers the last user message as plain
    text, one completion per sample (:func:`complete_plain`).

    Args:
        llm: the ``vllm.LLM`` from :func:`draftpipe.inference.engine.open_engine`.
        records: prompt records (``id``, ``messages``) from the prompt-set stage.
        verifier: Hugging Face directory or hub id of the verifier (named in errors).
        settings: the stage's settings (sampling, context, ``too_long``, chat template, turns, reasoning).
        progress: what to call the work in progress lines on stdout (requests done, their rate, the ETA and
            vLLM's token rates, :func:`draftpipe.core.progress.vllm_progress`); None: no lines.

    Returns:
        With a chat template, the rows and stats of :func:`complete_conversations`; without one, those of
        :func:`complete_plain`.

    Raises:
        draftpipe.core.tokenizer_check.TokenizerGateError: the tokenizer does not give the prompts back, or an
            answer holds byte-level markers. PromptTooLongError, ChatTemplateError, ValueError: see
            :func:`draftpipe.inference.prompting.prepare_prompts`; raised before any generation.
    """
    tokenizer = llm.get_tokenizer()
    # the tokenizer gate: a tokenizer that loses the prompts' text stops the stage before any generation
    check_round_trip(tokenizer, prompt_texts(records), verifier)
    if settings.chat_template_file is not None or getattr(tokenizer, "chat_template", None):
        # conversations are rendered by a tokenizer of our own: vLLM's routes rendering to private copies
        # (vllm/tokenizers/hf.py), which a configured template would not reach
        tokenizer = verifier_tokenizer(verifier, settings.chat_template_file)
        rows, stats = complete_conversations(llm, records, tokenizer, settings, progress=progress)
        check_decoded(
            ((f"{r['id']} answer {i}", t["completion_text"]) for r in rows for i, t in enumerate(r["turns"])),
            verifier,
        )
        return rows, stats
    return complete_plain(llm, records, tokenizer, verifier=verifier, settings=settings, progress=progress)


def complete_plain(
    llm: Any,
    records: list[dict],
    tokenizer: Any,
    *,
    verifier: str,
    settings: CompletionSettings,
    progress: str | None = None,
) -> tuple[list[dict], dict]:
    """Completions of a verifier without a chat template: the last user message as plain text (of the part before
    an unanswered assistant turn: :func:`draftpipe.formats.prompts.answered_prefix`), ``too_long`` as
    :func:`draftpipe.inference.prompting.fit_prompt` says.

    Returns:
        ``(rows, stats)``: one row per sample with ``id``, ``sample``, ``messages``, ``prompt_token_ids``,
        ``completion_token_ids``, ``prompt_text``, ``completion_text``, ``finish_reason``, ``sampling``,
        ``prompt_truncated``, ``vllm_version``, ``chat_template_sha256``; stats are those of
        :func:`draftpipe.inference.prompting.prepare_prompts` plus ``samples``.
    """
    import vllm
    from vllm import SamplingParams

    s = settings
    template_sha = template_hash(getattr(tokenizer, "chat_template", None))
    kept, stats = prepare_prompts(
        records,
        tokenizer,
        max_model_len=s.max_model_len,
        max_tokens=s.max_tokens,
        too_long=s.too_long,
        chat_template=s.chat_template,
        verifier=verifier,
    )
    params = [
        SamplingParams(
            n=s.samples_per_prompt,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=room,
            seed=request_seed(s.seed, rec["id"]),
        )
        for rec, _, room, _ in kept
    ]
    prompts = [{"prompt_token_ids": ids} for _, ids, _, _ in kept]
    bar = vllm_progress(progress, scale=s.samples_per_prompt) if progress else False
    outputs = llm.generate(prompts, sampling_params=params, use_tqdm=bar) if prompts else []
    rows = []
    for (rec, ids, _, cut), sp, out in zip(kept, params, outputs):
        for j, comp in enumerate(out.outputs):
            rows.append(
                {
                    "id": rec["id"],
                    "sample": j,
                    "messages": answered_prefix(rec["messages"]),
                    "prompt_token_ids": list(ids),
                    "prompt_text": tokenizer.decode(ids, skip_special_tokens=False),
                    "prompt_truncated": cut,
                    "completion_token_ids": list(comp.token_ids),
                    "completion_text": comp.text,
                    "finish_reason": comp.finish_reason,
                    "sampling": {
                        "temperature": s.temperature,
                        "top_p": s.top_p,
                        "max_tokens": sp.max_tokens,
                        "n": s.samples_per_prompt,
                        "seed": sp.seed,
                        "base_seed": s.seed,
                    },
                    "vllm_version": vllm.__version__,
                    "chat_template_sha256": template_sha,
                }
            )
    check_decoded(((f"{r['id']} sample {r['sample']}", r["completion_text"]) for r in rows), verifier)
    return rows, {**stats, "samples": len(rows)}


def summary(rows: list[dict], stats: dict) -> str:
    """One line for a person about a finished completions shard: prompts, samples, generated tokens, and what was
    dropped, truncated, flattened or cut (the counts of :func:`complete`'s ``stats``; zero counts are left out)."""
    generated = sum(
        sum(len(t["completion_token_ids"]) for t in r["turns"]) if "turns" in r else len(r["completion_token_ids"])
        for r in rows
    )
    cut = sum(r.get("finish_reason") == "length" for r in rows)
    parts = [f"{stats.get('prompts', 0)} prompts -> {len(rows)} samples, {generated} tokens generated"]
    for key, text in [
        ("dropped_too_long", "dropped as too long"),
        ("truncated_too_long", "truncated as too long"),
        ("last_user_turn_only", "answered on the last user turn only"),
        ("conversations_cut_too_long", "conversations ended early as too long"),
        ("dropped_thinking_when_off", "dropped for thinking with reasoning off"),
    ]:
        if stats.get(key):
            parts.append(f"{stats[key]} {text}")
    if cut:
        parts.append(f"{cut} cut by completions.max_tokens")
    return ", ".join(parts)

"""Multi-turn regeneration: every assistant turn of a chat conversation answered in order on the verifier's own
earlier answers, and the conversation rendered as one training sample (speculators' and SpecForge's rule)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from draftpipe.core.progress import vllm_progress
from draftpipe.formats.chat import (
    THINK_OPEN,
    ChatTemplateError,
    render_conversation,
    split_thinking,
    template_hash,
    template_kwargs,
)
from draftpipe.formats.prompts import generation_points, record_where
from draftpipe.inference.prompting import TOO_LONG_POLICIES, PromptTooLongError
from draftpipe.stages.completions.settings import CompletionSettings, request_seed


def answer_message(text: str, prompt_text: str, reasoning: str) -> tuple[dict, dict]:
    """The assistant message the verifier's generated ``text`` becomes in the conversation, and what it held.

    The thinking span (``<think>...</think>``, :func:`draftpipe.formats.chat.split_thinking`) goes to ``reasoning_content``
    with ``reasoning="keep"``, which templates render back as the span; ``strip`` and ``off`` keep the answer only.
    A generation prompt that already opens the span (``...<think>``, DeepSeek-R1's style) counts as its start.

    Returns:
        ``(message, info)``: ``info`` has ``thinking`` (the span's text or None), ``thinking_cut`` (the text ends
        inside the span: generation stopped there).
    """
    opened = prompt_text.rstrip().endswith(THINK_OPEN)
    thinking, answer, cut = split_thinking((THINK_OPEN if opened else "") + text)
    msg = {"role": "assistant", "content": answer}
    if reasoning == "keep" and thinking is not None:
        msg["reasoning_content"] = thinking
    return msg, {"thinking": thinking, "thinking_cut": cut}


def conversation_rows(
    tokenizer: Any, rec: dict, sample: int, history: list[dict], trained: list[int], turns: list[dict], meta: dict
) -> list[dict]:
    """The training rows of one regenerated conversation (:func:`complete_conversations`).

    A template whose renderings of successive turns are prefixes of each other (most templates) gives one row:
    the whole conversation rendered once, the loss mask 1 on every answer of the verifier
    (:func:`draftpipe.formats.chat.render_conversation`, ``rendering: "conversation"``). A template that rewrites earlier
    turns (Qwen3's drops the thinking of answers before the last user turn) renders no sequence in which every
    answer appears as the verifier generated it; then each answer is a row of its own, the prompt exactly as the
    verifier was served it and the answer's generated tokens, mask 1 on those (``rendering: "turn"``, ``turn`` =
    its index), which is what the draft meets when serving.

    Args:
        tokenizer: the verifier's fast tokenizer with the chat template in use.
        rec: the prompt record (``id``, optional ``tools``).
        sample: the sample index.
        history: the conversation with the verifier's answers in place.
        trained: indices of the answers in ``history``.
        turns: per answer, ``prompt_token_ids``, ``completion_token_ids``, ``finish_reason``, ... (see
            :func:`complete_conversations`).
        meta: fields copied into every row (``sampling``, ``vllm_version``, ``chat_template_sha256``,
            ``template_kwargs``).

    Returns:
        The rows (``id``, ``sample``, ``messages``, ``tools``, ``input_ids``, ``loss_mask``, ``turns``,
        ``finish_reason``, ``rendering``, [``turn``] and ``meta``'s fields).
    """
    base = {
        "id": rec["id"],
        "sample": sample,
        "messages": history,
        **({"tools": rec["tools"]} if rec.get("tools") else {}),
    }
    try:
        ids, mask = render_conversation(
            tokenizer, history, tools=rec.get("tools"), template_kwargs=meta.get("template_kwargs"), train=trained
        )
    except ChatTemplateError:
        out = []
        for k, t in enumerate(turns):
            out.append(
                {
                    **base,
                    "turn": k,
                    "rendering": "turn",
                    "input_ids": list(t["prompt_token_ids"]) + list(t["completion_token_ids"]),
                    "loss_mask": [0] * len(t["prompt_token_ids"]) + [1] * len(t["completion_token_ids"]),
                    "turns": [t],
                    "finish_reason": t["finish_reason"],
                    **meta,
                }
            )
        return out
    cut = any(t["finish_reason"] == "length" for t in turns)
    return [
        {
            **base,
            "rendering": "conversation",
            "input_ids": ids,
            "loss_mask": mask,
            "turns": turns,
            "finish_reason": "length" if cut else turns[-1]["finish_reason"],
            **meta,
        }
    ]


@dataclass
class Branch:
    """One conversation being regenerated (one sample of a prompt once the first round has forked it).

    Attributes:
        rec: the prompt record (``id``, ``messages``, optional ``tools``).
        points: the generation points still to answer (:func:`generation_points`), in order.
        sample: the sample index (None before the first round).
        history: the conversation so far, the verifier's answers in place of the source's.
        pos: the index in ``rec["messages"]`` up to which ``history`` holds the source.
        trained: indices in ``history`` of the verifier's answers.
        turns: per answer, what was sent and generated (see :func:`complete_conversations`).
        too_long: a later turn left no room for a new token: the conversation ended there.
    """

    rec: dict
    points: list[int]
    sample: int | None = None
    history: list[dict] = field(default_factory=list)
    pos: int = 0
    trained: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    too_long: bool = False

    def fork(self, sample: int) -> Branch:
        """Sample ``sample`` of this (first-round) conversation, going on as its own conversation."""
        return Branch(
            self.rec,
            list(self.points),
            sample,
            list(self.history),
            self.pos,
            list(self.trained),
            list(self.turns),
            self.too_long,
        )

    def request_key(self) -> str:
        """What seeds this branch's next request (:func:`request_seed`): the prompt id in the first round, then
        ``id:sample:turn``."""
        return self.rec["id"] if self.sample is None else f"{self.rec['id']}:{self.sample}:{len(self.turns)}"


def next_request(b: Branch, tokenizer: Any, kw: dict, settings: CompletionSettings) -> tuple[list[int], str] | None:
    """The token ids and text of ``b``'s next prompt (its history up to the next generation point, with the
    generation prompt), advancing ``b``; None when ``b`` is finished or its prompt leaves no room for a new token
    (then ``b.too_long``).

    Raises:
        PromptTooLongError: the prompt does not fit and ``settings.too_long`` is ``error``.
    """
    if not b.points:
        return None
    msgs, point = b.rec["messages"], b.points[0]
    history = b.history + [dict(m) for m in msgs[b.pos : point]]
    text = tokenizer.apply_chat_template(
        history, tools=b.rec.get("tools"), add_generation_prompt=True, tokenize=False, **kw
    )
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) > settings.max_model_len - 1:
        if settings.too_long == "error":
            raise PromptTooLongError(
                f"completions.too_long: prompt {record_where(b.rec)} (turn {len(b.turns) + 1}) has {len(ids)} "
                f"tokens, which leaves no room for a new token in verifier.max_model_len={settings.max_model_len} "
                "(set completions.too_long to drop or truncate to go on)"
            )
        b.points = []
        b.too_long = True
        return None
    b.history, b.pos = history, point + 1
    b.points.pop(0)
    return ids, text


def add_answer(b: Branch, ids: list[int], text: str, comp: Any, seed: int, tokenizer: Any, reasoning: str) -> Branch:
    """Put one generated answer (a vLLM ``CompletionOutput``) into ``b``: its message in the history, its index
    among the trained answers, and the turn's record; returns ``b``."""
    msg, info = answer_message(comp.text, text, reasoning)
    b.trained.append(len(b.history))
    b.history.append(msg)
    thinking = info["thinking"]
    b.turns.append(
        {
            "message": len(b.history) - 1,
            "prompt_token_ids": list(ids),
            "completion_token_ids": list(comp.token_ids),
            "completion_text": comp.text,
            "finish_reason": comp.finish_reason,
            "seed": seed,
            "thinking_tokens": len(tokenizer(thinking, add_special_tokens=False)["input_ids"]) if thinking else 0,
            "thinking_cut": info["thinking_cut"],
        }
    )
    return b


def complete_conversations(
    llm: Any, records: list[dict], tokenizer: Any, settings: CompletionSettings, *, progress: str | None = None
) -> tuple[list[dict], dict]:
    """Regenerate the assistant turns of chat conversations in order, each on the verifier's own earlier answers,
    and render every conversation as one training sample (speculators' and SpecForge's multi-turn regeneration).

    Round ``k`` sends, for every conversation still going, its history up to its ``k``-th generation point
    (:func:`generation_points`) with the template's generation prompt; the answer replaces the source's assistant
    turn there. The first round draws ``samples_per_prompt`` samples per conversation (seed :func:`request_seed`
    of the prompt id, as for a single turn); each sample then goes on as its own conversation, one sample per
    later turn (seed of ``id:sample:turn``). A later turn whose prompt leaves no room for a new token ends the
    conversation there (``too_long: error`` raises instead). The first prompt follows ``too_long`` as in
    :func:`draftpipe.inference.prompting.fit_prompt`, except that ``truncate`` drops it too: a cut conversation has no turn structure left.

    Args:
        llm: the ``vllm.LLM`` of :func:`draftpipe.inference.engine.open_engine`.
        records: prompt records (``id``, ``messages``, optional ``tools``).
        tokenizer: the verifier's fast tokenizer with the chat template in use.
        settings: sampling, ``max_model_len`` and ``too_long`` as in
            :func:`draftpipe.stages.completions.generate.complete`; ``turns`` is ``all`` or ``last``
            (:func:`generation_points`); ``reasoning`` is ``keep``, ``strip`` or ``off`` (:func:`answer_message`,
            :func:`draftpipe.formats.chat.template_kwargs`): with ``off`` a row whose answers still hold a non-empty
            thinking span is dropped (SpecForge's rule) and counted.
        progress: as in :func:`~draftpipe.stages.completions.generate.complete`, each round's lines naming its turn.

    Returns:
        ``(rows, stats)``: one row per sample (or, for a template that rewrites earlier turns, per answer: see
        :func:`conversation_rows`) with ``id``, ``sample``, ``messages`` (the conversation as trained,
        the verifier's answers in place), ``tools`` (when given), ``input_ids`` and ``loss_mask`` (the rendering of
        :func:`draftpipe.formats.chat.render_conversation`, 1 exactly on the verifier's answers), ``rendering``
        (``conversation`` or ``turn``), ``turns`` (per generated
        answer: ``message`` index, ``prompt_token_ids``, ``completion_token_ids``, ``completion_text``,
        ``finish_reason``, ``seed``, ``thinking_tokens``, ``thinking_cut``), ``finish_reason`` (``length`` when
        any answer was cut by ``max_tokens``, else the last answer's), ``sampling``, ``vllm_version``,
        ``chat_template_sha256``, ``template_kwargs``. ``stats`` counts ``prompts``, ``kept``,
        ``dropped_too_long``, ``turns_generated``, ``conversations_cut_too_long``, ``dropped_thinking_when_off``,
        ``conversations_per_turn``, ``samples`` (rows).

    Raises:
        PromptTooLongError: ``too_long`` is ``error`` and a prompt does not fit.
        ChatTemplateError: the template rewrites earlier turns (see :mod:`draftpipe.formats.chat`).
        ValueError: unknown ``turns``, ``reasoning`` or ``too_long``.
    """
    from vllm import SamplingParams

    s = settings
    if s.too_long not in TOO_LONG_POLICIES:
        raise ValueError(f"completions.too_long: unknown policy {s.too_long!r} (use drop, truncate or error)")
    kw = template_kwargs(s.reasoning)
    branches = [Branch(r, generation_points(r["messages"], s.turns)) for r in records]
    stats = Counter(prompts=len(records))
    rnd = 0
    while branches:
        batch = [(b, *req) for b in branches if (req := next_request(b, tokenizer, kw, s)) is not None]
        if not batch:
            break
        params = [
            SamplingParams(
                n=s.samples_per_prompt if b.sample is None else 1,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=min(s.max_tokens, s.max_model_len - len(ids)),
                seed=request_seed(s.seed, b.request_key()),
            )
            for b, ids, _ in batch
        ]
        bar = vllm_progress(f"{progress} turn {rnd + 1}", scale=max(p.n for p in params)) if progress else False
        outputs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in batch], sampling_params=params, use_tqdm=bar)
        grown = [
            add_answer(b if b.sample is not None else b.fork(j), ids, text, comp, sp.seed, tokenizer, s.reasoning)
            for (b, ids, text), sp, out in zip(batch, params, outputs)
            for j, comp in enumerate(out.outputs)
        ]
        stats["turns_generated"] += len(grown)
        if rnd == 0:  # the first round forks every conversation into its samples; the rest were not sent
            sent = {id(b) for b, _, _ in batch}
            stats["dropped_too_long"] += sum(1 for b in branches if id(b) not in sent)
            branches = grown
        rnd += 1
    return finished_rows(branches, tokenizer, s, stats)


def finished_rows(
    branches: list[Branch], tokenizer: Any, settings: CompletionSettings, stats: Counter
) -> tuple[list[dict], dict]:
    """The rows of the finished conversations (:func:`conversation_rows`), sorted by id, sample and turn, and the
    stats of :func:`complete_conversations`."""
    import vllm

    s = settings
    template_sha = template_hash(getattr(tokenizer, "chat_template", None))
    kw = template_kwargs(s.reasoning)
    rows = []
    for b in branches:
        stats["conversations_cut_too_long"] += b.too_long
        if s.reasoning == "off" and any(t["thinking_tokens"] for t in b.turns):
            stats["dropped_thinking_when_off"] += 1
            continue
        meta = {
            "sampling": {
                "temperature": s.temperature,
                "top_p": s.top_p,
                "max_tokens": s.max_tokens,
                "n": s.samples_per_prompt,
                "base_seed": s.seed,
                "turns": s.turns,
                "reasoning": s.reasoning,
            },
            "vllm_version": vllm.__version__,
            "chat_template_sha256": template_sha,
            "template_kwargs": kw,
        }
        rows += conversation_rows(tokenizer, b.rec, b.sample, b.history, b.trained, b.turns, meta)
        stats["conversations_per_turn"] += rows[-1]["rendering"] == "turn"
    rows.sort(key=lambda r: (r["id"], r["sample"], r.get("turn", 0)))
    stats["kept"] = len({r["id"] for r in rows})
    stats["samples"] = len(rows)
    return rows, dict(stats)

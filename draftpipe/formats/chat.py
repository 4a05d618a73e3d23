"""Conversations as the verifier's chat template renders them: token ids, the loss mask of the assistant turns, and
thinking spans.

The loss mask of a training sample is 1 exactly on what the verifier generates when served: the content of every
assistant turn (its thinking span, its answer, its tool calls) and the end-of-turn token the template closes it
with; 0 on the system prompt, the user turns, tool results and the template's scaffolding (role headers, the
generation prompt, separators). It comes from the chat template's own rendering, in one of two ways:

- templates that mark assistant output with ``{% generation %}`` blocks: Hugging Face's
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
- any other template: the rendering of the first ``i`` messages with the generation prompt is a prefix of the
  rendering of the first ``i + 1`` (an assistant turn), which is a prefix of the whole conversation; the characters
  in between, less the whitespace the template writes after the turn, are the assistant's
  (:func:`assistant_spans`). A template that rewrites earlier turns (one that drops the thinking of past turns, for
  instance) breaks this and raises :class:`ChatTemplateError` naming the message.

Tokens are mapped to characters with the fast tokenizer's offsets; a token belongs to an assistant turn when its
characters overlap the turn's span.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from draftpipe.core.io import iter_jsonl, sha256_text
from draftpipe.formats.prompts import answered_prefix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


CHAT_TEMPLATE_POLICIES = ("auto", "required")
#: ``completions.reasoning``: thinking spans kept, stripped from the trained answers, or switched off
REASONING = ("keep", "strip", "off")


def template_hash(template: str | dict | list | None) -> str | None:
    """The one SHA-256 of a chat template, whoever holds it: a template's text; a tokenizer's named templates
    (``{name: text}``) or ``tokenizer_config.json``'s list of ``{"name", "template"}``, hashed as canonical JSON of
    ``{name: text}``. None for no template (plain-text prompting).

    Rows record it (``chat_template_sha256``), shards carry it, and a verifier's identity includes it, so the three
    agree on what "the same template" means.
    """
    if not template:
        return None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        return sha256_text(json.dumps(template, sort_keys=True))
    return sha256_text(template)


class TemplateDriftError(ValueError):
    """Rows (or hidden-state shards) rendered with different chat templates would be mixed in one training set; the
    message names the files, lines and hashes."""


def common_template(sources: list[tuple[str, str | None]]) -> str | None:
    """The one chat-template SHA-256 of rows or shards that are trained on together.

    Regeneration and training must see the same template (SpecForge #296: a drift between them trains the draft on
    a rendering vLLM never serves, silently).

    Args:
        sources: ``(where, chat_template_sha256)`` per row or shard (``where`` like ``file:line``), any iterable;
            None stands for plain-text rows (no template).

    Returns:
        The common hash (None when all are plain text or ``sources`` is empty).

    Raises:
        TemplateDriftError: two hashes differ; names the first place of each.
    """
    first: dict = {}
    for where, sha in sources:
        first.setdefault(sha, where)
        if len(first) > 1:
            (a, wa), (b, wb) = list(first.items())[:2]
            raise TemplateDriftError(
                f"{wb} was rendered with chat template {b or 'none (plain text)'}, but {wa} with "
                f"{a or 'none (plain text)'}: rows of two chat templates cannot be trained on together; rerun the "
                "completions of the stale part (snakemake plans them when the template changed)"
            )
    return next(iter(first), None)


def row_templates(paths: list[str]):
    """``(file:line, chat_template_sha256)`` of every row of completions files, read one line at a time (for
    :func:`common_template` over shards too large to hold at once)."""
    for path in paths:
        for i, row in iter_jsonl(path):
            yield f"{path}:{i}", row.get("chat_template_sha256")


class ChatTemplateError(ValueError):
    """``verifier.chat_template`` is ``required`` and the verifier's tokenizer has none; names the verifier."""


def check_chat_template(tokenizer: Any, policy: str = "auto", verifier: str | None = None) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template (config ``verifier.chat_template``).

    Args:
        tokenizer: a Hugging Face tokenizer (only its ``chat_template`` and ``name_or_path`` attributes are read).
        policy: ``"auto"``: use the template when the tokenizer has one, else plain text (see
            :func:`encode_prompt`); ``"required"``: a tokenizer without a template is an error.
        verifier: the verifier's name for the message (default: the tokenizer's ``name_or_path``).

    Returns:
        True when the tokenizer has a chat template, False when prompts are plain text.

    Raises:
        ChatTemplateError: ``policy`` is ``"required"`` and the tokenizer has no chat template.
        ValueError: ``policy`` is not one of :data:`CHAT_TEMPLATE_POLICIES`.
    """
    if policy not in CHAT_TEMPLATE_POLICIES:
        raise ValueError(f"verifier.chat_template: unknown value {policy!r} (use auto or required)")
    has = bool(getattr(tokenizer, "chat_template", None))
    if policy == "required" and not has:
        name = verifier if verifier is not None else getattr(tokenizer, "name_or_path", None) or "?"
        raise ChatTemplateError(
            f"verifier.chat_template: 'required', but the tokenizer of the verifier {name} has no chat template"
        )
    return has


def encode_prompt(
    tokenizer: Any,
    messages: list[dict],
    *,
    chat_template: str = "auto",
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a chat prompt as the verifier sees it.

    With a chat template: ``apply_chat_template(messages, add_generation_prompt=True)``. Without one (a base
    model such as stories260K) the last user message is the raw prompt, tokenized with the tokenizer's special
    tokens (BOS). A base model has no notion of turns, so a system message and earlier turns of a multi-turn prompt
    are left out rather than rejected (every ShareGPT-style source would be unusable otherwise);
    :func:`prepare_prompts` counts such prompts as ``last_user_turn_only``. Set ``chat_template="required"`` to
    refuse a verifier without a template instead.

    Args:
        tokenizer: the verifier's Hugging Face tokenizer.
        messages: ``[{"role", "content"}, ...]`` ending in a user turn (a prompt record's ``messages``); only
            the part before the first unanswered assistant turn is sent
            (:func:`draftpipe.formats.prompts.answered_prefix`: MT-bench's first question).
        chat_template: ``"auto"`` or ``"required"``, see :func:`check_chat_template`.
        tools, template_kwargs: the record's tool definitions and extra template variables
            (:func:`template_kwargs`).

    Returns:
        list of int token ids.

    Raises:
        ChatTemplateError: ``chat_template="required"`` and the tokenizer has no chat template.
        ValueError: ``messages`` has no user turn (and the tokenizer no chat template).
    """
    messages = answered_prefix(messages)
    if check_chat_template(tokenizer, chat_template):
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **dict(template_kwargs or {})
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(last_user_message(messages), add_special_tokens=True)["input_ids"])


def last_user_message(messages: list[dict]) -> str:
    """The content of the last user turn: the raw prompt of a verifier without a chat template.

    Raises:
        ValueError: ``messages`` has no user turn.
    """
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return msg["content"]
    raise ValueError(
        f"a prompt with no user turn ({len(messages)} messages) cannot be sent to a verifier without a chat template"
    )


def template_kwargs(reasoning: str) -> dict:
    """Chat-template variables for ``completions.reasoning``: ``off`` passes the template's thinking switch
    (``enable_thinking=False``, Qwen3's and the package's tiny template's name for it).

    Raises:
        ValueError: ``reasoning`` is not one of :data:`REASONING`.
    """
    if reasoning not in REASONING:
        raise ValueError(f"completions.reasoning: unknown value {reasoning!r} (use keep, strip or off)")
    return {"enable_thinking": False} if reasoning == "off" else {}


def tiny_chat_template() -> str:
    """The package's small chat template for the embedded stories260K (``draftpipe/data/chat_templates/
    tiny_chat.jinja``): system, user, assistant (optional ``reasoning_content`` in ``<think>...</think>`` and
    ``tool_calls`` as ``<tool>name(arguments)</tool>``) and tool turns, one per line; ``enable_thinking=False``
    closes an empty thinking span in the generation prompt, like Qwen3's template."""
    return resources.files("draftpipe").joinpath("data/chat_templates/tiny_chat.jinja").read_text()


#: ``verifier.chat_template_file`` values that name a template of the package instead of a file
PACKAGE_TEMPLATES = {"tiny_chat": tiny_chat_template}


def template_text(spec: str | None, field: str = "verifier.chat_template_file") -> str | None:
    """The text of a configured chat template: a name of :data:`PACKAGE_TEMPLATES` or a Jinja file; None for None.

    Raises:
        FileNotFoundError: naming ``field`` when the file does not exist.
    """
    if spec is None:
        return None
    if spec in PACKAGE_TEMPLATES:
        return PACKAGE_TEMPLATES[spec]()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"{field}: {spec} does not exist (a Jinja chat template file, or one of "
            f"{', '.join(sorted(PACKAGE_TEMPLATES))})"
        )
    return path.read_text(encoding="utf-8")


def template_file_hash(spec: str | None) -> str | None:
    """:func:`template_hash` of :func:`template_text`, or None."""
    return template_hash(template_text(spec))


def planned_template(spec: str | None, sha256: str | None) -> str | None:
    """``spec`` (``verifier.chat_template_file``) after checking that its content is what the workflow was planned
    with (``sha256``, a param of the job).

    Raises:
        RuntimeError: the file changed after the workflow was parsed.
    """
    if template_file_hash(spec) != sha256:
        raise RuntimeError(
            f"verifier.chat_template_file: {spec} changed after the workflow was planned; run snakemake again"
        )
    return spec


def verifier_tokenizer(verifier: str, spec: str | None = None) -> Any:
    """The verifier's Hugging Face tokenizer with the configured chat template (:func:`use_template`)."""
    from transformers import AutoTokenizer

    return use_template(AutoTokenizer.from_pretrained(verifier), spec)


def use_template(tokenizer: Any, spec: str | None) -> Any:
    """Give ``tokenizer`` the configured chat template (``verifier.chat_template_file``) in place of its own; a
    None ``spec`` leaves it as it is. Returns the tokenizer."""
    text = template_text(spec)
    if text is not None:
        tokenizer.chat_template = text
    return tokenizer


def _render(tokenizer: Any, messages: list[dict], *, generation_prompt: bool, tools, kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )


def assistant_spans(
    tokenizer: Any,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    train: list[int] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered by the tokenizer's chat template, and the character span ``[start, end)`` of
    each assistant turn in it (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content", ...}, ...]``; assistant turns may carry ``reasoning_content`` and
            ``tool_calls`` when the template renders them.
        tools: tool definitions passed to the template.
        template_kwargs: extra template variables (``enable_thinking``, ...).
        train: indices of the assistant messages to give spans (default: every assistant message).

    Returns:
        ``(text, spans)``: one span per assistant message of ``train``, in order.

    Raises:
        ChatTemplateError: the tokenizer has no chat template, or the rendering of a conversation up to an
            assistant turn is not a prefix of the next one (names the message index and role).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template: a conversation needs one"
        )
    kw = dict(template_kwargs or {})
    text = _render(tokenizer, messages, generation_prompt=False, tools=tools, kwargs=kw)
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant" or (train is not None and i not in train):
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True, tools=tools, kwargs=kw) if i else ""
        upto = _render(tokenizer, messages[: i + 1], generation_prompt=False, tools=tools, kwargs=kw)
        if not upto.startswith(before) or not text.startswith(upto):
            which = "the generation prompt before it" if not upto.startswith(before) else "the whole conversation"
            raise ChatTemplateError(
                f"message {i} (assistant): the chat template renders the conversation up to this turn so that it is "
                f"not a prefix of {which} (the template rewrites earlier turns, e.g. drops their thinking), so the "
                "assistant tokens cannot be told apart; use a template with {% generation %} blocks"
            )
        end = len(before) + len(upto[len(before) :].rstrip())
        spans.append((len(before), end))
    return text, spans


def render_conversation(
    tokenizer: Any,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    train: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation as the verifier's chat template renders it, and its loss mask.

    Args:
        tokenizer: a fast Hugging Face tokenizer with a chat template.
        messages, tools, template_kwargs, train: see :func:`assistant_spans`; the assistant messages outside
            ``train`` (a source's tool-call turns kept as context) are masked 0.

    Returns:
        ``(input_ids, loss_mask)``: two lists of int of equal length ``T``; ``loss_mask[t]`` is 1 on the tokens of
        the trained assistant turns (content and the template's end-of-turn token) and 0 elsewhere.

    Raises:
        ChatTemplateError: see :func:`assistant_spans`. ValueError: the tokenizer is not a fast tokenizer (no
            character offsets).
    """
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if "{% generation %}" in template or "{%- generation %}" in template:
        out = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **dict(template_kwargs or {}),
        )
        mask = [int(m) for m in out["assistant_masks"]]
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if train is not None and set(assistants) - set(train):
            # one {% generation %} run per assistant message, in order: zero the runs of the untrained ones
            runs = [t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])]
            if len(runs) != len(assistants):
                raise ChatTemplateError(
                    f"the chat template's {{% generation %}} blocks mark {len(runs)} runs for "
                    f"{len(assistants)} assistant messages: the untrained ones cannot be masked"
                )
            for start, i in zip(runs, assistants):
                if i not in train:
                    t = start
                    while t < len(mask) and mask[t]:
                        mask[t] = 0
                        t += 1
        return list(out["input_ids"]), mask
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '?')} is not a fast tokenizer: its "
            "tokens cannot be mapped to the template's assistant spans"
        )
    text, spans = assistant_spans(tokenizer, messages, tools=tools, template_kwargs=template_kwargs, train=train)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for start, end in enc["offset_mapping"]:
        mask.append(int(any(start < s_end and end > s_start for s_start, s_end in spans)))
    return list(enc["input_ids"]), mask


def split_thinking(text: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> tuple[str | None, str, bool]:
    """Split a generated answer into its thinking span and the rest.

    Returns:
        ``(thinking, answer, cut)``: ``thinking`` is the text between ``open_tag`` and ``close_tag`` (``None``
        when the text has no ``open_tag``); ``answer`` is the text with the span (and its tags) removed;
        ``cut`` is True when the span is opened and never closed (generation stopped inside it: then the whole
        rest is thinking and the answer is what came before the tag).
    """
    start = text.find(open_tag)
    if start < 0:
        return None, text, False
    end = text.find(close_tag, start + len(open_tag))
    if end < 0:
        return text[start + len(open_tag) :], text[:start], True
    return text[start + len(open_tag) : end], text[:start] + text[end + len(close_tag) :], False

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

from importlib import resources
from pathlib import Path
from typing import Any

from draftpipe.completions import ChatTemplateError
from draftpipe.io import sha256_text

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


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
        raise FileNotFoundError(f"{field}: {spec} does not exist (a Jinja chat template file, or one of "
                                f"{', '.join(sorted(PACKAGE_TEMPLATES))})")
    return path.read_text(encoding="utf-8")


def template_sha256(spec: str | None) -> str | None:
    """SHA-256 of :func:`template_text` (what :func:`draftpipe.completions.chat_template_hash` records), or None."""
    text = template_text(spec)
    return None if text is None else sha256_text(text)


def planned_template(spec: str | None, sha256: str | None) -> str | None:
    """``spec`` (``verifier.chat_template_file``) after checking that its content is what the workflow was planned
    with (``sha256``, a param of the job).

    Raises:
        RuntimeError: the file changed after the workflow was parsed.
    """
    if template_sha256(spec) != sha256:
        raise RuntimeError(f"verifier.chat_template_file: {spec} changed after the workflow was planned; run "
                           "snakemake again")
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
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)


def assistant_spans(tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None,
                    train: list[int] | None = None) -> tuple[str, list[tuple[int, int]]]:
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
        raise ChatTemplateError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template: a "
                                "conversation needs one")
    kw = dict(template_kwargs or {})
    text = _render(tokenizer, messages, generation_prompt=False, tools=tools, kwargs=kw)
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant" or (train is not None and i not in train):
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True, tools=tools, kwargs=kw) if i else ""
        upto = _render(tokenizer, messages[:i + 1], generation_prompt=False, tools=tools, kwargs=kw)
        if not upto.startswith(before) or not text.startswith(upto):
            which = "the generation prompt before it" if not upto.startswith(before) else "the whole conversation"
            raise ChatTemplateError(
                f"message {i} (assistant): the chat template renders the conversation up to this turn so that it is "
                f"not a prefix of {which} (the template rewrites earlier turns, e.g. drops their thinking), so the "
                "assistant tokens cannot be told apart; use a template with {% generation %} blocks")
        end = len(before) + len(upto[len(before):].rstrip())
        spans.append((len(before), end))
    return text, spans


def render_conversation(tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None,
                        template_kwargs: dict | None = None,
                        train: list[int] | None = None) -> tuple[list[int], list[int]]:
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
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **dict(template_kwargs or {}))
        mask = [int(m) for m in out["assistant_masks"]]
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if train is not None and set(assistants) - set(train):
            # one {% generation %} run per assistant message, in order: zero the runs of the untrained ones
            runs = [t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])]
            if len(runs) != len(assistants):
                raise ChatTemplateError(f"the chat template's {{% generation %}} blocks mark {len(runs)} runs for "
                                        f"{len(assistants)} assistant messages: the untrained ones cannot be masked")
            for start, i in zip(runs, assistants):
                if i not in train:
                    t = start
                    while t < len(mask) and mask[t]:
                        mask[t] = 0
                        t += 1
        return list(out["input_ids"]), mask
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '?')} is not a fast tokenizer: its "
                         "tokens cannot be mapped to the template's assistant spans")
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
        return text[start + len(open_tag):], text[:start], True
    return text[start + len(open_tag):end], text[:start] + text[end + len(close_tag):], False

"""Conversations rendered by the verifier's chat template: the loss mask of the assistant turns, token for token, on
the embedded stories260K with the package's tiny chat template (system prompt, thinking, a tool call)."""

from __future__ import annotations

import pytest

from draftpipe.chat import assistant_spans, render_conversation, split_thinking, tiny_chat_template
from draftpipe.completions import ChatTemplateError

CONVERSATION = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": "{}"}}]},
    {"role": "tool", "content": "sun"},
    {"role": "assistant", "content": "Sunny."},
]

# The rendering cut where the mask changes, written out by hand from the template: role headers, the system prompt,
# user turns, the tool result and the newline after each turn are 0; each assistant turn (thinking span, answer or
# tool call, and the end-of-turn </s>) is 1. The last answer's first token carries the space of "Assistant: " with
# it ("▁S"), so that run starts one character early.
EXPECTED_RUNS = [
    ("<s>System: Be kind.\nUser: Hi\nAssistant: ", 0),
    ("<think>greet</think>Hello.</s>", 1),
    ("\nUser: Weather?\nAssistant: ", 0),
    ("<tool>get({})</tool></s>", 1),
    ("\nTool: sun\nAssistant:", 0),
    (" Sunny.</s>", 1),
    ("\n", 0),
]


@pytest.fixture(scope="module")
def tokenizer(verifier_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    tok.chat_template = tiny_chat_template()
    return tok


def runs(tokenizer, ids, mask):
    """The rendered text cut into runs of equal mask, each run's text taken from the tokens' character offsets."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(ids)
    out = []
    for (start, end), m in zip(offsets, mask):
        if out and out[-1][1] == m:
            out[-1] = (out[-1][0] + text[out[-1][2]:end], m, end)
        else:
            out.append((text[start:end] if not out else text[out[-1][2]:end], m, end))
    return [(t, m) for t, m, _ in out]


def test_loss_mask_equals_the_hand_built_mask(tokenizer):
    ids, mask = render_conversation(tokenizer, CONVERSATION)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert runs(tokenizer, ids, mask) == EXPECTED_RUNS
    assert ids == tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]


def test_generation_blocks_give_the_same_mask(tokenizer):
    # the same template with {% generation %} blocks: Hugging Face's assistant mask, an independent computation
    tagged = tiny_chat_template().replace(
        "Assistant: {% if m.reasoning_content", "Assistant: {% generation %}{% if m.reasoning_content").replace(
        "{{ eos_token }}\n{% elif", "{{ eos_token }}{% endgeneration %}{{ '\\n' }}{% elif")
    assert tagged.count("generation %}") == 2
    plain = render_conversation(tokenizer, CONVERSATION)
    tokenizer.chat_template = tagged
    try:
        assert render_conversation(tokenizer, CONVERSATION) == plain
    finally:
        tokenizer.chat_template = tiny_chat_template()


def test_spans_and_the_thinking_switch(tokenizer):
    text, spans = assistant_spans(tokenizer, CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["<think>greet</think>Hello.</s>", "<tool>get({})</tool></s>", "Sunny.</s>"]
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
    assert prompt.endswith("Assistant: <think></think>")
    assert not tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True).endswith(
        "</think>")


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    # drops the thinking of every assistant turn but the last, as some reasoning models' templates do
    rewriting = tiny_chat_template().replace("{% if m.reasoning_content is defined and m.reasoning_content %}",
                                             "{% if m.reasoning_content is defined and m.reasoning_content and loop.last %}")
    tokenizer.chat_template = rewriting
    try:
        with pytest.raises(ChatTemplateError, match=r"^message 2 \(assistant\): .* not a prefix of the whole conversation"):
            render_conversation(tokenizer, CONVERSATION)
    finally:
        tokenizer.chat_template = tiny_chat_template()


def test_no_chat_template_is_an_error(verifier_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ChatTemplateError, match="has no chat template"):
        assistant_spans(AutoTokenizer.from_pretrained(str(verifier_dir)), CONVERSATION)


@pytest.mark.parametrize("text,expected", [
    ("plain answer", (None, "plain answer", False)),
    ("<think>plan</think>answer", ("plan", "answer", False)),
    ("<think></think>answer", ("", "answer", False)),
    ("<think>still thinking when cut", ("still thinking when cut", "", True)),
    ("pre<think>a</think>post", ("a", "prepost", False)),
])
def test_split_thinking(text, expected):
    assert split_thinking(text) == expected

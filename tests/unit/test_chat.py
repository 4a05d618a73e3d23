"""Conversations rendered by the verifier's chat template: the loss mask of the assistant turns, token for token, on
the embedded stories260K with the package's tiny chat template (system prompt, thinking, a tool call)."""

from __future__ import annotations

import pytest

from draftpipe.formats.chat import (
    ChatTemplateError,
    assistant_spans,
    render_conversation,
    split_thinking,
    tiny_chat_template,
)

CONVERSATION = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": "{}"}}],
    },
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
            out[-1] = (out[-1][0] + text[out[-1][2] : end], m, end)
        else:
            out.append((text[start:end] if not out else text[out[-1][2] : end], m, end))
    return [(t, m) for t, m, _ in out]


def test_loss_mask_equals_the_hand_built_mask(tokenizer):
    ids, mask = render_conversation(tokenizer, CONVERSATION)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert runs(tokenizer, ids, mask) == EXPECTED_RUNS
    assert (
        ids
        == tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    )


def test_generation_blocks_give_the_same_mask(tokenizer):
    # the same template with {% generation %} blocks: Hugging Face's assistant mask, an independent computation
    tagged = (
        tiny_chat_template()
        .replace("Assistant: {% if enable_thinking", "Assistant: {% generation %}{% if enable_thinking", 1)
        .replace("{{ eos_token }}\n{% elif", "{{ eos_token }}{% endgeneration %}{{ '\\n' }}{% elif")
    )
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
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("Assistant: <think></think>")
    assert not tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True).endswith(
        "</think>"
    )


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    # drops the thinking of every assistant turn but the last, as some reasoning models' templates do
    rewriting = tiny_chat_template().replace(
        "{% elif m.reasoning_content is defined and m.reasoning_content %}",
        "{% elif m.reasoning_content is defined and m.reasoning_content and loop.last %}",
    )
    tokenizer.chat_template = rewriting
    try:
        with pytest.raises(
            ChatTemplateError, match=r"^message 2 \(assistant\): .* not a prefix of the whole conversation"
        ):
            render_conversation(tokenizer, CONVERSATION)
    finally:
        tokenizer.chat_template = tiny_chat_template()


def test_no_chat_template_is_an_error(verifier_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ChatTemplateError, match="has no chat template"):
        assistant_spans(AutoTokenizer.from_pretrained(str(verifier_dir)), CONVERSATION)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("plain answer", (None, "plain answer", False)),
        ("<think>plan</think>answer", ("plan", "answer", False)),
        ("<think></think>answer", ("", "answer", False)),
        ("<think>still thinking when cut", ("still thinking when cut", "", True)),
        ("pre<think>a</think>post", ("a", "prepost", False)),
    ],
)
def test_split_thinking(text, expected):
    assert split_thinking(text) == expected


def test_untrained_assistant_turns_are_masked_zero(tokenizer):
    # the source's tool-call turn (message 4) is context: its tokens are 0 in both ways of finding spans
    trained = [2, 6]
    expected = [(t, 0 if t.startswith("<tool>") else m) for t, m in EXPECTED_RUNS]
    merged = []
    for t, m in expected:
        merged = merged[:-1] + [(merged[-1][0] + t, m)] if merged and merged[-1][1] == m else merged + [(t, m)]
    ids, mask = render_conversation(tokenizer, CONVERSATION, train=trained)
    assert runs(tokenizer, ids, mask) == merged
    tagged = (
        tiny_chat_template()
        .replace("Assistant: {% if enable_thinking", "Assistant: {% generation %}{% if enable_thinking", 1)
        .replace("{{ eos_token }}\n{% elif", "{{ eos_token }}{% endgeneration %}{{ '\\n' }}{% elif")
    )
    tokenizer.chat_template = tagged
    try:
        assert render_conversation(tokenizer, CONVERSATION, train=trained) == (ids, mask)
    finally:
        tokenizer.chat_template = tiny_chat_template()


def test_generation_points():
    from draftpipe.stages.completions.conversations import generation_points

    assert generation_points(CONVERSATION[:-1], "all") == [2, 6]  # the tool-call turn 4 stays; then the answer
    assert generation_points(CONVERSATION[:-1], "last") == [6]
    # an unanswered turn (MT-bench's answers) has no text to keep as context: generated with either
    mt = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": None}, {"role": "user", "content": "q2"}]
    assert generation_points(mt, "all") == generation_points(mt, "last") == [1, 3]
    with pytest.raises(ValueError, match="completions.turns: unknown value 'some'"):
        generation_points(CONVERSATION, "some")


def test_a_prompt_is_sent_up_to_its_first_unanswered_turn(tokenizer):
    """Stages that only prompt the verifier (benchmarks, live check) send MT-bench's first question, with the
    template's generation prompt, and a verifier without a template its last user message before that turn."""
    from draftpipe.formats.chat import encode_prompt

    mt = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": None}, {"role": "user", "content": "q2"}]
    ids = encode_prompt(tokenizer, mt)
    assert ids == encode_prompt(tokenizer, mt[:1])
    assert tokenizer.decode(ids).endswith("q1\nAssistant: ") and "q2" not in tokenizer.decode(ids)
    template = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        assert encode_prompt(tokenizer, mt) == list(tokenizer("q1", add_special_tokens=True)["input_ids"])
    finally:
        tokenizer.chat_template = template


@pytest.mark.parametrize(
    "reasoning,prompt,text,message,info",
    [
        (
            "keep",
            "Assistant: ",
            "<think>plan</think>Hello.",
            {"content": "Hello.", "reasoning_content": "plan"},
            {"thinking": "plan", "thinking_cut": False},
        ),
        (
            "strip",
            "Assistant: ",
            "<think>plan</think>Hello.",
            {"content": "Hello."},
            {"thinking": "plan", "thinking_cut": False},
        ),
        (
            "keep",
            "Assistant: <think>",
            "plan</think>Hello.",
            {"content": "Hello.", "reasoning_content": "plan"},
            {"thinking": "plan", "thinking_cut": False},
        ),  # the generation prompt opened the span (DeepSeek-R1 style)
        (
            "keep",
            "Assistant: <think>",
            "still planning",
            {"content": "", "reasoning_content": "still planning"},
            {"thinking": "still planning", "thinking_cut": True},
        ),
        (
            "off",
            "Assistant: <think></think>",
            "Hello.",
            {"content": "Hello."},
            {"thinking": None, "thinking_cut": False},
        ),
    ],
)
def test_answer_message(reasoning, prompt, text, message, info):
    from draftpipe.stages.completions.conversations import answer_message

    assert answer_message(text, prompt, reasoning) == ({"role": "assistant", **message}, info)


def test_strip_leaves_no_thinking_in_any_trained_token_and_keep_trains_on_it(tokenizer):
    from draftpipe.stages.completions.conversations import answer_message

    generated = ["<think>a cat</think>The cat sat.", "<think>a dog</think>The dog ran."]
    for reasoning in ("strip", "keep"):
        conv = [{"role": "user", "content": "Hi"}]
        for text, user in zip(generated, ["More", None]):
            conv.append(answer_message(text, "Assistant: ", reasoning)[0])
            if user:
                conv.append({"role": "user", "content": user})
        ids, mask = render_conversation(tokenizer, conv)
        trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        if reasoning == "strip":
            assert "think" not in tokenizer.decode(ids) and trained.replace(" ", "") == "Thecatsat.</s>Thedogran.</s>"
        else:
            assert trained.replace(" ", "") == "<think>acat</think>Thecatsat.</s><think>adog</think>Thedogran.</s>"


def test_off_renders_with_the_templates_switch(tokenizer):
    from draftpipe.formats.chat import template_kwargs

    assert template_kwargs("off") == {"enable_thinking": False} and template_kwargs("keep") == {} == template_kwargs(
        "strip"
    )
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ids, mask = render_conversation(tokenizer, conv, template_kwargs=template_kwargs("off"))
    text = tokenizer.decode(ids)
    assert "User: Hi\nAssistant: <think></think>" in text
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]).replace(" ", "") == "Hello.</s>"  # not the switch


def test_completion_stats_count_exactly():
    from draftpipe.stages.completions.stats import completion_stats

    def row(pid, turns, finish="stop", mask=(0, 1), sha="a" * 64):
        return {
            "id": pid,
            "turns": turns,
            "finish_reason": finish,
            "loss_mask": list(mask),
            "chat_template_sha256": sha,
        }

    think = {"thinking_tokens": 5, "thinking_cut": False}
    cut = {"thinking_tokens": 3, "thinking_cut": True}
    plain = {"thinking_tokens": 0, "thinking_cut": False}
    shards = {
        "s0": [row("p", [think, plain]), row("p", [plain], "length"), row("q", [cut], "length", (0, 0))],
        "s1": [row("r", [plain, plain, think])],
    }
    stats = completion_stats(shards)
    assert {
        k: stats[k]
        for k in (
            "rows",
            "prompts",
            "turns",
            "truncated",
            "rows_with_thinking",
            "thinking_tokens",
            "truncated_in_thinking",
            "empty_loss_mask",
        )
    } == {
        "rows": 4,
        "prompts": 3,
        "turns": 7,
        "truncated": 2,
        "rows_with_thinking": 3,
        "thinking_tokens": 13,
        "truncated_in_thinking": 1,
        "empty_loss_mask": 1,
    }
    assert stats["per_shard"]["s1"]["turns"] == 3 and stats["chat_template_sha256"] == "a" * 64


def test_rows_of_two_templates_are_refused():
    from draftpipe.formats.chat import TemplateDriftError, common_template

    assert common_template([("f:1", "a" * 64), ("f:2", "a" * 64)]) == "a" * 64
    with pytest.raises(TemplateDriftError, match=r"^g:3 was rendered with chat template b{64}, but f:1 with a{64}: "):
        common_template([("f:1", "a" * 64), ("f:2", "a" * 64), ("g:3", "b" * 64)])
    with pytest.raises(TemplateDriftError, match=r"^f:2 was rendered with chat template none \(plain text\)"):
        common_template([("f:1", "a" * 64), ("f:2", None)])


def test_truncation_gate_trips_above_the_threshold_and_passes_at_it():
    from draftpipe.core.gates import QualityGateError, check_truncated

    rows = [
        {"finish_reason": "length"},
        {"finish_reason": "stop"},
        {"finish_reason": "length"},
        {"finish_reason": "stop"},
    ]
    assert check_truncated(rows, 0.5, "c.jsonl") == 0.5
    with pytest.raises(
        QualityGateError,
        match=r"^c.jsonl: 2 of 4 rows \(50.0%\) end with finish_reason=length, above "
        r"completions.max_truncated_fraction=0.4",
    ):
        check_truncated(rows, 0.4, "c.jsonl")


def test_empty_mask_gate_on_a_real_shard(tmp_path):
    import torch

    from draftpipe.core.gates import QualityGateError, check_empty_masks
    from draftpipe.formats.hidden_states import loss_mask_sums, write_shard

    def sample(mask):
        t = len(mask)
        return {
            "input_ids": torch.arange(t),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
            "hidden_states": torch.zeros(t, 6),
            "verifier_last_hidden_states": torch.zeros(t, 2),
        }

    path = tmp_path / "train_00000.safetensors"
    write_shard(str(path), [sample([0, 1, 1]), sample([0, 0, 0]), sample([0, 1, 0]), sample([1, 1, 1])], {})
    assert loss_mask_sums(str(path)) == [2, 0, 1, 3]
    assert check_empty_masks(loss_mask_sums(str(path)), 0.25, str(path)) == 0.25
    with pytest.raises(
        QualityGateError,
        match=rf"^{path}: 1 of 4 samples \(25.0%\) have an empty loss mask, above "
        r"hidden_states.max_empty_mask_fraction=0.2; ",
    ):
        check_empty_masks(loss_mask_sums(str(path)), 0.2, str(path))


def test_acceptance_gate():
    from draftpipe.core.gates import QualityGateError, check_acceptance

    def res(k, t, b, a, name="eval"):
        return {
            "prompt_set": name,
            "num_speculative_tokens": k,
            "temperature": t,
            "batch_size": b,
            "acceptance_length": a,
        }

    summary = {"results": [res(1, 0.0, 8, 1.2), res(3, 0.0, 8, 1.9), res(3, 0.6, 8, 1.7), res(3, 0.0, 8, 1.1, "gsm8k")]}
    assert check_acceptance(summary, None, "s.json") is None  # off by default
    assert check_acceptance(summary, 1.7, "s.json") == 1.7  # the largest k at every temperature; other sets ignored
    with pytest.raises(
        QualityGateError,
        match=r"^s.json: the served acceptance length on the eval prompts is 1.700 at "
        r"num_speculative_tokens=3, temperature=0.6, batch_size=8, below "
        r"bench.min_acceptance_length=1.8$",
    ):
        check_acceptance(summary, 1.8, "s.json")


def test_a_template_that_rewrites_earlier_turns_trains_each_answer_as_served(tokenizer):
    from draftpipe.stages.completions.conversations import answer_message, conversation_rows

    generated = ["<think>a cat</think>The cat sat.", "<think>a dog</think>The dog ran."]
    rewriting = tiny_chat_template().replace(
        "{% elif m.reasoning_content is defined and m.reasoning_content %}",
        "{% elif m.reasoning_content is defined and m.reasoning_content and loop.last %}",
    )

    def regenerate():
        history, trained, turns = [{"role": "user", "content": "Hi"}], [], []
        for text, user in zip(generated, ["More", None]):
            prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            turns.append(
                {
                    "prompt_token_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
                    "completion_token_ids": tokenizer(text + "</s>", add_special_tokens=False)["input_ids"],
                    "finish_reason": "stop",
                }
            )
            trained.append(len(history))
            history.append(answer_message(text, prompt, "keep")[0])
            if user:
                history.append({"role": "user", "content": user})
        return conversation_rows(tokenizer, {"id": "c"}, 0, history, trained, turns, {"chat_template_sha256": "x"})

    stable = regenerate()
    assert [r["rendering"] for r in stable] == ["conversation"] and stable[0]["chat_template_sha256"] == "x"
    tokenizer.chat_template = rewriting
    try:
        rows = regenerate()
    finally:
        tokenizer.chat_template = tiny_chat_template()
    assert [(r["rendering"], r["turn"]) for r in rows] == [("turn", 0), ("turn", 1)]
    for row in rows:
        (turn,) = row["turns"]
        assert row["input_ids"] == turn["prompt_token_ids"] + turn["completion_token_ids"]
        assert row["loss_mask"] == [0] * len(turn["prompt_token_ids"]) + [1] * len(turn["completion_token_ids"])
    # the second answer's prompt is the history as the rewriting template serves it: without the first thinking
    second = tokenizer.decode(rows[1]["turns"][0]["prompt_token_ids"])
    assert "The cat sat." in second and "a cat" not in second

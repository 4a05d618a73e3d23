"""A real chat model end to end, correct to the token: SmolLM2-135M-Instruct (Llama, byte-level BPE vocabulary of
49,152, ChatML template) from its Q4_1 GGUF, through the `verifier` and `completions` rules of the preset
``configs/smollm2-135m.yaml`` with a tiny budget (a few prompts, short answers), built once per session.

The oracle is transformers' own model and tokenizer loaded straight from the GGUF (``from_pretrained(...,
gguf_file=...)``): vLLM's greedy tokens on the converted verifier, the rendered prompts and the loss masks must
agree with it. The GGUF comes from ``bash envs/setup.sh smollm2``; without it these tests skip, unless
``DRAFTPIPE_REQUIRE_SMOLLM2=1`` (CI) makes its absence a failure.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import CORES, REPO
from helpers.workflow import copy_workflow, snakemake

GGUF = REPO / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BYTE_LEVEL = ("\u0120", "\u010a")  # Ġ Ċ

if not GGUF.is_file():
    if os.environ.get("DRAFTPIPE_REQUIRE_SMOLLM2"):
        raise RuntimeError(f"{GGUF} is missing: run `bash envs/setup.sh smollm2` first")
    pytest.skip("the SmolLM2 GGUF is not fetched (bash envs/setup.sh smollm2)", allow_module_level=True)


@pytest.fixture(scope="session")
def smol_build(tmp_path_factory):
    """The preset's verifier and completions with a tiny budget: 2 MT-bench conversations (two questions each), 2
    GSM8K questions and 2 TinyStories openings, one shard, answers of at most 24 tokens, greedy."""
    work = copy_workflow(tmp_path_factory.mktemp("smollm2"))
    (work / ".models").mkdir()
    (work / ".models" / GGUF.name).symlink_to(GGUF)
    cfg = yaml.safe_load((REPO / "configs" / "smollm2-135m.yaml").read_text())
    for src in cfg["prompts"]["sources"]:
        src["max_records"] = 2
    cfg["prompts"].update(num_shards=1, eval_fraction=0.01)
    cfg["completions"].update(max_tokens=24, max_truncated_fraction=1.0)  # short answers are cut, on purpose
    (work / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(work, "results/completions/train_00000.jsonl", "--configfile", "tiny.yaml")
    rows = [json.loads(line) for line in (work / "results/completions/train_00000.jsonl").read_text().splitlines()]
    return work, rows, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def oracle():
    """transformers' tokenizer and model straight from the GGUF (dequantized to float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(CORES)
    tok = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name).eval()
    return tok, model


def test_the_plan_says_how_the_gguf_is_converted(smol_build):
    _, _, console = smol_build
    assert (
        "verifier: GGUF converted to a Hugging Face directory, its Q4_1, Q8_0 tensors dequantized to float32; gpt2 "
        "tokenizer, its chat template kept; head_dim 64; context 8,192"
    ) in console


def test_the_converted_verifier_keeps_the_gguf_s_tokenizer_and_template(smol_build, oracle):
    from transformers import AutoTokenizer

    from draftpipe.formats.verifier import gguf_metadata

    work, _, _ = smol_build
    verifier = work / "results" / "verifier"
    tok = AutoTokenizer.from_pretrained(verifier)
    assert tok.chat_template == gguf_metadata(GGUF)["chat_template"] == oracle[0].chat_template
    assert json.loads((verifier / "tokenizer_config.json").read_text())["tokenizer_class"] != "LlamaTokenizer"
    text = "Carlos is planting a lemon tree. The tree will cost $90 to plant.\nThe answer is 152."
    assert tok(text)["input_ids"] == oracle[0](text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text
    cfg = json.loads((verifier / "config.json").read_text())
    assert (cfg["head_dim"], cfg["max_position_embeddings"], cfg["vocab_size"]) == (64, 8192, 49152)


def test_every_prompt_is_rendered_by_the_gguf_s_chat_template(smol_build, oracle):
    """Each answer's prompt is ``apply_chat_template`` of the GGUF's template over the conversation before it."""
    from draftpipe.formats.chat import template_hash

    _, rows, _ = smol_build
    tok = oracle[0]
    answers = 0
    for row in rows:
        assert row["chat_template_sha256"] == template_hash(tok.chat_template)
        for turn in row["turns"]:
            before = row["messages"][: turn["message"]]
            want = tok.apply_chat_template(before, add_generation_prompt=True, tokenize=False)
            assert turn["prompt_token_ids"] == tok(want, add_special_tokens=False)["input_ids"]
            assert want.startswith("<|im_start|>system\n") and want.endswith("<|im_start|>assistant\n")
            answers += 1
    assert answers >= len(rows) == 6
    # MT-bench's second question is asked after the verifier's own first answer (multi-turn regeneration)
    two = [row for row in rows if len(row["turns"]) == 2]
    assert len(two) == 2 and answers == 8
    for row in two:
        first, second = row["turns"]
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant"]
        assert row["messages"][first["message"]]["content"] == first["completion_text"].removesuffix("<|im_end|>")
        asked = tok.decode(second["prompt_token_ids"])
        assert asked.startswith(tok.decode(first["prompt_token_ids"]) + first["completion_text"].rstrip("\n"))


def test_vllm_greedy_tokens_equal_transformers_from_the_gguf(smol_build, oracle):
    import torch

    _, rows, _ = smol_build
    _, model = oracle
    for row in rows[:3]:
        turn = row["turns"][0]
        ids = turn["prompt_token_ids"]
        n = len(turn["completion_token_ids"])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        assert out[0, len(ids) :].tolist() == turn["completion_token_ids"], row["id"]


def test_completions_are_readable_text(smol_build):
    _, rows, _ = smol_build
    for row in rows:
        for turn in row["turns"]:
            text = turn["completion_text"]
            assert text.strip() and not any(m in text for m in BYTE_LEVEL), text
        for msg in row["messages"]:
            assert not any(m in msg["content"] for m in BYTE_LEVEL)
    prompts = " ".join(m["content"] for row in rows for m in row["messages"] if m["role"] == "user")
    assert prompts.count(" ") > len(prompts) / 10  # English with its spaces
    assert sum(" " in t["completion_text"] for row in rows for t in row["turns"]) >= len(rows)


def test_the_loss_mask_covers_exactly_the_verifier_s_answers(smol_build, oracle):
    """The masked tokens of a conversation are the answers' generated tokens and the end-of-turn token the template
    closes them with; nothing of the system prompt, the user turns or the scaffolding."""
    _, rows, _ = smol_build
    tok = oracle[0]
    for row in rows:
        assert row["rendering"] == "conversation"
        ids, mask = row["input_ids"], row["loss_mask"]
        spans, start = [], None
        for i, m in enumerate([*mask, 0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append(ids[start:i])
                start = None
        answers = [t for t in row["turns"]]
        assert len(spans) == len(answers)
        for span, turn in zip(spans, answers):
            text = tok.decode(span)
            assert text.rstrip("\n").removesuffix("<|im_end|>") == turn["completion_text"].removesuffix("<|im_end|>")
            assert "<|im_start|>" not in text


def test_the_benchmark_asks_mt_bench_s_second_question_after_the_verifier_s_own_answer(smol_build, oracle, tmp_path):
    """The benchmark's later turns: MT-bench's second question in the set ``eval turn 2``, rendered by the GGUF's
    template after the verifier's greedy answer in vLLM, which equals transformers' from the GGUF; a GSM8K question
    (one turn) has no later turn."""
    import torch

    from draftpipe.bench.prompts import GreedyAnswerer, benchmark_prompt_sets
    from draftpipe.formats.chat import template_kwargs
    from draftpipe.formats.prompts import load_prompts

    work, _, _ = smol_build
    tok, model = oracle
    mt, _ = load_prompts([{"path": str(REPO / "draftpipe/data/prompts/mt_bench_question.jsonl"), "max_records": 2}])
    gsm, _ = load_prompts([{"path": str(REPO / "draftpipe/data/prompts/gsm8k_test.jsonl"), "field": "question"}])
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*mt, gsm[0]]))
    verifier = str(work / "results" / "verifier")
    answerer = GreedyAnswerer(verifier, dtype="float32", max_model_len=2048)
    rendering = {"chat_template_sha256": None, "system_prompt": None, "template_kwargs": template_kwargs("off")}
    sets = benchmark_prompt_sets(
        tok, str(tmp_path / "eval.jsonl"), [], rendering, max_model_len=2048, max_tokens=16, max_prompts=8,
        too_long="error", answer=answerer, answer_tokens=12,
    )  # fmt: skip
    answerer.close()
    assert [p["id"] for p in sets["eval"]] == [r["id"] for r in [*mt, gsm[0]]]
    assert [p["id"] for p in sets["eval turn 2"]] == [r["id"] for r in mt] and len(sets) == 2
    for rec, first, second in zip(mt, sets["eval"], sets["eval turn 2"]):
        q1, _, q2 = rec["messages"]
        ids = first["prompt_token_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :]
        reply = {"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)}
        want = tok.apply_chat_template([q1, reply, q2], add_generation_prompt=True, tokenize=False)
        assert second["prompt_token_ids"] == tok(want, add_special_tokens=False)["input_ids"], rec["id"]

"""The draft job's hidden-state gate: degenerate states and states that are not the verifier's are not trained on.

Shards here hold the oracle's states (the verifier run in transformers, ``tests/helpers/oracle.py``) for answers the
verifier itself generated, greedily or sampled, as the completions stage does; made wrong on purpose, they fail."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.oracle import build_sample, load_verifier_model

from draftpipe.core.gates import QualityGateError
from draftpipe.formats.hidden_states import quantize_sample, write_shard
from draftpipe.formats.state_values import degenerate_layers, teacher_agreement
from draftpipe.stages.draft.state_gate import StateGate, check_hidden_states, final_head

AUX = [1, 2, 4]
META = {"aux_layer_ids": AUX, "hidden_size": 64, "num_layers": 5, "dtype": "bfloat16"}
PROMPTS = [[1, 403, 407, 261], [1, 378, 267], [1, 300, 414, 289, 380]]


@pytest.fixture(scope="module")
def model(verifier_dir):
    return load_verifier_model(str(verifier_dir), "float32")


def answered(model, temperature: float, top_p: float = 1.0, tokens: int = 40) -> list[dict]:
    """Completion rows of :data:`PROMPTS` that the verifier generated (greedy at temperature 0, else sampled)."""
    torch.manual_seed(0)
    rows = []
    for prompt in PROMPTS:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature else {}
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, **sampling, pad_token_id=0
            )
        rows.append({"prompt_token_ids": prompt, "completion_token_ids": out[0, len(prompt) :].tolist()})
    return rows


def shard_of(model, rows, path, change=None) -> str:
    samples = [build_sample(model, row, AUX, 5, max_len=64, dtype=torch.bfloat16) for row in rows]
    for s in samples:
        if change:
            change(s)
    write_shard(str(path), samples, META)
    return str(path)


def shifted(sample):  # the states of the position before: a sequence's states misplaced by one
    sample["verifier_last_hidden_states"] = torch.roll(sample["verifier_last_hidden_states"], 1, 0)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.95)], ids=["greedy", "sampled"])
def test_the_verifier_s_own_answers_agree_with_its_states_and_misplaced_states_do_not(
    model, verifier_dir, tmp_path, temperature, top_p
):
    rows = answered(model, temperature, top_p)
    norm, head, eps = final_head(str(verifier_dir))
    assert head.shape == (512, 64) and norm.shape == (64,) and eps == 1e-5
    good = shard_of(model, rows, tmp_path / "good.safetensors")
    agree, checked = teacher_agreement(good, norm, head, eps, tokens=512, temperature=temperature, top_p=top_p)
    assert checked == 3 * 39 and agree == checked  # each answer's last token is left out
    wrong = shard_of(model, rows, tmp_path / "wrong.safetensors", shifted)
    agree, checked = teacher_agreement(wrong, norm, head, eps, tokens=512, temperature=temperature, top_p=top_p)
    assert checked == 117 and agree / checked < 0.5
    # a float8 shard is read through its scales, its coarser rounding allowed for
    samples = [build_sample(model, row, AUX, 5, max_len=64, dtype=torch.float32) for row in rows]
    fp8 = tmp_path / "fp8.safetensors"
    write_shard(str(fp8), [quantize_sample(s, "float8_e4m3fn") for s in samples], {**META, "dtype": "float8_e4m3fn"})
    assert teacher_agreement(str(fp8), norm, head, eps, tokens=512, temperature=temperature, top_p=top_p) == (117, 117)
    # fewer tokens: spread over the samples, each with at least one
    assert teacher_agreement(good, norm, head, eps, tokens=12, temperature=temperature, top_p=top_p) == (12, 12)


def test_the_gate_names_each_shard_and_layer_and_remembers_what_passed(
    model, verifier_dir, tmp_path, capsys, monkeypatch
):
    rows = answered(model, 0.0)
    gate = StateGate(min_agreement=0.99, tokens=60, temperature=0.0, top_p=1.0)
    cache = tmp_path / "states.json"
    good = shard_of(model, rows, tmp_path / "good.safetensors")
    assert check_hidden_states([good], str(verifier_dir), gate, cache)[good] == {
        "degenerate": [],
        "agreement": [60, 60],
    }
    assert "the verifier's sampler allows the stored answer tokens at 1.0000 at the lowest" in capsys.readouterr().out

    def zero_layer(sample):  # what vLLM returned for some verifiers (vllm #46301)
        sample["hidden_states"].view(-1, 3, 64)[:, 1] = 0

    zero = shard_of(model, rows, tmp_path / "zero.safetensors", zero_layer)
    wrong = shard_of(model, rows, tmp_path / "wrong.safetensors", shifted)
    with pytest.raises(QualityGateError) as info:
        check_hidden_states([good, zero, wrong], str(verifier_dir), gate, cache)
    lines = str(info.value).splitlines()
    assert lines[0] == "hidden states not fit to train on (a draft trained on them accepts nothing):"
    assert lines[1] == f"{zero}: aux layer 2: all zero in every sample"
    assert lines[2].startswith(f"{wrong}: the verifier's own sampler allows ")
    assert lines[2].endswith(", below hidden_states.min_teacher_agreement=0.99")
    # every result is remembered with the file's identity; the shards stay where they are
    remembered = json.loads(cache.read_text())
    assert sorted(remembered) == sorted([good, zero, wrong])
    assert remembered[zero]["result"]["degenerate"] == ["aux layer 2: all zero in every sample"]
    # a threshold of 0 passes the misplaced states without reading any shard again (the results are remembered)
    from draftpipe.stages.draft import state_gate

    monkeypatch.setattr(state_gate, "degenerate_layers", lambda path: pytest.fail(f"{path} read again"))
    lenient = StateGate(min_agreement=0.0, tokens=60, temperature=0.0, top_p=1.0)
    with pytest.raises(QualityGateError, match="aux layer 2"):
        check_hidden_states([good, zero, wrong], str(verifier_dir), lenient, cache)
    check_hidden_states([good, wrong], str(verifier_dir), lenient, cache)


def test_degenerate_layers_are_found_in_float8_shards_too(model, tmp_path):
    rows = answered(model, 0.0, tokens=8)
    samples = [build_sample(model, row, AUX, 5, max_len=64, dtype=torch.float32) for row in rows]
    assert degenerate_layers(shard_of(model, rows, tmp_path / "good.safetensors")) == []
    for s in samples:
        s["verifier_last_hidden_states"][:] = torch.linspace(-1, 1, 64)  # the same state at every token
    path = tmp_path / "fp8.safetensors"
    write_shard(str(path), [quantize_sample(s, "float8_e4m3fn") for s in samples], {**META, "dtype": "float8_e4m3fn"})
    n = sum(len(r["prompt_token_ids"]) + 8 for r in rows)
    assert degenerate_layers(str(path)) == [f"last layer 5: the same state at all {n} tokens"]


def test_the_teacher_check_is_off_where_it_cannot_tell(tmp_path):
    assert StateGate(0.99, 512, 0.7, 1.0).teacher_off() == (
        "the answers were sampled at temperature 0.7 with top_p 1, where every token is in the verifier's support"
    )
    assert StateGate(None, 512, 0.0, 1.0).teacher_off() == "hidden_states.min_teacher_agreement is null"
    assert StateGate(0.99, 512, 0.0, 1.0).teacher_off() is None
    assert StateGate(0.99, 512, 0.7, 0.95).teacher_off() is None


def test_each_answer_s_closing_token_is_left_out_and_the_rest_spread_evenly():
    """A chat template closes each answer with its end-of-turn token, in the mask but not generated where max_tokens
    cut the answer (SmolLM2: 19 of the 35 disagreements of one shard before this rule, each a logit gap of 10 to 35)."""
    from draftpipe.formats.state_values import answer_positions

    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.uint8)
    # positions whose next token is an answer token other than an answer's last: 1 -> 2, 2 -> 3, 6 -> 7
    assert answer_positions(mask, 100).tolist() == [1, 2, 6]
    assert answer_positions(mask, 2).tolist() == [1, 6]
    assert answer_positions(torch.ones(5, dtype=torch.uint8), 100).tolist() == [0, 1, 2]

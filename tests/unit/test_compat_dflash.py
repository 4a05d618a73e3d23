"""The compatibility checker on DFlash drafts: a real speculators DFlash checkpoint for the tiny verifier passes, and
each rule read from vLLM 0.32's DFlash loader fails a checkpoint that breaks it (draftpipe.checks.compat.dflash)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from draftpipe.checks.compat.checker import check
from draftpipe.inference.engine import proposed_tokens, speculative_config
from draftpipe.stages.draft.export import finalize_config
from draftpipe.stages.draft.settings import DFlashSettings, DraftSettings

AUX = [1, 2, 4]
EXPECT = {"aux_layer_ids": AUX, "draft_vocab_size": 256, "head_dim": None}


@pytest.fixture(scope="module")
def dflash_draft(verifier_dir, tmp_path_factory) -> Path:
    """An untrained DFlash draft (block 4, a draft vocabulary of 256 of the verifier's 512 tokens) as the draft job
    exports it: speculators' checkpoint with the config :func:`finalize_config` writes."""
    import torch

    from draftpipe.stages.draft.training import build_draft

    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[:256] = True
    d2t = torch.zeros(256, dtype=torch.long)
    s = DraftSettings(method="dflash", dflash=DFlashSettings(block_size=4))
    model = build_draft(str(verifier_dir), AUX, d2t, t2d, 256, s, "sdpa")
    out = tmp_path_factory.mktemp("dflash") / "draft"
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(finalize_config(config, AUX, "karpathy/tinyllamas")))
    return out


def _copy(draft: Path, tmp_path: Path, change=None, tensors=None) -> Path:
    """A copy of ``draft`` with ``change(config)`` applied and ``tensors(dict)`` applied to its weights."""
    out = tmp_path / "draft"
    shutil.copytree(draft, out)
    if change is not None:
        config = json.loads((out / "config.json").read_text())
        change(config)
        (out / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        weights = load_file(out / "model.safetensors")
        tensors(weights)
        save_file(weights, out / "model.safetensors")
    return out


def _ids(report) -> dict[str, str]:
    return {f.id: f.severity for f in report.findings if f.severity != "info"}


def test_a_dflash_draft_as_exported_passes_and_is_served_as_one(dflash_draft, verifier_dir):
    config = json.loads((dflash_draft / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["sliding_window_non_causal"] is True
    assert config["aux_hidden_state_layer_ids"] == AUX and "eagle_aux_hidden_state_layer_ids" not in config
    assert config["speculators_config"]["verifier"]["name_or_path"] == "karpathy/tinyllamas"
    report = check(dflash_draft, verifier_dir, expect=EXPECT)
    assert report.ok and _ids(report) == {}, report.findings
    assert report.format == "speculators (dflash)"
    assert speculative_config(str(dflash_draft), 3) == {
        "method": "dflash",
        "model": str(dflash_draft),
        "num_speculative_tokens": 3,
    }
    assert proposed_tokens(str(dflash_draft)) == 3  # the live check drafts a block's tokens


def _drop(key):
    return lambda c: c.pop(key)


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _layer(key, value):
    return lambda c: c["transformer_layer_config"].__setitem__(key, value)


def _proposed(n):
    return lambda c: c["speculators_config"]["proposal_methods"][0].__setitem__("speculative_tokens", n)


BROKEN = [  # (rule, severity, config change, tensor change, what the build expects)
    ("dflash.mask_token_id", "error", _drop("mask_token_id"), None, {}),
    ("dflash.mask_token_range", "error", _set("mask_token_id", 512), None, {}),
    ("dflash.aux_missing", "error", _drop("aux_hidden_state_layer_ids"), None, {}),
    ("aux.range", "error", _set("aux_hidden_state_layer_ids", [1, 2, 9]), None, {}),
    ("aux.duplicate", "error", _set("aux_hidden_state_layer_ids", [1, 2, 2]), None, {}),
    ("expect.aux_layer_ids", "error", _set("aux_hidden_state_layer_ids", [0, 2, 4]), None, {"aux_layer_ids": AUX}),
    ("dflash.fc_width", "error", _set("aux_hidden_state_layer_ids", [2, 4]), None, {}),
    ("dflash.causal", "error", _set("sliding_window_non_causal", False), None, {}),
    ("dflash.mixed_layers", "error", _layer("layer_types", ["full_attention", "sliding_attention"]), None, {}),
    ("dflash.block_size", "error", _set("block_size", 1), None, {}),
    ("dflash.sample_from_anchor", "warning", _set("sample_from_anchor", True), None, {}),
    ("dflash.speculative_tokens", "warning", _proposed(7), None, {}),
    ("format.model_type_top_level", "error", _set("model_type", "qwen3"), None, {}),
    ("expect.draft_vocab_size", "error", None, None, {"draft_vocab_size": 128}),
    ("expect.head_dim", "error", None, None, {"head_dim": 64}),
    (
        "names.verifier_tensor",
        "error",
        None,
        lambda w: w.__setitem__("verifier_norm.weight", w["norm.weight"].clone()),
        {},
    ),
    ("vocab.d2t", "error", None, lambda w: w.pop("d2t"), {}),
]


@pytest.mark.parametrize("rule,severity,change,tensors,expect", BROKEN, ids=[b[0] for b in BROKEN])
def test_each_dflash_rule_fails_a_checkpoint_that_breaks_it(
    dflash_draft, verifier_dir, tmp_path, rule, severity, change, tensors, expect
):
    report = check(_copy(dflash_draft, tmp_path, change, tensors), verifier_dir, expect=expect)
    found = _ids(report)
    assert found.get(rule) == severity, report.findings
    assert report.ok == (severity != "error")
    fix = next(f.fix for f in report.findings if f.id == rule)
    assert fix  # every finding names its fix


def test_a_speculators_type_vllm_is_not_asked_to_serve_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "mtp"}))
    with pytest.raises(ValueError, match=r"config.json: speculators_model_type 'mtp' is not one of eagle3, dflash"):
        speculative_config(str(tmp_path), 3)
    assert speculative_config(str(tmp_path / "missing"), 1)["method"] == "eagle3"
    assert proposed_tokens(str(tmp_path)) is None

"""What the workflow computes once when it is read (draftpipe/workflow/parse.py), without Snakemake."""

from __future__ import annotations

import importlib.util
import io
import json
import os

import pytest
import yaml
from conftest import GGUF, REPO

from draftpipe.formats.verifier import VerifierNotFoundError
from draftpipe.workflow.config import ConfigError, validate_config
from draftpipe.workflow.parse import (
    CONVERTED_VERIFIER,
    configured_verifier,
    live_check,
    quarantine_corrupt_shards,
    rendering,
    verifier_dir,
)


def default_config() -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text(encoding="utf-8"))
    validate_config(config)
    return config


def test_the_verifier_the_rules_read(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    config = default_config()
    gguf = configured_verifier(config)
    assert gguf["kind"] == "gguf" and os.path.samefile(gguf["path"], GGUF)
    assert verifier_dir(gguf) == CONVERTED_VERIFIER == "results/verifier"
    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    config["verifier"]["path"] = str(local)
    assert verifier_dir(configured_verifier(config)) == str(local)
    # a hub id planned against a checked-in config.json, and one whose config.json is missing
    config["verifier"].update(path="org/not-here", config_json=str(local / "config.json"))
    hub = configured_verifier(config)
    assert hub == {"kind": "hub", "id": "org/not-here", "config_path": str(local / "config.json")}
    assert verifier_dir(hub) == "org/not-here"
    config["verifier"]["config_json"] = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"^verifier.config_json: .*missing.json does not exist$"):
        configured_verifier(config)
    config["verifier"].update(path=str(tmp_path / "nothing"), config_json=None)
    with pytest.raises(VerifierNotFoundError):
        configured_verifier(config)


def test_rendering_and_the_live_check():
    config = default_config()
    assert rendering(config, "ab" * 32) == {
        "chat_template_sha256": "ab" * 32,
        "system_prompt": config["prompts"]["system_prompt"],
        "template_kwargs": {},
    }
    config["completions"]["reasoning"] = "off"
    assert rendering(config, None)["template_kwargs"] == {"enable_thinking": False}
    assert live_check(config) == (importlib.util.find_spec("vllm") is not None)  # auto
    config["report"]["live_check"] = False
    assert live_check(config) is False


def test_a_corrupt_shard_is_moved_aside_before_planning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shard = tmp_path / "results" / "hidden_states" / "train_00000.safetensors"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # a header length past the end of the file
    out = io.StringIO()
    moved = quarantine_corrupt_shards(
        [str(shard), str(tmp_path / "results/hidden_states/train_00001.safetensors")], out=out
    )
    assert [src.name for src, _ in moved] == ["train_00000.safetensors"] and not shard.exists()
    assert moved[0][1].is_file() and "results/.quarantine/" in str(moved[0][1])
    rel = "results/hidden_states/train_00000.safetensors"
    assert out.getvalue().startswith(f"draftpipe: {rel} is corrupt (truncated: ")
    assert out.getvalue().endswith(f"it is rebuilt when a job reads it (now: snakemake {rel})\n")

"""One source of defaults: the typed settings and the config schema say the same."""

from __future__ import annotations

import dataclasses

import yaml

from draftpipe.stages.draft.settings import DraftSettings
from draftpipe.workflow.config import SCHEMA, fill_defaults, validate_config


def schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))


def test_draft_settings_defaults_are_the_schemas():
    props = schema()["properties"]["draft"]["properties"]
    fields = {f.name: f for f in dataclasses.fields(DraftSettings) if f.name != "extra"}
    assert sorted(props) == sorted(fields)
    differ = {
        name: (props[name].get("default"), f.default)
        for name, f in fields.items()
        if props[name].get("default") != f.default
    }
    assert differ == {}


def test_a_config_that_names_nothing_gets_every_default():
    config = {
        "verifier": {"path": "v.gguf"},
        "prompts": {"sources": [{"path": "p.jsonl"}]},
        "completions": {},
        "hidden_states": {},
        "vocab": {},
        "draft": {},
    }
    validate_config(config)
    assert DraftSettings(**config["draft"]) == DraftSettings()
    assert config["report"]["live_check"] == "auto"  # a section defaulted to {} gets its keys' defaults
    assert config["prompts"]["sources"][0] == {**config["prompts"]["sources"][0], "path": "p.jsonl"}


def test_fill_defaults_keeps_what_is_set_and_copies_defaults():
    spec = {
        "properties": {
            "a": {"type": "object", "default": {}, "properties": {"x": {"default": [1]}}},
            "b": {"type": "array", "items": {"properties": {"y": {"default": 2}}}},
        }
    }
    first, second = {"b": [{}, {"y": 5}]}, {}
    fill_defaults(first, spec)
    fill_defaults(second, spec)
    assert first == {"a": {"x": [1]}, "b": [{"y": 2}, {"y": 5}]}
    first["a"]["x"].append(9)
    assert second["a"]["x"] == [1]


def test_the_loss_names_checked_when_the_workflow_is_read_are_speculators():
    from speculators.losses import utils

    from draftpipe.workflow.config import LOSS_FUNCTIONS, check_loss_fn

    assert set(LOSS_FUNCTIONS) == set(utils._FUSED_LOSS_FN_MAP) == set(utils._EAGER_LOSS_FN_MAP)
    for spec in [*LOSS_FUNCTIONS, '{"ce": 0.1, "tv": 0.9}']:
        check_loss_fn(spec)  # accepted here
        assert utils.resolve_loss_config(spec)  # and by speculators

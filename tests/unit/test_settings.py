"""One source of defaults: the typed settings and the config schema say the same."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from draftpipe.stages.draft.settings import DraftSettings
from draftpipe.workflow.config import SCHEMA, fill_defaults, validate_config


def schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))


def _differ(props: dict, cls) -> dict:
    """``{field: (schema default, dataclass default)}`` where they differ; a section of its own (``draft.dflash``,
    schema default ``{}``) compared key by key with its settings class."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
    assert sorted(props) == sorted(fields)
    differ = {}
    for name, f in fields.items():
        if "properties" in props[name]:
            assert props[name].get("default") == {}, name
            nested = _differ(props[name]["properties"], type(f.default_factory()))
            differ.update({f"{name}.{key}": pair for key, pair in nested.items()})
        elif props[name].get("default") != (list(f.default) if isinstance(f.default, tuple) else f.default):
            differ[name] = (props[name].get("default"), f.default)
    return differ


def test_draft_settings_defaults_are_the_schemas():
    assert _differ(schema()["properties"]["draft"]["properties"], DraftSettings) == {}


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


def test_untracked_job_settings_are_typed_and_left_out_of_the_params_trigger():
    """The knobs that shape nothing reach every job as one typed record, built from the validated config, that
    Snakemake's params trigger leaves out (it records builtin values only) and the stage stores' keys too."""
    import types

    from snakemake.persistence import UNREPRESENTABLE, PersistenceBase

    from draftpipe.runtime.store import stage_settings
    from draftpipe.workflow.settings import (
        BenchReportJob,
        CompletionsJob,
        DraftJob,
        HiddenStatesJob,
        PromptShardJob,
        job_settings,
        read_job_settings,
    )

    config = yaml.safe_load((SCHEMA.parents[2] / "config.yaml").read_text(encoding="utf-8"))
    validate_config(config)
    config["resources"]["draft"].update(gpus=4, ranks=None, nodes=2, loss_implementation="eager", loader_workers=6)
    draft = read_job_settings(DraftJob, job_settings("draft", config))
    assert draft == DraftJob(
        min_train_samples=config["draft"]["min_train_samples"],
        ranks=4,  # one per GPU when ranks is not set (draftpipe.core.gpus.draft_ranks)
        nodes=2,
        fsdp=config["resources"]["draft"]["fsdp"],
        checkpoints_per_epoch=config["resources"]["draft"]["checkpoints_per_epoch"],
        disk_budget=16 * 2**30,  # hidden_states.disk_budget: 16GiB
        stream_gpus=config["resources"]["hidden_states"]["gpus"],
        max_empty_mask_fraction=config["hidden_states"]["max_empty_mask_fraction"],
        stream_gpu_memory=0.9,  # the trainer on GPUs of its own
        loss_implementation="eager",
        loader_workers=6,
        # the hidden-state gate: its thresholds, and the sampler that generated the answers it checks
        state_gate={"min_agreement": 0.99, "tokens": 512, "temperature": 0.8, "top_p": 0.95},
        loggers=(),  # draft.loggers: none in config.yaml
    )
    assert config["completions"]["temperature"] == 0.8 and config["completions"]["top_p"] == 0.95
    completions = read_job_settings(CompletionsJob, job_settings("completions", config))
    assert completions.max_truncated_fraction == config["completions"]["max_truncated_fraction"]
    assert (
        read_job_settings(HiddenStatesJob, job_settings("hidden_states", config)).batch_tokens
        == (config["resources"]["hidden_states"]["batch_tokens"])
    )
    assert (
        read_job_settings(PromptShardJob, job_settings("prompt_shard", config)).sources == config["prompts"]["sources"]
    )
    gate = job_settings("bench_report", config)
    assert read_job_settings(BenchReportJob, gate).min_acceptance_length == config["bench"]["min_acceptance_length"]
    # what Snakemake records for its params trigger: builtin values only, the namespace left out
    assert isinstance(gate, types.SimpleNamespace)
    serialize = PersistenceBase._serialize_param_builtin
    assert serialize(None, {"a": 1}) == "{'a': 1}" and serialize(None, gate) is UNREPRESENTABLE
    # and the stage store's key leaves it out
    job = types.SimpleNamespace(params={"num_shards": 2, "verifier": "v", "untracked": gate})
    assert stage_settings(job) == {"verifier": "v"}
    with pytest.raises(TypeError):
        read_job_settings(DraftJob, gate)  # another rule's settings are refused


def test_no_job_script_reads_the_config():
    scripts = sorted((SCHEMA.parents[2] / "scripts").glob("*.py"))
    assert scripts and [p.name for p in scripts if "snakemake.config" in p.read_text()] == []

"""Draft stage helpers: per-epoch metrics, where the aux ids are written, acceptance arithmetic."""

from __future__ import annotations

import pytest

from draftpipe.draft import epoch_metrics, finalize_config, settings_from_params
from draftpipe.spec_decode import acceptance_from_counters


def test_epoch_metrics_average_steps_and_keep_validation():
    records = [
        {"train": {"loss": 4.0, "full_acc_0": 0.1}, "epoch": 0},
        {"train": {"loss": 2.0, "full_acc_0": 0.3}, "epoch": 0},
        {"val": {"loss_epoch": 2.5, "full_acc_0_epoch": 0.25}, "epoch": 0},
        {"train": {"loss": 1.0, "full_acc_0": 0.5}, "epoch": 1},
    ]
    rows = epoch_metrics(records)
    assert rows[0] == {"epoch": 0, "train_loss": 3.0, "train_full_acc_0": pytest.approx(0.2),
                       "val_loss": 2.5, "val_full_acc_0": 0.25, "train_steps": 2}
    assert rows[1]["train_loss"] == 1.0 and rows[1]["train_steps"] == 1


def test_aux_ids_are_written_where_each_vllm_runner_reads_them():
    cfg = {"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "llama"},
           "speculators_config": {"verifier": {"name_or_path": "old"}}}
    out = finalize_config(cfg, [1, 2, 4], "verifier-dir")
    assert out["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert out["transformer_layer_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert out["speculators_config"]["verifier"]["name_or_path"] == "verifier-dir"
    assert "eagle_config" not in cfg["transformer_layer_config"]  # the input is not modified


def test_settings_from_params_splits_unknown_keys():
    s = settings_from_params({"epochs": 2, "lr": 0.01, "head_dim": 128, "future_knob": 1})
    assert (s.epochs, s.lr, s.head_dim, s.extra) == (2, 0.01, 128, {"future_knob": 1})


def test_acceptance_arithmetic_on_known_counters():
    a = acceptance_from_counters(num_drafts=100, num_draft_tokens=300, accepted=150,
                                 accepted_per_pos=[80, 50, 20])
    assert a["acceptance_length"] == 2.5
    assert a["acceptance_rate"] == 0.5
    assert a["per_position_acceptance"] == [0.8, 0.5, 0.2]
    none = acceptance_from_counters(0, 0, 0, [])
    assert none["acceptance_length"] == 1.0 and none["acceptance_rate"] == 0.0


def test_counters_read_from_vllm_metric_objects():
    from types import SimpleNamespace as M

    from draftpipe.spec_decode import read_spec_counters

    metrics = [M(name="vllm:spec_decode_num_drafts", value=100.0),
               M(name="vllm:spec_decode_num_draft_tokens", value=300.0),
               M(name="vllm:spec_decode_num_accepted_tokens", value=150.0),
               M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[80, 50, 20]),
               M(name="vllm:num_requests_running", value=3.0)]
    a = read_spec_counters(metrics)
    assert a["acceptance_length"] == 2.5 and a["per_position_acceptance"] == [0.8, 0.5, 0.2]

"""Draft stage without training: per-epoch metrics, where the aux ids are written, acceptance arithmetic, checkpoint
names, step batches independent of the world size, and the accounting of samples longer than the packed batch."""

from __future__ import annotations

import pytest

from draftpipe.checks.spec_decode import acceptance_from_counters
from draftpipe.stages.draft.checkpoint import (
    BEST,
    NO_VALIDATION,
    TRAINING_STATE,
    best_epoch,
    clean_work_dir,
    keep_best,
    kept_best,
    latest_checkpoint,
    selected_checkpoint,
)
from draftpipe.stages.draft.export import finalize_config
from draftpipe.stages.draft.metrics import epoch_metrics, exported_row, mark_exported, selection_line
from draftpipe.stages.draft.settings import settings_from_params


def test_epoch_metrics_average_steps_and_keep_validation():
    records = [
        {"train": {"loss": 4.0, "full_acc_0": 0.1}, "epoch": 0},
        {"train": {"loss": 2.0, "full_acc_0": 0.3}, "epoch": 0},
        {"val": {"loss_epoch": 2.5, "full_acc_0_epoch": 0.25}, "epoch": 0},
        {"train": {"loss": 1.0, "full_acc_0": 0.5}, "epoch": 1},
    ]
    rows = epoch_metrics(records)
    assert rows[0] == {
        "epoch": 0,
        "train_loss": 3.0,
        "train_full_acc_0": pytest.approx(0.2),
        "val_loss": 2.5,
        "val_full_acc_0": 0.25,
        "train_steps": 2,
    }
    assert rows[1]["train_loss"] == 1.0 and rows[1]["train_steps"] == 1


def test_epoch_metrics_carry_the_loss_implementation_of_each_epoch():
    records = [
        {"train": {"loss": 4.0}, "epoch": 0, "loss_impl": "fused"},
        {"train": {"loss": 2.0}, "epoch": 1, "loss_impl": "eager-fallback"},
        {"val": {"loss_epoch": 2.5}, "epoch": 1},
    ]
    assert [r.get("loss_impl") for r in epoch_metrics(records)] == ["fused", "eager-fallback"]


def test_aux_ids_are_written_where_each_vllm_runner_reads_them():
    cfg = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"model_type": "llama"},
        "speculators_config": {"verifier": {"name_or_path": "old"}},
    }
    out = finalize_config(cfg, [1, 2, 4], "verifier-dir")
    assert out["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert out["transformer_layer_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert out["speculators_config"]["verifier"]["name_or_path"] == "verifier-dir"
    assert "eagle_config" not in cfg["transformer_layer_config"]  # the input is not modified


def test_settings_from_params_splits_unknown_keys():
    s = settings_from_params({"epochs": 2, "lr": 0.01, "head_dim": 128, "future_knob": 1})
    assert (s.epochs, s.lr, s.head_dim, s.extra) == (2, 0.01, 128, {"future_knob": 1})


def test_acceptance_arithmetic_on_known_counters():
    a = acceptance_from_counters(num_drafts=100, num_draft_tokens=300, accepted=150, accepted_per_pos=[80, 50, 20])
    assert a["acceptance_length"] == 2.5
    assert a["acceptance_rate"] == 0.5
    assert a["per_position_acceptance"] == [0.8, 0.5, 0.2]
    none = acceptance_from_counters(0, 0, 0, [])
    assert none["acceptance_length"] == 1.0 and none["acceptance_rate"] == 0.0


def test_counters_read_from_vllm_metric_objects():
    from types import SimpleNamespace as M

    from draftpipe.checks.spec_decode import read_spec_counters

    metrics = [
        M(name="vllm:spec_decode_num_drafts", value=100.0),
        M(name="vllm:spec_decode_num_draft_tokens", value=300.0),
        M(name="vllm:spec_decode_num_accepted_tokens", value=150.0),
        M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[80, 50, 20]),
        M(name="vllm:num_requests_running", value=3.0),
    ]
    a = read_spec_counters(metrics)
    assert a["acceptance_length"] == 2.5 and a["per_position_acceptance"] == [0.8, 0.5, 0.2]


def test_latest_checkpoint_ignores_and_cleans_incomplete_saves(tmp_path):
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / TRAINING_STATE).write_bytes(b"state")
    (tmp_path / "1").mkdir()  # complete checkpoint, superseded by 3
    (tmp_path / "1" / TRAINING_STATE).write_bytes(b"state")
    (tmp_path / "3-step5").mkdir()  # mid-epoch checkpoint of epoch 3: after 1, before the end of epoch 3
    (tmp_path / "3-step5" / TRAINING_STATE).write_bytes(b"state")
    assert latest_checkpoint(tmp_path) == (3, tmp_path / "3-step5")
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / TRAINING_STATE).write_bytes(b"state")
    (tmp_path / "4").mkdir()  # weights written, state missing: not a checkpoint
    (tmp_path / "4" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".5.tmp-abc").mkdir()  # a save killed before its rename
    (tmp_path / ".5.tmp-abc" / TRAINING_STATE).write_bytes(b"partial")
    (tmp_path / "epoch4_end").symlink_to("4")
    (tmp_path / "notes.txt").write_text("kept")
    assert latest_checkpoint(tmp_path) == (3, tmp_path / "3")
    removed = clean_work_dir(tmp_path)
    assert sorted(p.name for p in removed) == [".5.tmp-abc", "0", "1", "3-step5", "4", "epoch4_end"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "notes.txt"]
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path / "4") is None


def test_the_best_epoch_is_the_first_with_the_lowest_validation_loss():
    # speculators' rule (Trainer.maybe_update_best): only a strictly lower loss replaces the best; NaN never counts
    rows = [{"epoch": 0, "val_loss": 3.0}, {"epoch": 1, "val_loss": 2.5}, {"epoch": 2, "val_loss": 2.5},
            {"epoch": 3, "val_loss": float("nan")}, {"epoch": 4, "val_loss": 2.75}]  # fmt: skip
    assert best_epoch(rows) == (1, 2.5)
    assert best_epoch(list(reversed(rows))) == (1, 2.5)  # by epoch, not by row order
    assert best_epoch([{"epoch": 0, "train_loss": 1.0}]) is None  # no validation samples


def test_the_selected_checkpoint_and_why(tmp_path):
    rows = [{"epoch": 0, "val_loss": 3.0}, {"epoch": 1, "val_loss": 2.0}, {"epoch": 2, "val_loss": 2.25}]
    assert selected_checkpoint(tmp_path, 3, rows, "last") == (tmp_path / "2", 2, "last")
    # best_val: epoch 1, kept in best/ while epoch 2 trained; without it the draft is not exported
    with pytest.raises(RuntimeError, match=r"epoch 1 has the lowest validation loss, but .*best does not hold it"):
        selected_checkpoint(tmp_path, 3, rows, "best_val")
    checkpoint = tmp_path / "1"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights of epoch 1")
    (checkpoint / "config.json").write_text("{}")
    assert kept_best(tmp_path) is None
    assert keep_best(checkpoint, tmp_path, 1, 2.0) == tmp_path / BEST
    assert kept_best(tmp_path) == 1
    assert (tmp_path / BEST / "model.safetensors").read_bytes() == b"weights of epoch 1"
    assert selected_checkpoint(tmp_path, 3, rows, "best_val") == (tmp_path / BEST, 1, "best_val")
    # the best kept is not a checkpoint: cleaning the work directory leaves it
    assert clean_work_dir(tmp_path) == [checkpoint] and kept_best(tmp_path) == 1
    # the last epoch is the best: its own checkpoint; no validation: the last
    rows[2]["val_loss"] = 1.5
    assert selected_checkpoint(tmp_path, 3, rows, "best_val") == (tmp_path / "2", 2, "best_val")
    no_val = [{"epoch": 0, "train_loss": 1.0}, {"epoch": 1, "train_loss": 0.5}]
    assert selected_checkpoint(tmp_path, 2, no_val, "best_val") == (tmp_path / "1", 1, NO_VALIDATION)
    with pytest.raises(ValueError, match="draft.select: 'first' is not one of last, best_val"):
        selected_checkpoint(tmp_path, 3, rows, "first")


def test_the_exported_epoch_is_marked_and_said():
    rows = [{"epoch": 0, "val_loss": 3.0}, {"epoch": 1, "val_loss": 2.0}, {"epoch": 2, "val_loss": 2.25}]
    marked = mark_exported(rows, 1, "best_val")
    assert [r["exported"] for r in marked] == ["", "best_val", ""]
    assert exported_row(marked) == (marked[1], "best_val")
    assert selection_line(marked) == (
        "exported epoch 2 of 3: the lowest validation loss (draft.select: best_val); the last epoch's is 2.2500"
    )
    last = mark_exported(rows, 2, "last")
    assert selection_line(last) == (
        "exported epoch 3 of 3, the last (draft.select: last); epoch 2 had the lowest validation loss, 2.0000 "
        "(draft.select: best_val exports it)"
    )
    assert selection_line(rows) == selection_line(last)  # a metrics.csv from before the column: the last epoch
    assert selection_line(mark_exported(rows[:2], 1, "last")) == "exported epoch 2 of 2, the last (draft.select: last)"
    assert selection_line(mark_exported([{"epoch": 0}], 0, NO_VALIDATION)) == (
        "exported epoch 1 of 1, the last: draft.select: best_val found no validation samples"
    )


def test_step_batches_do_not_depend_on_the_world_size():
    import numpy as np
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from draftpipe.stages.draft.ranks import StepBatchSampler

    lengths = np.random.default_rng(1).integers(20, 200, size=97)
    for epoch in (0, 3):
        one = StepBatchSampler(lengths, 256, 4, 0, 1, seed=5)
        one.set_epoch(epoch)
        by_rank = []
        for rank in range(2):
            sampler = StepBatchSampler(lengths, 256, 4, rank, 2, seed=5)
            sampler.set_epoch(epoch)
            assert sampler.steps == one.steps and len(sampler) == 2 * one.steps
            by_rank.append([list(b) for b in sampler])
        flat = [list(b) for b in one]
        assert len(flat) == 4 * one.steps
        for step in range(one.steps):
            mine = flat[4 * step : 4 * step + 4]  # packed batches 0..3 of the step; rank r trains r and r + 2
            assert mine == [
                by_rank[0][2 * step],
                by_rank[1][2 * step],
                by_rank[0][2 * step + 1],
                by_rank[1][2 * step + 1],
            ]
            assert all(sum(lengths[i] for i in b) <= 256 for b in mine)
        # one packed batch per step, one rank: speculators' own sampler, batch for batch
        single = StepBatchSampler(lengths, 256, 1, 0, 1, seed=5)
        spec = MultipackDistributedBatchSamplerV2(256, lengths, num_replicas=1, rank=0, seed=5)
        single.set_epoch(epoch)
        spec.set_epoch(epoch)
        assert [list(b) for b in single] == [list(b) for b in spec]
        # a resumed epoch starts after the steps already trained
        one.skip = 2
        assert [list(b) for b in one] == flat[8:]
    with pytest.raises(ValueError, match="multiple of the number of training ranks"):
        StepBatchSampler(lengths, 256, 3, 0, 2, seed=5)


def test_samples_longer_than_the_packed_batch_are_counted_and_never_a_step_of_loss_zero():
    from draftpipe.stages.draft.data import accounting_line, window_accounting

    # lengths 300 (fits), 700 (cut: 100 of its 250 trained tokens lost), 900 (all 50 trained tokens past 512: left out)
    a = window_accounting([300, 700, 900], [120, 250, 50], [120, 150, 0], 512)
    assert a == {
        "samples": 3,
        "tokens": 1900,
        "trained_tokens": 420,
        "long_samples": 2,
        "cut_trained_tokens": 150,
        "dropped_samples": 1,
        "used_tokens": 812,
        "used_trained_tokens": 270,
        "kept_indices": [0, 1],
    }
    assert accounting_line("train", a, 512) == (
        "draft train data: 2 samples, 812 tokens, 270 trained on per epoch; WARNING: 2 sample(s) longer than "
        "draft.total_seq_len=512 are cut to their first 512 tokens (150 of 420 trained tokens lost), 1 of them left "
        "out with no token to learn there; raise draft.total_seq_len to keep them"
    )
    fits = window_accounting([10, 20], [5, 0], [5, 0], 512)
    assert fits["kept_indices"] == [0, 1] and fits["dropped_samples"] == 0  # a short sample is never left out
    assert (
        accounting_line("validation", fits, 512)
        == "draft validation data: 2 samples, 30 tokens, 5 trained on per epoch"
    )


def test_the_compile_caches_go_under_the_workflow_unless_the_user_chose(tmp_path):
    from draftpipe.stages.draft.compile_cache import use_compile_cache

    env = {"TRITON_CACHE_DIR": "/scratch/mine"}
    chosen = use_compile_cache(tmp_path / "cc", env)
    assert chosen == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cc" / "inductor"),
        "TRITON_CACHE_AUTOTUNING": "1",
    }
    assert env["TRITON_CACHE_DIR"] == "/scratch/mine"  # the user's own is kept
    assert use_compile_cache(tmp_path / "other", env) == {}  # a second call changes nothing


def test_loader_workers_read_the_same_batches_in_the_same_order_and_change_no_sample(tmp_path):
    import torch

    from draftpipe.formats.hidden_states import quantize_sample, write_shard
    from draftpipe.stages.draft.data import MAX_LOADER_WORKERS, ShardDataset, loader_workers, packed_loader
    from draftpipe.stages.draft.settings import DraftSettings

    assert [loader_workers(False, 64), loader_workers(True, 64, streamed=True, asked=3)] == [0, 0]
    # one worker alone is slower than none (a batch's trip through shared memory): two or more, or none
    assert [loader_workers(True, n) for n in (1, 2, 3, 4, 64)] == [0, 0, 2, 3, MAX_LOADER_WORKERS]
    assert loader_workers(False, 2, asked=2) == 2
    g = torch.Generator().manual_seed(4)
    paths = []
    for j, dtype in enumerate(("bfloat16", "float8_e4m3fn")):
        samples = []
        for t in torch.randint(5, 40, (9,), generator=g).tolist():
            mask = torch.zeros(t, dtype=torch.uint8)
            mask[t // 3 :] = 1
            sample = {
                "input_ids": torch.randint(0, 256, (t,), generator=g),
                "loss_mask": mask,
                "hidden_states": torch.randn(t, 3 * 16, generator=g),
                "verifier_last_hidden_states": torch.randn(t, 16, generator=g),
            }
            samples.append(quantize_sample(sample, dtype))
        paths.append(str(tmp_path / f"{j}.safetensors"))
        write_shard(paths[-1], samples, {"aux_layer_ids": [1, 2, 4], "hidden_size": 16})
    ds = ShardDataset(paths, 64, "train", 0, torch.float32)
    s = DraftSettings(total_seq_len=64, batches_per_step=2, seed=7)

    def epochs(workers):
        loader = packed_loader(ds, s, 16, 3, (0, 1), workers=workers)
        out = []
        for epoch in (0, 1):  # the same worker processes serve both epochs, each epoch in its own order
            loader.batch_sampler.set_epoch(epoch)
            out.append([{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in loader])
        return out

    stored = [dict(row) for row in ds.samples]  # the samples the dataset holds
    snapshot = [{k: v.clone() for k, v in row.items()} for row in stored]
    here, ahead = epochs(0), epochs(2)
    assert [len(e) for e in here] == [len(e) for e in ahead] and len(here[0]) >= 4
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(*here))  # the epochs differ
    for a, b in zip(here[0] + here[1], ahead[0] + ahead[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for batch in packed_loader(ds, s, 16, 3, (0, 1)):
        for key in ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states"):
            batch[key].add_(1)  # the trainer's batch is its own
    # the batches are the trainer's own: every epoch reads the shards' values
    for row, before in zip(stored, snapshot):
        assert all(torch.equal(row[k], before[k]) for k in before)
    assert here[0][0]["hidden_states"].shape == (1, 64, 3 * 16)


def _drafts(verifier_dir, **settings):
    import torch

    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import build_draft

    vocab, vd = 512, 256
    d2t = torch.zeros(vd, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:vd] = True
    return [
        build_draft(str(verifier_dir), [1, 2, 3], d2t, t2d, vd, DraftSettings(seed=0, init=init, **settings), "sdpa")
        for init in ("random", "verifier")
    ]


def test_init_verifier_starts_the_draft_from_the_verifiers_last_aux_layer(verifier_dir):
    import torch
    from safetensors.torch import load_file

    random, warm = _drafts(verifier_dir)
    weights = load_file(str(verifier_dir / "model.safetensors"))
    layer = {k.removeprefix("model.layers.3."): v for k, v in weights.items() if k.startswith("model.layers.3.")}
    hidden = warm.hidden_size
    a, b = random.state_dict(), warm.state_dict()
    copied = {
        "layers.0.self_attn.o_proj.weight": layer["self_attn.o_proj.weight"],
        "layers.0.mlp.gate_proj.weight": layer["mlp.gate_proj.weight"],
        "layers.0.mlp.up_proj.weight": layer["mlp.up_proj.weight"],
        "layers.0.mlp.down_proj.weight": layer["mlp.down_proj.weight"],
        "layers.0.hidden_norm.weight": layer["input_layernorm.weight"],
        "layers.0.post_attention_layernorm.weight": layer["post_attention_layernorm.weight"],
        "norm.weight": weights["model.norm.weight"],
    }
    for name, value in copied.items():
        assert torch.equal(b[name], value.to(b[name].dtype)), name
        assert not torch.equal(a[name], b[name]), name  # not what the random start already held
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"layers.0.self_attn.{proj}.weight"
        assert b[name].shape[1] == 2 * hidden
        assert torch.equal(b[name][:, hidden:], layer[f"self_attn.{proj}.weight"])  # the hidden-state half
        assert torch.equal(b[name][:, :hidden], a[name][:, :hidden])  # the embedding half: the random start
    fc = b["fc.weight"]  # [H, 3H]: the identity on layer 3's slot, the third
    assert torch.equal(fc[:, 2 * hidden :], torch.eye(hidden)) and not fc[:, : 2 * hidden].any()
    halves = {f"layers.0.self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj")}
    for name in set(a) - set(copied) - halves - {"fc.weight"}:
        assert torch.equal(a[name], b[name]), name  # embeddings, heads, the embedding norm: unchanged


def test_init_verifier_refuses_a_draft_whose_heads_differ_from_the_verifiers(verifier_dir):
    with pytest.raises(ValueError, match=r"draft\.init: verifier: the verifier's model\.layers\.3\..*draft\.head_dim"):
        _drafts(verifier_dir, head_dim=16)


def test_a_logger_whose_package_is_missing_is_refused_before_training(monkeypatch, tmp_path):
    from draftpipe.stages.draft import loggers

    loggers.check_loggers(["tensorboard"])  # installed by envs/setup.sh
    monkeypatch.setitem(loggers.LOGGER_PACKAGES, "wandb", ("draftpipe_absent_package", "pip install wandb"))
    with pytest.raises(ValueError, match=r"draft.loggers: wandb needs the 'draftpipe_absent_package' package, not "):
        loggers.open_loggers(["tensorboard", "wandb"], tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # refused before anything was written
    with pytest.raises(ValueError, match=r"draft.loggers: 'csv' is not one of tensorboard, mlflow, trackio, wandb"):
        loggers.check_loggers(["csv"])
    assert loggers.open_loggers([], tmp_path / "none") == [] and not (tmp_path / "none").exists()

"""Streamed hidden states (``hidden_states.storage: stream``): sizes and the config check, the plan of units the
trainer reads, the spool's budget and order, and the plan's two storages. The end-to-end run with vLLM is in
``tests/e2e/test_streaming.py``."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from safetensors.torch import save_file

from draftpipe.stages.draft.data import SplitDataset
from draftpipe.stages.draft.producer import wait_for_room
from draftpipe.stages.draft.ranks import StepBatchSampler
from draftpipe.stages.draft.stream import (
    REQUESTS,
    Spool,
    StreamError,
    StreamSettings,
    plan_units,
    ready_path,
    request_bytes,
    request_path,
)
from draftpipe.workflow.config import ConfigError, validate_config
from draftpipe.workflow.plan import format_plan, human, plan
from draftpipe.workflow.storage import check_storage, parse_bytes, step_spool_bytes


def test_sizes_parse_in_binary_and_decimal_units():
    assert parse_bytes("200GiB", "f") == 200 * 2**30
    assert parse_bytes("1.5 MiB", "f") == 3 * 2**19
    assert parse_bytes("2TB", "f") == 2 * 10**12
    assert parse_bytes(4096, "f") == 4096
    for bad in ("lots", "12 parsecs", "-1GiB", 0, True):
        with pytest.raises(ConfigError, match=r"^hidden_states\.disk_budget: "):
            parse_bytes(bad, "hidden_states.disk_budget")


def _kimi():
    cfg = yaml.safe_load((REPO / "configs/kimi-k2.5.yaml").read_text())
    validate_config(cfg)
    derived = {"aux_layer_ids": [2, 30, 58], "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840}
    return cfg, derived


def test_a_stream_must_fit_one_step_and_feed_one_rank():
    cfg, derived = _kimi()
    cfg["hidden_states"]["storage"] = "stream"
    cfg["resources"]["draft"].update(gpus=1, ranks=None)
    step = step_spool_bytes(cfg, derived)
    # batches_per_step x (total_seq_len + 1) tokens x (3 aux + 1 last) x 7168 x 2 bytes (bfloat16) + the token id
    d = cfg["draft"]
    assert step == d["batches_per_step"] * (d["total_seq_len"] + 1) * (4 * 7168 * 2 + 8)
    cfg["hidden_states"]["disk_budget"] = step
    assert check_storage(cfg, derived) == {"storage": "stream", "disk_budget": step}
    cfg["hidden_states"]["disk_budget"] = step - 1
    with pytest.raises(ConfigError, match=r"^hidden_states\.disk_budget: .* less than one training step"):
        check_storage(cfg, derived)
    cfg["hidden_states"]["disk_budget"] = "1TiB"
    cfg["resources"]["draft"].update(gpus=8)
    with pytest.raises(ConfigError, match=r"^hidden_states\.storage: stream feeds one training rank, .* 8"):
        check_storage(cfg, derived)
    cfg["hidden_states"]["storage"] = "disk"  # the budget shapes nothing on disk
    assert check_storage(cfg, derived) == {"storage": "disk", "disk_budget": 2**40}


def test_the_plan_prints_both_storages_with_their_disk_and_prefill():
    cfg, derived = _kimi()
    shape = {k: derived[k] for k in ("num_hidden_layers", "vocab_size", "hidden_size")}
    disk = plan(cfg, shape)
    s = copy.deepcopy(cfg)
    s["hidden_states"].update(storage="stream", disk_budget="200GiB")
    stream = plan(s, shape)
    assert disk["hidden_state_bytes"] == stream["hidden_state_bytes"] > 200 * 2**30
    # streamed, the disk holds the budget instead of the shards
    assert stream["disk_bytes"] - disk["disk_bytes"] == 200 * 2**30 - disk["hidden_state_bytes"]
    cut = min(disk["tokens_per_sample"], cfg["draft"]["total_seq_len"] + 1)
    assert stream["stream_tokens_per_epoch"] == disk["train_samples"] * cut
    text = format_plan(stream)
    epochs = cfg["draft"]["epochs"]
    assert "stream (chosen): a spool of at most 200.0 GiB" in text
    assert f"x {epochs} epoch(s) = {stream['stream_tokens_per_epoch'] * epochs:,} tokens" in text
    assert (
        f"disk: shards {human(disk['hidden_state_bytes'])}, vLLM prefill of {disk['train_tokens']:,} tokens once"
        in text
    )
    assert "disk (chosen)" in format_plan(disk)


def _sampler(lengths, seed=0):
    return StepBatchSampler(lengths, 64, 2, 0, 1, seed)


def test_a_resumed_plan_is_the_rest_of_the_fresh_one():
    lengths = [int(x) for x in torch.randint(5, 60, (40,), generator=torch.Generator().manual_seed(1))]
    train, val = _sampler(lengths[:30]), _sampler(lengths[30:])
    train_index, val_index = list(range(30)), list(range(30, 40))
    fresh = plan_units(train, val, train_index, val_index, 3, 0, 0)
    per_epoch = []
    for epoch in range(3):  # multipack's step count follows each epoch's shuffle
        train.set_epoch(epoch)
        val.set_epoch(epoch)
        per_epoch.append((train.steps, val.steps))
    train.set_epoch(0)
    val.set_epoch(0)
    assert len(fresh) == sum(t + v for t, v in per_epoch)
    start = 0
    for t, v in per_epoch:  # each epoch: training samples, each at most once, then validation samples
        block = fresh[start : start + t + v]
        read = [[g for u in part for g in u] for part in (block[:t], block[t:])]
        for got, index in zip(read, (train_index, val_index)):
            assert len(got) == len(set(got)) and set(got) <= set(index) and len(got) >= len(index) - 4
        assert all(len(u) >= 1 for u in block)
        start += t + v
    t0, v0 = per_epoch[0]
    assert fresh[:t0] != fresh[t0 + v0 : 2 * t0 + v0]  # shuffled per epoch
    resumed = plan_units(train, val, train_index, val_index, 3, 1, 2)
    assert resumed == fresh[t0 + v0 + 2 :]
    assert (train.epoch, train.skip) == (0, 0)  # the samplers are left as they were
    # what the trainer's loader reads in epoch 1 after 2 steps: the same batches, a step's two batches per unit
    train.set_epoch(1)
    train.skip = 2
    read = list(train)
    assert [g for u in resumed[: per_epoch[1][0] - 2] for g in u] == [g for b in read for g in b]


def test_the_split_keeps_each_sample_s_global_index():
    samples = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n)} for n in (4, 5, 6, 7, 8, 9)]
    samples[2]["loss_mask"][:] = 0  # nothing to learn: left out of the training split, counted
    train = SplitDataset(iter(samples), 16, "train", 3, torch.float32)
    val = SplitDataset(iter(samples), 16, "val", 3, torch.float32)
    assert train.global_index == [0, 1, 3, 4] and val.global_index == [2, 5]
    assert train.approx_lengths == [4, 5, 7, 8]


def test_waiting_for_room_ends_when_the_trainer_frees_a_unit(tmp_path):
    (tmp_path / REQUESTS).mkdir()
    held = tmp_path / REQUESTS / "0000000-00000.safetensors"
    held.write_bytes(b"x" * 600)
    threading.Timer(0.3, held.unlink).start()
    t0 = time.monotonic()
    assert wait_for_room(tmp_path, 500, 1000) == 0
    assert time.monotonic() - t0 >= 0.25
    with pytest.raises(StreamError, match="more than hidden_states.disk_budget 1,000"):
        wait_for_room(tmp_path, 1001, 1000)


def _spool(tmp_path, lengths):
    rows = [{"prompt_token_ids": list(range(1, n)), "completion_token_ids": [7]} for n in lengths]
    comp = tmp_path / "train_00000.jsonl"
    comp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = StreamSettings("v", [1, 2], 3, 4, "bfloat16", "float32", 64, 10**6)
    return Spool(tmp_path / "spool", [str(comp)], s, 8, 1)


def _produce(spool, unit, samples):
    for j, g in enumerate(samples):
        ids = torch.tensor(spool.sequences[g][0][: spool.cut[g]])
        states = torch.full((len(ids), 3, 4), float(g))
        save_file({"hidden_states": states, "token_ids": ids}, str(request_path(spool.dir, unit, j)))
    ready_path(spool.dir, unit).write_text("0")


def test_the_spool_hands_out_states_in_plan_order_and_frees_each_unit(tmp_path):
    spool = _spool(tmp_path, [3, 12, 5])
    assert spool.cut == [3, 9, 5]  # at most total_seq_len + 1 tokens are extracted
    assert request_bytes(9, spool.settings) == 9 * (3 * 4 * 4 + 8) + 4096
    spool.publish([[1, 0], [2]])
    _produce(spool, 0, [1, 0])
    _produce(spool, 1, [2])
    assert spool.states(1).shape == (9, 3, 4) and float(spool.states(0)[0, 0, 0]) == 0.0
    assert spool.states(2).shape == (5, 3, 4)
    assert not request_path(spool.dir, 0, 0).exists()  # unit 0 was freed when unit 1 was read
    with pytest.raises(StreamError, match="not in the planned unit 2"):
        spool.states(0)
    assert spool.close() == {} and not spool.dir.exists()


def test_the_spool_refuses_a_sample_out_of_order_and_a_producer_that_died(tmp_path):
    spool = _spool(tmp_path, [3, 4])
    spool.publish([[0], [1]])
    with pytest.raises(StreamError, match="sample 1, which is not in the planned unit 0"):
        spool.states(1)
    spool = _spool(tmp_path, [3, 4])
    spool.publish([[0], [1]])
    spool.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(StreamError, match=r"producer exited \(status 3\) before unit 0 of 2"):
        spool.states(0)
    spool.close()


def test_the_job_settings_carry_the_budget_in_bytes():
    from draftpipe.workflow.settings import job_settings

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    validate_config(cfg)
    cfg["hidden_states"]["disk_budget"] = "3MiB"
    assert job_settings("draft", cfg).disk_budget == 3 * 2**20
    assert Path(REPO / "config.yaml").read_text().count("storage: disk") == 1  # the embedded default writes shards


def test_the_producer_and_the_trainer_take_disjoint_devices_when_there_are_enough():
    from draftpipe.stages.draft.stream import split_devices

    assert split_devices("0,1,2,3,4,5,6,7", 4) == ("0,1,2,3", "4,5,6,7")
    assert split_devices("3,5", 2) == ("3,5", "3,5")  # no device left over: shared
    assert split_devices(None, 2) == (None, None) and split_devices("0,1", 0) == (None, None)


def test_a_budget_larger_than_the_free_disk_is_refused(tmp_path):
    from draftpipe.workflow.plan import DiskSpaceError, check_budget

    check_budget(1000, tmp_path, free=1000)
    with pytest.raises(DiskSpaceError, match=r"disk_budget is 1000 B but .* has 999 B free"):
        check_budget(1000, tmp_path, free=999)


def test_vllm_leaves_room_on_a_gpu_it_shares_with_the_trainer():
    from draftpipe.workflow.plan import stream_devices
    from draftpipe.workflow.storage import stream_gpu_memory

    res = {"hidden_states": {"gpus": 8}, "draft": {"gpus": 0, "stream_gpu_memory_utilization": None}}
    assert stream_gpu_memory(res) == 0.6  # shared: the draft and its optimizer live beside vLLM on GPU 0
    res["draft"]["gpus"] = 1
    assert stream_gpu_memory(res) == 0.9  # vLLM's own default when the trainer has a GPU of its own
    res["draft"]["stream_gpu_memory_utilization"] = 0.8
    assert stream_gpu_memory(res) == 0.8
    assert "trainer shares the first with the 40% vLLM leaves" in stream_devices(8, 0, 0.6)
    assert "the job holds 9 GPUs: vLLM on 8 (tensor parallel, 90%" in stream_devices(8, 1, 0.9)
    assert stream_devices(0, 0, 0.9) == "; vLLM and the trainer share the CPU"

"""Draft stage: per-epoch metrics, where the aux ids are written, acceptance arithmetic, and training that
resumes after a SIGKILL from its last checkpoint to the same bytes as an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINYSTORIES
from draftpipe.draft import (
    TRAINING_STATE,
    clean_work_dir,
    epoch_metrics,
    finalize_config,
    latest_checkpoint,
    settings_from_params,
)
from draftpipe.io import sha256_file
from draftpipe.spec_decode import acceptance_from_counters

AUX = [1, 2, 4]
EPOCHS = 3

# One training run in its own process (so it can be killed), logging to stdout.
TRAIN = """
import json, logging, sys
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
torch.set_num_threads(1)
from draftpipe.draft import DraftSettings, export_draft, train_draft
verifier, shards, maps, work, out, epochs, per_epoch = sys.argv[1:8]
settings = DraftSettings(epochs=int(epochs), lr=3e-3, total_seq_len=256, val_every=5, seed=0)
checkpoint, rows = train_draft(verifier, shards.split(","), maps, work, settings, checkpoints_per_epoch=int(per_epoch))
export_draft(checkpoint, out + "/model.safetensors", out + "/config.json", [1, 2, 4], "verifier")
with open(out + "/metrics.json", "w") as fh:
    json.dump(rows, fh)
"""


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


@pytest.fixture(scope="module")
def shards(verifier_dir, tmp_path_factory):
    """Two real hidden-state shards of the verifier over the TinyStories prompts (first 12 tokens as the prompt,
    the rest as the completion), and their vocab maps."""
    import torch
    from transformers import AutoTokenizer

    from draftpipe.hidden_states import build_sample, load_verifier_model, write_shard
    from draftpipe.io import read_jsonl
    from draftpipe.vocab import build_maps, count_tokens, write_maps

    out = tmp_path_factory.mktemp("shards")
    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    model = load_verifier_model(str(verifier_dir), "float32")
    n_layers = model.config.num_hidden_layers
    rows = []
    for rec in read_jsonl(TINYSTORIES):
        ids = tok(rec["prompt"])["input_ids"]
        rows.append({"prompt_token_ids": ids[:12], "completion_token_ids": ids[12:]})
    samples = [build_sample(model, row, AUX, n_layers, 512, torch.bfloat16) for row in rows]
    paths = []
    for i, part in enumerate((samples[::2], samples[1::2])):
        path = out / f"train_{i:05d}.safetensors"
        write_shard(str(path), part, {"aux_layer_ids": AUX, "num_layers": n_layers, "hidden_size": 64})
        paths.append(str(path))
    vocab = model.config.vocab_size
    d2t, t2d = build_maps(count_tokens(samples, vocab), 256)
    maps = out / "vocab_maps.safetensors"
    write_maps(str(maps), d2t, t2d, vocab, 256)
    return paths, str(maps)


def _train_cmd(verifier_dir, shards, work, out, per_epoch=1):
    paths, maps = shards
    out.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-c", TRAIN, str(verifier_dir), ",".join(paths), maps, str(work), str(out), str(EPOCHS),
            str(per_epoch)]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(verifier_dir, shards, tmp_path_factory):
    """One uninterrupted training run (a checkpoint per epoch): its output directory."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = subprocess.run(_train_cmd(verifier_dir, shards, tmp / "work", tmp / "out"), env=_env(), cwd=tmp,
                         capture_output=True, text=True)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert "resuming from epoch" not in ref.stdout
    return tmp / "out"


@pytest.mark.parametrize("per_epoch", [1, 2], ids=["end-of-epoch", "mid-epoch"])
def test_training_killed_after_a_checkpoint_resumes_to_identical_bytes(verifier_dir, shards, reference, per_epoch,
                                                                       tmp_path):
    # the same training, SIGKILLed as soon as its first checkpoint is complete: at the end of epoch 0, or (two
    # checkpoints per epoch) half-way through it
    work = tmp_path / "work"
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(_train_cmd(verifier_dir, shards, work, tmp_path / "out", per_epoch), env=_env(),
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        while latest_checkpoint(work) is None and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    killed_at = latest_checkpoint(work)
    assert killed_at is not None and killed_at[0] < EPOCHS - 1  # it stopped with epochs left to train
    if per_epoch == 1:
        assert killed_at[1].name == str(killed_at[0])
    else:
        assert re.fullmatch(rf"{killed_at[0]}-step\d+", killed_at[1].name), killed_at
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # what a SIGKILL during a save leaves: a temporary directory, and an epoch directory without the state file
    (work / f".{killed_at[0] + 1}.tmp-x").mkdir()
    (work / f".{killed_at[0] + 1}.tmp-x" / "model.safetensors").write_bytes(b"partial")
    (work / str(killed_at[0] + 2)).mkdir()
    (work / str(killed_at[0] + 2) / "model.safetensors").write_bytes(b"partial")

    rerun = subprocess.run(_train_cmd(verifier_dir, shards, work, tmp_path / "out", per_epoch), env=_env(),
                           cwd=tmp_path, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    m = re.search(r"resuming from epoch (\d+)( step \d+)? checkpoint (\S+)", rerun.stdout)
    assert m, rerun.stdout[-3000:]
    assert int(m.group(1)) == killed_at[0] and m.group(3) == str(killed_at[1])
    assert bool(m.group(2)) == (per_epoch > 1)
    # only the final checkpoint is left
    assert sorted(p.name for p in work.iterdir()) == [str(EPOCHS - 1)]

    # the bytes of the uninterrupted run, whatever the number of checkpoints per epoch
    for name in ("model.safetensors", "config.json"):
        assert sha256_file(tmp_path / "out" / name) == sha256_file(reference / name), name
    rows = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [r["epoch"] for r in rows] == list(range(EPOCHS))
    assert rows == json.loads((reference / "metrics.json").read_text())

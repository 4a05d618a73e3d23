"""``hidden_states.storage: stream`` on the embedded default: the draft job extracts the hidden states from vLLM as
it trains, within a disk budget, and writes no shard.

One streamed draft of one epoch (a copy of the session's one-epoch reference, whose draft was trained from the
shards, the ``one_epoch`` fixture) is compared with that disk draft: vLLM's states of a sequence depend on the batch
it is computed in at the last bit (the disk mode extracted 256 tokens per engine call, the stream one training step
per call), so the drafts are equal within that rounding: every tensor within 1e-3 relative (Frobenius norm) and the
same validation loss within 1e-3 relative. The spool, measured by the test while the job runs, stays below a budget
of a quarter of the shards' bytes. A streamed job SIGKILLed after a mid-epoch checkpoint, then rerun, ends with the
uninterrupted streamed draft's bytes: each step is extracted in one engine call without a prefix cache, so a
re-extracted step is the same bytes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import CORES
from helpers.workflow import copy_build, one_epoch_config, planned_jobs, snakemake, stream_figures

from draftpipe.core.io import sha256_file
from draftpipe.core.layout import STORE
from draftpipe.stages.draft.checkpoint import latest_checkpoint

TARGET = "results/draft/model.safetensors"
BUDGET = 1_572_864  # 1.5 MiB: three steps of 512 tokens x 4 states x 64 x float32


class SpoolWatch(threading.Thread):
    """The largest total size of the spool's files (``results/draft/.train/*.spool``) seen while a job runs,
    sampled every 10 ms."""

    def __init__(self, work: Path):
        super().__init__(daemon=True)
        self.root, self.peak, self.samples, self.done = work / "results/draft/.train", 0, 0, False

    def run(self):
        while not self.done:
            total = 0
            for spool in self.root.glob("*.spool"):
                for f in spool.rglob("*"):
                    try:
                        total += f.stat().st_size if f.is_file() else 0
                    except FileNotFoundError:
                        pass
            self.peak, self.samples = max(self.peak, total), self.samples + 1
            time.sleep(0.01)


def _stream(cfg: dict) -> None:
    cfg["hidden_states"].update(storage="stream", disk_budget=BUDGET)


@pytest.fixture(scope="module")
def streamed(one_epoch, tmp_path_factory):
    """The one-epoch reference's draft trained again with the hidden states streamed: the copy and its config."""
    work = copy_build(one_epoch, tmp_path_factory.mktemp("stream") / "wf")
    cfg = one_epoch_config(work, "stream", _stream)
    assert planned_jobs(work, "--configfile", cfg) == {"draft": 1}  # nothing upstream reruns
    shards_before = {p.name: sha256_file(p) for p in (work / "results/hidden_states").glob("*.safetensors")}
    watch = SpoolWatch(work)
    watch.start()
    try:
        snakemake(work, TARGET, "--configfile", cfg)
    finally:
        watch.done = True
        watch.join()
    assert {p.name: sha256_file(p) for p in (work / "results/hidden_states").glob("*.safetensors")} == shards_before
    return work, cfg, watch


def test_a_streamed_draft_is_the_disk_draft_within_vllm_s_rounding(one_epoch, streamed):
    from safetensors.torch import load_file

    work, _, watch = streamed
    shard_bytes = sum(p.stat().st_size for p in (one_epoch / "results/hidden_states").glob("*.safetensors"))
    assert BUDGET <= shard_bytes / 4
    figures = stream_figures((work / "results/logs/draft.log").read_text())
    print(f"stream: {figures}; spool peak seen by the test {watch.peak:,} bytes in {watch.samples} samples")
    assert figures["budget"] == BUDGET and 0 < figures["peak"] <= BUDGET
    assert watch.samples > 100 and 0 < watch.peak <= BUDGET
    assert not list((work / "results/draft/.train").glob("*.spool"))  # the spool is gone with the job

    disk = load_file(str(one_epoch / TARGET))
    stream = load_file(str(work / TARGET))
    assert disk.keys() == stream.keys()
    for name in disk:
        a, b = stream[name].float(), disk[name].float()
        rel = float((a - b).norm() / b.norm().clamp_min(1e-12))
        assert rel <= 1e-3, (name, rel)
    val = [pd.read_csv(w / "results/draft/metrics.csv")["val_loss"].iloc[-1] for w in (work, one_epoch)]
    assert abs(val[0] - val[1]) <= 1e-3 * abs(val[1]), val


def test_in_a_stream_aux_ids_and_dtype_rerun_only_the_draft(streamed):
    work, cfg, _ = streamed
    assert planned_jobs(work, "--configfile", cfg) == {}
    for name, change in (
        ("aux", lambda c: c["hidden_states"].update(aux_layer_ids=[1, 3, 4])),
        ("dtype", lambda c: c["hidden_states"].update(dtype="float16")),
        ("budget", lambda c: c["hidden_states"].update(disk_budget="4MiB")),  # shapes nothing
    ):
        changed = one_epoch_config(work, f"stream-{name}", lambda c, change=change: (_stream(c), change(c)))
        assert planned_jobs(work, "--configfile", changed) == ({} if name == "budget" else {"draft": 1}), name


def test_a_streamed_job_killed_mid_epoch_resumes_to_the_uninterrupted_bytes(streamed, tmp_path):
    reference, _, _ = streamed
    work = copy_build(reference, tmp_path / "wf")
    # the draft is gone, from results/draft/ and from the stage store (which would give it back untrained)
    for name in ("model.safetensors", "config.json", "metrics.csv"):
        (work / "results/draft" / name).unlink()
    shutil.rmtree(work / "results" / STORE / "draft")
    cfg = one_epoch_config(
        work,
        "stream-checkpoints",
        lambda c: (_stream(c), c["resources"]["draft"].update(checkpoints_per_epoch=4)),  # shapes nothing
    )
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", str(CORES), TARGET, "--configfile", cfg],
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    train = work / "results/draft/.train"
    try:
        found = None
        while found is None and proc.poll() is None:
            found = next((c for d in train.glob("*") if d.is_dir() and (c := latest_checkpoint(d))), None)
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL and found is not None, (tmp_path / "killed.log").read_text()[-3000:]
    assert "-step" in found[1].name, found  # part-way through an epoch
    snakemake(work, "--unlock", "--configfile", cfg)
    snakemake(work, TARGET, "--configfile", cfg, "--rerun-incomplete")
    out = (work / "results/logs/draft.log").read_text()
    assert f"resuming from epoch {found[0]} step" in out
    for name in ("model.safetensors", "metrics.csv"):
        assert sha256_file(work / "results/draft" / name) == sha256_file(reference / "results/draft" / name), name
    # the config names the verifier by its absolute path, in this copy of the build
    config = (work / "results/draft/config.json").read_text().replace(str(work.resolve()), str(reference.resolve()))
    assert config == (reference / "results/draft/config.json").read_text()

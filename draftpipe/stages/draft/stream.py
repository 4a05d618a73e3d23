"""Hidden states streamed from vLLM to the draft's trainer within a disk budget (``hidden_states.storage: stream``).

With ``stream`` no hidden-state shard is written: the draft job reads the completions, starts the vLLM extraction
engine (the ``hidden_states`` stage's ``extract_hidden_states`` path and connector) in a producer process
(:mod:`draftpipe.stages.draft.producer`) and trains on what it produces. The two meet in a spool directory beside
the training work directory (``<work>.spool/``):

- **The order is known before training starts.** The batches of an epoch are a function of the seed, the epoch and
  the sample lengths (:class:`draftpipe.stages.draft.ranks.StepBatchSampler`, speculators' multipack), and the
  lengths come from the completions. Once the trainer has found its resume point, :func:`plan_units` lists, for
  every step still to train (and every validation step), the samples it will read: one *unit* per step. The
  producer extracts the units in that order, one sequence per engine call with the prefix cache off, so the
  states of a sequence depend on the sequence alone (vLLM's depend on the batch of the engine step at the last
  bit, and requests sent together may or may not share a step, by timing): a resumed run re-extracts exactly the
  bytes an uninterrupted one read.
- **The spool never holds more than the budget.** Before a unit, the producer waits until the bytes in the spool
  plus the unit's own fit in ``hidden_states.disk_budget``; the trainer removes a unit's files as soon as it moves
  to the next unit. One unit must fit (checked when the workflow is read, against the largest possible step); two
  let extraction run one step ahead of training.
- **Each epoch extracts again** (no hybrid cache): the spool is a window, not a store, so the disk used is the
  budget whatever the data size, and a resume needs nothing but the checkpoint. The plan prints the price: prefill
  tokens per epoch x epochs.
- **Only what trains is extracted.** A sample longer than ``draft.total_seq_len`` is cut at collation to its
  first ``total_seq_len + 1`` tokens (speculators' ``shift_batch`` drops one), so the producer extracts at most
  that many; the states of a causal model's first tokens do not depend on later ones.

The stored dtype still applies: each sample's states are rounded to ``hidden_states.dtype`` (float8 with its
scales) exactly as a shard would store them, then read as the trainer reads a shard. vLLM's states of a sequence
may differ in the last bits with the batch it is computed in (the disk mode extracts ``batch_tokens`` at a time, the
stream one sequence at a time), so the two storages train drafts equal within that rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from draftpipe.core.io import iter_jsonl, write_json
from draftpipe.core.layout import SOURCE_ROOT
from draftpipe.formats.captured import sample_of
from draftpipe.formats.chat import common_template, row_templates
from draftpipe.formats.hidden_states import SCALE_KEYS, dequantize_sample, engine_token_bytes, sequence_and_mask
from draftpipe.runtime.job import die_with_parent
from draftpipe.stages.draft.data import SplitDataset

#: spool layout: the producer's spec, the consumer's plan, the per-request files, a marker per finished unit
SPEC, PLAN, REQUESTS, STATS = "spec.json", "plan.json", "requests", "producer.json"
#: safetensors header and alignment per request file, beside the tensors (an upper bound)
FILE_OVERHEAD = 4096
POLL_S = 0.01


class StreamError(RuntimeError):
    """The producer failed or stopped, or the trainer asked for a sample out of the planned order."""


@dataclass(frozen=True)
class StreamSettings:
    """What the producer extracts and how much disk it may use.

    Attributes:
        verifier: the verifier's directory (or hub id).
        aux_layer_ids: aux layer ids (vLLM convention, :mod:`draftpipe.formats.hidden_states`).
        num_layers: the verifier's decoder layers ``N``.
        hidden_size: the verifier's hidden size ``H``.
        dtype: the stored dtype (``hidden_states.dtype``); the states are rounded to it as a shard stores them.
        model_dtype: the engine's dtype (``verifier.dtype``).
        max_len: ``verifier.max_model_len``: sequences are cut there, as for shards.
        budget: bytes the spool may hold (``hidden_states.disk_budget``).
        gpus: the producer engine's devices (tensor parallel size; 0 on a CPU).
        gpu_memory: the share of each GPU's memory vLLM may take (``gpu_memory_utilization``; GPUs only).
    """

    verifier: str
    aux_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    dtype: str
    model_dtype: str
    max_len: int
    budget: int
    gpus: int = 0
    gpu_memory: float = 0.9


def extracted_length(tokens: int, total_seq_len: int) -> int:
    """Tokens of a sample the producer extracts: the ``total_seq_len + 1`` the trainer reads at most."""
    return min(tokens, total_seq_len + 1)


def request_bytes(tokens: int, settings: StreamSettings) -> int:
    """Upper bound of one request file's bytes: ``tokens x (n_ids x H x engine bytes + 8)`` plus
    :data:`FILE_OVERHEAD` (vLLM's connector writes the states of every captured layer and the token ids)."""
    per_token = engine_token_bytes(
        settings.aux_layer_ids, settings.num_layers, settings.hidden_size, settings.model_dtype
    )
    return tokens * per_token + FILE_OVERHEAD


def read_sequences(completions: list[str], max_len: int) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of every completion row, in shard and row order: the samples a shard would hold
    (:func:`draftpipe.formats.hidden_states.sequence_and_mask`)."""
    return [sequence_and_mask(row, max_len) for path in completions for _, row in iter_jsonl(path)]


def plan_units(train_sampler, val_sampler, train_index, val_index, epochs: int, start_epoch: int, skip: int):
    """The samples the trainer will read, step by step, from its resume point: a list of units (global sample
    indices, each list the samples of one optimizer or validation step, in the order they are read).

    Mirrors :meth:`draftpipe.stages.draft.trainer.ResumableTrainer.run_training`: for each epoch from
    ``start_epoch``, the training steps (those after ``skip`` in the first epoch), then the validation steps.

    Args:
        train_sampler, val_sampler: the loaders' :class:`~draftpipe.stages.draft.ranks.StepBatchSampler` (the val
            one may be None); their epoch and skip are restored.
        train_index, val_index: global sample index of each dataset index.
        epochs: ``draft.epochs``; start_epoch, skip: where training resumes.
    """
    units: list[list[int]] = []
    for epoch in range(start_epoch, epochs):
        for sampler, index, first in (
            (train_sampler, train_index, skip if epoch == start_epoch else 0),
            (val_sampler, val_index, 0),
        ):
            if sampler is None:
                continue
            saved = (sampler.epoch, sampler.skip)
            sampler.set_epoch(epoch)
            sampler.skip = first
            batches = list(sampler)
            sampler.set_epoch(saved[0])
            sampler.skip = saved[1]
            k = sampler.per_rank
            for i in range(0, len(batches), k):
                units.append([index[j] for batch in batches[i : i + k] for j in batch])
    return units


def spool_bytes(spool: str | os.PathLike) -> int:
    """Bytes of every file in the spool: the request files (finished, being written or being read), the markers,
    the spec and the plan."""
    total = 0
    for root, _, files in os.walk(spool):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # removed by the trainer meanwhile
                pass
    return total


def request_path(spool: str | os.PathLike, unit: int, j: int) -> Path:
    """Where the connector writes sample ``j`` of ``unit``."""
    return Path(spool) / REQUESTS / f"{unit:07d}-{j:05d}.safetensors"


def ready_path(spool: str | os.PathLike, unit: int) -> Path:
    """The marker the producer writes when every request file of ``unit`` is complete."""
    return Path(spool) / REQUESTS / f"{unit:07d}.ready"


@contextlib.contextmanager
def written(path: str | os.PathLike, *, lock_required: bool = True):
    """A block that runs once vLLM's connector has written a request file, holding a shared ``flock`` on its
    ``<file>.lock`` (as vLLM's ``load_hidden_states`` does, ``example_hidden_states_connector.py``): the lock exists
    before the engine returns the request (vLLM's ``wait_for_save``) and is held until the file is complete.
    Without ``lock_required``, a file whose lock is gone (already freed by the producer) is read as it is.

    Raises:
        FileNotFoundError: ``lock_required`` and no lock file."""
    lock = Path(str(path) + ".lock")
    if not lock_required and not lock.exists():
        yield
        return
    with open(lock) as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)
        yield


def wait_written(path: str | os.PathLike) -> None:
    """Wait until vLLM's connector has written a request file (:func:`written`; its lock must exist)."""
    with written(path):
        pass


def read_request(path: Path):
    """``(hidden_states [T, n_ids, H], token_ids [T])`` of a request file, read once it is written (:func:`written`)."""
    from safetensors.torch import load_file

    with written(path, lock_required=False):
        data = load_file(str(path), device="cpu")
    return data["hidden_states"], data["token_ids"]


def split_devices(visible: str | None, gpus: int) -> tuple[str | None, str | None]:
    """``CUDA_VISIBLE_DEVICES`` of the producer and of the trainer from the job's: the first ``gpus`` devices for
    vLLM (``resources.hidden_states.gpus``), the rest for the trainer (disjoint sets, the plan says so); when the
    job holds no more than ``gpus`` devices, both share them. ``(None, None)``: nothing to split (a CPU job)."""
    devices = [d for d in (visible or "").split(",") if d.strip()]
    if not devices or gpus <= 0:
        return None, None
    producer = devices[:gpus]
    trainer = devices[gpus:] or devices
    return ",".join(producer), ",".join(trainer)


class Spool:
    """The trainer's side of the spool: starts the producer, publishes the plan, hands out each sample's states in
    the planned order and frees each unit when the next one is read.

    Args:
        spool: the spool directory (emptied first: what a killed run left is extracted again).
        completions: the completions shards. settings: :class:`StreamSettings`.
        total_seq_len: ``draft.total_seq_len``. threads: the producer's CPU threads.
    """

    def __init__(self, spool, completions: list[str], settings: StreamSettings, total_seq_len: int, threads: int):
        self.dir = Path(spool)
        self.settings = settings
        self.sequences = read_sequences(completions, settings.max_len)
        self.cut = [extracted_length(len(ids), total_seq_len) for ids, _ in self.sequences]
        common_template(row_templates(completions))  # rows of two templates fail before the engine starts
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / REQUESTS).mkdir(parents=True)
        write_json(
            self.dir / SPEC,
            {"settings": asdict(settings), "completions": list(completions), "total_seq_len": total_seq_len},
        )
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.units: list[list[int]] = []
        self.unit = -1
        self.where: dict[int, int] = {}
        self.peak = 0

    def start(self) -> None:
        """Start the producer (``python -m draftpipe.stages.draft.producer <spool>``); it loads the engine while
        the trainer builds the draft, and dies with this process."""
        producer, _ = split_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), self.settings.gpus)
        env = {
            **os.environ,
            **({"CUDA_VISIBLE_DEVICES": producer} if producer else {}),
            "OMP_NUM_THREADS": str(max(1, self.threads)),
            "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }
        sys.stdout.flush()
        sys.stderr.flush()
        cmd = [sys.executable, "-m", "draftpipe.stages.draft.producer", str(self.dir)]
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)

    def publish(self, units: list[list[int]]) -> None:
        """Give the producer the units to extract, in order (:func:`plan_units`)."""
        self.units = units
        write_json(self.dir / PLAN, {"units": units, "lengths": [[self.cut[g] for g in u] for u in units]})

    def states(self, g: int):
        """The engine's states ``[T, n_ids, H]`` of global sample ``g`` (its first :func:`extracted_length`
        tokens), waiting for its unit.

        Raises:
            StreamError: ``g`` is not in the current or the next unit (the trainer left the planned order), or the
                producer exited before the unit was ready.
        """
        if g not in self.where:
            self._next_unit(g)
        path = request_path(self.dir, self.unit, self.where[g])
        states, ids = read_request(path)
        want = self.sequences[g][0][: self.cut[g]]
        if ids.tolist() != want:
            raise StreamError(f"{path}: states of {ids.numel()} other tokens than sample {g}'s {len(want)}")
        return states

    def _next_unit(self, g: int) -> None:
        if self.unit >= 0:  # the previous unit is read: free it
            for j in range(len(self.units[self.unit])):
                path = request_path(self.dir, self.unit, j)
                path.unlink(missing_ok=True)
                Path(str(path) + ".lock").unlink(missing_ok=True)
            ready_path(self.dir, self.unit).unlink(missing_ok=True)
        self.unit += 1
        if self.unit >= len(self.units) or g not in self.units[self.unit]:
            raise StreamError(
                f"the trainer asked for sample {g}, which is not in the planned unit {self.unit} "
                f"({len(self.units)} planned): the batch order differs from the plan"
            )
        self.where = {x: j for j, x in enumerate(self.units[self.unit])}
        marker = ready_path(self.dir, self.unit)
        while not marker.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise StreamError(
                    f"the hidden-state producer exited (status {self.proc.returncode}) before unit {self.unit} of "
                    f"{len(self.units)}; its error is above in the log"
                )
            time.sleep(POLL_S)
        self.peak = max(self.peak, int(marker.read_text() or 0))

    def close(self) -> dict:
        """Stop the producer (after the last unit it leaves by itself; else SIGTERM, then SIGKILL after 30 s) and
        remove the spool; returns the producer's
        figures (``units``, ``tokens``, ``peak_bytes``, ``budget``), or ``{}`` when it wrote none."""
        if self.proc is not None and self.units and self.unit == len(self.units) - 1:
            try:  # every unit was read: the producer is leaving by itself
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            stats = json.loads((self.dir / STATS).read_text())
        except (OSError, ValueError):
            stats = {}
        shutil.rmtree(self.dir, ignore_errors=True)
        return stats


class StreamDataset(SplitDataset):
    """speculators dataset over streamed samples: the ``split`` of the completions' samples (the same split and
    accounting as :class:`draftpipe.stages.draft.data.ShardDataset` over the shards they would make), each
    sample's states from the :class:`Spool` when the trainer reads it."""

    def __init__(self, spool: Spool, max_len: int, split: str, val_every: int, hidden_states_dtype):
        import torch

        self.spool = spool
        rows = (
            {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}
            for ids, mask in spool.sequences
        )
        super().__init__(rows, max_len, split, val_every, hidden_states_dtype)

    def _get_raw_data(self, index):
        g = self.global_index[index]
        s = self.spool.settings
        states = self.spool.states(g)
        n = states.shape[0]
        ids, mask = self.samples[index]["input_ids"][:n], self.samples[index]["loss_mask"][:n]
        sample = sample_of(ids.tolist(), mask.tolist(), states, s.aux_layer_ids, s.num_layers, s.dtype)
        sample = {**sample, "input_ids": sample["input_ids"].long(), "loss_mask": sample["loss_mask"].long()}
        return dequantize_sample(sample, self.hidden_states_dtype) if SCALE_KEYS["hidden_states"] in sample else sample

"""EAGLE-3 draft training with speculators 0.9 (its model, data collation, trainer and checkpointer).

Data: the hidden-state shards of :mod:`draftpipe.formats.hidden_states` are read by :class:`ShardDataset`, a
speculators ``BaseDataset``; speculators' ``CollateFn`` packs samples into ``[1, total_seq_len]`` batches and its
``shift_batch`` aligns inputs and targets. Model: ``Eagle3DraftModel.from_training_args`` with the decoder config
that speculators' training CLI builds (``create_transformer_layer_config``), optionally with another ``head_dim``.
Trainer: ``speculators.train.trainer.Trainer``; on machines without an accelerator the draft uses
:mod:`draftpipe.stages.draft.attention` (``sdpa`` over only the attending columns) and the eager loss (the defaults, flex
attention and a Triton loss, need a GPU; tiny-verifier §10).

Resumable training: after each epoch (training, then validation) the trainer writes a checkpoint directory
``<work_dir>/<epoch>/`` holding the speculators-format ``model.safetensors`` and ``config.json`` (bfloat16, what
is exported) and ``training_state.pt``: the model state in full precision (less the frozen parameters taken from
the verifier, which the draft is built with again), the optimizer and scheduler states, the epoch and global
step, the torch, numpy and Python random states, and the metrics logged so far. It is written into a hidden
temporary directory that is renamed into place, so a process killed during a save never leaves a checkpoint that
looks complete; the previous checkpoint is removed once the new one is in place. A rerun with the same work
directory restores all of it from the last complete checkpoint and continues with the next epoch. The batch order
is a pure function of (seed, epoch) (speculators' multipack sampler), so the result is bit-identical to an
uninterrupted run. With ``checkpoints_per_epoch`` > 1 the same state is also saved part-way through an epoch
(``<work_dir>/<epoch>-step<k>/``), and a resume skips the batches of the epoch already trained (speculators'
sampler slice). A SIGTERM or SIGINT ends training at once (speculators' save-on-interrupt is not used): the steps
since the last checkpoint are trained again on resume.

The exported directory holds ``model.safetensors`` and ``config.json`` in the speculators format (what
``speculators`` saves; vLLM reads it as ``SpeculatorsConfig``), with the aux layer ids written both at the top
level (read by vLLM's V1 and V2 model runners) and in ``transformer_layer_config.eagle_config`` (read by vLLM's
Llama EAGLE-3 model for the width of ``fc``, vLLM issue #54526).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftpipe.core.gates import check_finite_loss
from draftpipe.core.io import atomic_dir, atomic_path, write_json
from draftpipe.core.progress import Progress
from draftpipe.formats.chat import common_template
from draftpipe.formats.hidden_states import SCALE_KEYS, dequantize_sample, iter_shard, read_shard_metadata
from draftpipe.formats.vocab import read_maps
from draftpipe.stages.draft import attention
from draftpipe.stages.draft.ranks import StepBatchSampler, check_batches_per_step, init_ranks, launch

log = logging.getLogger(__name__)

#: The file of a checkpoint directory that holds the exact training state (see the module docstring).
TRAINING_STATE = "training_state.pt"
STATE_FORMAT = "draftpipe.draft_training_state.v1"


@dataclass
class DraftSettings:
    """Every knob of the ``draft`` section: the ones that shape the checkpoint reach the rule through ``params:``;
    the quality gate ``min_train_samples`` does not (it is read from the config, and changing it retrains nothing).

    The defaults are the schema's (``draft`` in ``draftpipe/workflow/config.schema.yaml``, which fills them into the
    workflow's config); ``tests/unit/test_settings.py`` holds the two together."""

    num_layers: int = 1
    head_dim: int | None = None
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    epochs: int = 10
    lr: float = 1e-4
    total_seq_len: int = 8192
    seed: int = 0
    val_every: int = 10
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    norm_output: bool = True
    loss_fn: str = "kl_div"
    scheduler_type: str = "linear"
    sliding_window: int | None = None
    #: packed batches of ``total_seq_len`` tokens per optimizer step (the global batch; the ranks share them, so
    #: their number must divide it): see :mod:`draftpipe.stages.draft.ranks`
    batches_per_step: int = 1
    #: quality gate (:func:`draftpipe.core.gates.check_train_samples`), not a param
    min_train_samples: int = 1
    extra: dict = field(default_factory=dict)


def window_accounting(lengths: list[int], trained: list[int], trained_in_window: list[int], max_len: int) -> dict:
    """Where the training tokens go when samples are packed into batches of ``max_len`` (``draft.total_seq_len``)
    tokens: a longer sample is cut to its first ``max_len`` tokens (speculators' ``CollateFn``), and one with no
    token to learn there is left out (it would make a step of loss 0).

    Args:
        lengths: tokens per sample.
        trained: loss-mask tokens per sample.
        trained_in_window: loss-mask tokens within each sample's first ``max_len`` tokens.
        max_len: the packed batch's length.

    Returns:
        ``samples``, ``tokens``, ``trained_tokens`` (as stored); ``long_samples`` (longer than ``max_len``),
        ``cut_trained_tokens`` (trained tokens past the window, lost), ``dropped_samples`` (long ones with nothing to
        learn in the window), ``used_tokens`` and ``used_trained_tokens`` (what the draft trains on per epoch), and
        ``kept_indices``.
    """
    kept = [i for i, (n, w) in enumerate(zip(lengths, trained_in_window)) if n <= max_len or w > 0]
    return {
        "samples": len(lengths),
        "tokens": sum(lengths),
        "trained_tokens": sum(trained),
        "long_samples": sum(n > max_len for n in lengths),
        "cut_trained_tokens": sum(t - w for t, w in zip(trained, trained_in_window)),
        "dropped_samples": len(lengths) - len(kept),
        "used_tokens": sum(min(lengths[i], max_len) for i in kept),
        "used_trained_tokens": sum(trained_in_window[i] for i in kept),
        "kept_indices": kept,
    }


def accounting_line(split: str, a: dict, max_len: int) -> str:
    """One log line for :func:`window_accounting`'s figures of a split (a warning when samples were cut)."""
    line = (
        f"draft {split} data: {a['samples'] - a['dropped_samples']} samples, {a['used_tokens']:,} tokens, "
        f"{a['used_trained_tokens']:,} trained on per epoch"
    )
    if a["long_samples"]:
        line += (
            f"; WARNING: {a['long_samples']} sample(s) longer than draft.total_seq_len={max_len} are cut to their first "
            f"{max_len} tokens ({a['cut_trained_tokens']:,} of {a['trained_tokens']:,} trained tokens lost), "
            f"{a['dropped_samples']} of them left out with no token to learn there; raise draft.total_seq_len to keep "
            "them"
        )
    return line


def _dataset_class():
    from speculators.train.data import BaseDataset

    class ShardDataset(BaseDataset):
        """speculators dataset over draftpipe hidden-state shards; samples ``i % val_every == val_every-1`` form
        the validation split (``split="val"``), the rest the training split."""

        def __init__(self, shards: list[str], max_len: int, split: str, val_every: int, hidden_states_dtype):
            import torch

            self.samples = []
            k = 0
            for path in shards:
                for sample in iter_shard(path):
                    is_val = val_every > 1 and k % val_every == val_every - 1
                    k += 1
                    if is_val == (split == "val"):
                        # as stored (a float8 shard's states stay float8 in memory, with their scales)
                        self.samples.append(
                            {**sample, "input_ids": sample["input_ids"].long(), "loss_mask": sample["loss_mask"].long()}
                        )
            # a sample longer than the packed batch is cut to its first max_len tokens (speculators' CollateFn); one
            # with no token to learn there would be a step of loss 0: left out, and counted (window_accounting)
            masks = [sample["loss_mask"] for sample in self.samples]
            self.accounting = window_accounting(
                [int(m.shape[0]) for m in masks],
                [int(m.sum()) for m in masks],
                [int(m[:max_len].sum()) for m in masks],
                max_len,
            )
            keep = set(self.accounting.pop("kept_indices"))
            self.samples = [sample for i, sample in enumerate(self.samples) if i in keep]
            self._torch = torch
            super().__init__(max_len, hidden_states_dtype)

        def _compute_approx_lengths(self):
            return [min(int(s["input_ids"].shape[0]), self.max_len) for s in self.samples]

        def __len__(self):
            return len(self.samples)

        def _get_raw_data(self, index):
            # float8 states times their scales, in the training dtype (hidden_states.dtype float8_e4m3fn)
            sample = {k: v.clone() for k, v in self.samples[index].items()}
            return (
                dequantize_sample(sample, self.hidden_states_dtype) if SCALE_KEYS["hidden_states"] in sample else sample
            )

    return ShardDataset


_CHECKPOINT_NAME = re.compile(r"(\d+)(?:-step(\d+))?")


def checkpoint_name(epoch: int, local_step: int = 0) -> str:
    """Directory name of a checkpoint: ``<epoch>`` at the end of an epoch, ``<epoch>-step<k>`` after ``k`` steps of
    it (a mid-epoch checkpoint)."""
    return str(epoch) if local_step == 0 else f"{epoch}-step{local_step}"


def latest_checkpoint(work_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """The last complete checkpoint in a training work directory, as ``(epoch, directory)``, or None.

    A checkpoint is complete when its directory is named by :func:`checkpoint_name` and holds
    :data:`TRAINING_STATE`; the end of an epoch comes after all its mid-epoch checkpoints. Saves write into a hidden
    ``.<name>.tmp-*`` directory renamed into place at the end, so the directories of an interrupted save (and epoch
    directories of other layouts, without the state file) never count.
    """
    root = Path(work_dir)
    if not root.is_dir():
        return None
    best = None
    for d in root.iterdir():
        m = _CHECKPOINT_NAME.fullmatch(d.name)
        if d.is_symlink() or not d.is_dir() or not m or not (d / TRAINING_STATE).is_file():
            continue
        order = (int(m.group(1)), math.inf if m.group(2) is None else int(m.group(2)))
        if best is None or order > best[0]:
            best = (order, d)
    return None if best is None else (best[0][0], best[1])


def clean_work_dir(work_dir: str | os.PathLike) -> list[Path]:
    """Remove everything in a training work directory that is not part of the last complete checkpoint: the
    temporary directories of interrupted saves, incomplete and older checkpoint directories, and symlinks. Other
    files are left. Returns the removed paths."""
    root = Path(work_dir)
    if not root.is_dir():
        return []
    latest = latest_checkpoint(root)
    removed = []
    for d in sorted(root.iterdir()):
        if latest is not None and d == latest[1]:
            continue
        if d.is_symlink():
            d.unlink()
        elif d.is_dir() and (
            _CHECKPOINT_NAME.fullmatch(d.name) or (d.name.startswith(".") and (".tmp-" in d.name or ".old-" in d.name))
        ):
            shutil.rmtree(d)
        else:
            continue
        removed.append(d)
    return removed


def rng_state() -> dict:
    """The random states training can draw from: torch (CPU and, where present, every CUDA device), numpy's
    global generator and Python's ``random``, in types ``torch.load(weights_only=True)`` reads back."""
    import numpy as np
    import torch

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the random states saved by :func:`rng_state`."""
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank() -> int:
    """This rank (0 in a single process): speculators' topology, set by :func:`draftpipe.stages.draft.ranks.init_ranks`."""
    from speculators.train.distributed import get_rank

    return get_rank()


def _world_size() -> int:
    """The number of ranks (1 in a single process), from speculators' topology."""
    from speculators.train.distributed import get_world_size

    return get_world_size()


def _add_metrics(sums: dict, metrics: dict) -> dict:
    """Add one batch's metric tensors (scalars) into ``sums``, in float32; returns ``sums``."""
    for key, v in metrics.items():
        v = v.detach().float().reshape(())
        sums[key] = v if key not in sums else sums[key] + v
    return sums


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_fsdp(model) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _trainer_class():
    import contextlib
    import time

    import torch
    from speculators.train import trainer as trainer_module
    from speculators.train.checkpointer import SingleGPUCheckpointer, convert_float_dtype, patch_config_dtype
    from speculators.train.trainer import MIN_STEP_PCT, Trainer, _all_reduce_metrics, metric_logger
    from speculators.train.utils import normalize_counted_metrics
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.nn.parallel import DistributedDataParallel

    if torch.accelerator.current_accelerator() is None:
        # speculators' step timer calls torch.accelerator.synchronize(), which raises without an accelerator;
        # on CPU there is nothing to synchronize, so its marks are plain timestamps.
        base_timer = trainer_module._StepTimer

        class _CpuStepTimer(base_timer):
            def mark(self, name):
                if self.enabled:
                    self._marks[name] = time.perf_counter()

            def now(self):
                return time.perf_counter() if self.enabled else None

        trainer_module._StepTimer = _CpuStepTimer

    class ExactCheckpointer(SingleGPUCheckpointer):
        """speculators' single-process checkpointer reading the exact state of :data:`TRAINING_STATE` (its own
        files hold the weights and optimizer moments in bfloat16, which a resumed run cannot continue exactly) and
        counting only complete checkpoints (:func:`latest_checkpoint`)."""

        def __init__(self, path):
            if _rank() == 0:
                for removed in clean_work_dir(path):
                    log.info("removed %s (interrupted save, incomplete or superseded checkpoint)", removed)
            _barrier()
            super().__init__(path)
            self.state = None
            found = latest_checkpoint(self.path)
            self.prev_path = None if found is None else found[1]
            if self.prev_path is not None:
                self.state = torch.load(self.prev_path / TRAINING_STATE, map_location="cpu", weights_only=True)
                if self.state.get("format") != STATE_FORMAT or self.state.get("epoch") != self.previous_epoch:
                    raise ValueError(
                        f"{self.prev_path / TRAINING_STATE}: not a {STATE_FORMAT} state of epoch {self.previous_epoch}"
                    )

        def _get_previous_epoch(self) -> int:
            found = latest_checkpoint(self.path)
            return -1 if found is None else found[0]

        def load_model_state_dict(self, model, float_dtype=None):
            """Restore the weights and buffers of the checkpoint exactly (frozen verifier parameters, not saved,
            are those the model was built with)."""
            if _is_fsdp(model):  # every rank loads the full state into its shards
                missing, unexpected = set_model_state_dict(
                    model, self.state["model"], options=StateDictOptions(full_state_dict=True, strict=False)
                )
            else:
                missing, unexpected = model.load_state_dict(self.state["model"], strict=False)
            frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
            saved, saved_frozen = set(self.state["model"]), set(self.state["frozen"])
            if (
                unexpected
                or not set(missing) <= frozen
                or saved_frozen != frozen
                or saved | saved_frozen != set(model.state_dict())
            ):
                raise ValueError(
                    f"{self.prev_path / TRAINING_STATE} does not fit the draft: missing {missing}, "
                    f"unexpected {unexpected}"
                )

        def load_optimizer_state_dict(self, model, optimizer, float_dtype=None):
            """Restore the optimizer states (moments and step counts) exactly. They are saved keyed by parameter
            name, unsharded (``torch.distributed.checkpoint.state_dict``), so a checkpoint of one layout (one rank,
            DDP, FSDP, any world size) resumes in another."""
            optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            saved = self.state["optimizers"]
            if isinstance(saved, list):  # per-optimizer state dicts of single-process checkpoints before ranks
                for opt, sd in zip(optimizers, saved, strict=True):
                    opt.load_state_dict(sd)
                return
            for opt in optimizers:  # the saved groups carry the scheduler's initial_lr; the loader maps keys from
                for group in opt.param_groups:  # the fresh optimizer's groups, so give them one too
                    group.setdefault("initial_lr", group["lr"])
            set_optimizer_state_dict(
                model, optimizers, saved, options=StateDictOptions(full_state_dict=_is_fsdp(model))
            )

        def load_scheduler_state_dict(self, scheduler):
            """Restore the learning-rate schedulers and the learning rate they set."""
            schedulers = scheduler if isinstance(scheduler, (list, tuple)) else [scheduler]
            for sched, sd in zip(schedulers, self.state["schedulers"], strict=True):
                sched.load_state_dict(sd)
                for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr(), strict=True):
                    group["lr"] = lr

        def load_best_val_loss(self):
            """Not tracked: the draft exported is the last epoch's."""
            return None

    class ResumableTrainer(Trainer):
        """speculators' Trainer, placed on the CPU when the machine has no accelerator (it assumes ``cuda:rank``),
        that saves an exact, atomically written checkpoint after each epoch and resumes from the last one, and
        whose steps are made of ``batches_per_step`` packed batches shared by the ranks (:mod:`draftpipe.stages.draft.ranks`):
        its own :meth:`train_epoch` and :meth:`val_epoch` replace speculators' one-batch-per-rank loop, which
        ties the global batch to the world size. Model set-up (DDP), optimizers and schedulers are speculators'."""

        def setup_trainer(self):
            """Place the trainer, then find the last complete checkpoint (speculators' setup reads the epoch and
            global step to continue from through :meth:`_load_training_state`)."""
            if torch.accelerator.current_accelerator() is None:
                self.local_rank = torch.device("cpu")
                self.device_type = "cpu"
            self.checkpointer = ExactCheckpointer(self.config.save_path)
            self.metric_records: list[dict] = []
            super().setup_trainer()

        def _load_training_state(self) -> dict:
            state = self.checkpointer.state
            return {
                "epoch": state["epoch"],
                "local_step": state.get("local_step", 0),
                "global_step": state["global_step"],
            }

        def maybe_save_checkpoint(self, epoch, local_step: int = 0):
            """speculators' train loop calls this every ``1/checkpoints_per_epoch`` of an epoch: save a mid-epoch
            checkpoint (the end of an epoch is saved by :meth:`run_training`, after validation)."""
            if isinstance(epoch, int) and local_step > 0:
                self.save_epoch_checkpoint(epoch, local_step)

        def save_epoch_checkpoint(self, epoch: int, local_step: int = 0) -> Path:
            """Write a checkpoint atomically, at the end of an epoch (``local_step`` 0) or after ``local_step``
            steps of it; remove the previous one."""
            root = self.checkpointer.path
            final = root / checkpoint_name(epoch, local_step)
            rank_rng = _gather_objects(rng_state())  # every rank's random state (a collective: all ranks save)
            model = self._bare_model()
            if _is_fsdp(model):  # gather the full states on rank 0 (collectives: every rank takes part)
                full = StateDictOptions(full_state_dict=True, cpu_offload=True)
                state_dict = get_model_state_dict(model, options=full)
                optimizer_states = get_optimizer_state_dict(model, self.optimizers, options=full)
            else:  # replicated: rank 0's states are every rank's
                state_dict = model.state_dict() if _rank() == 0 else None
                optimizer_states = get_optimizer_state_dict(self.model, self.optimizers) if _rank() == 0 else None
            if _rank() != 0:
                _barrier()
                return final
            with atomic_dir(final) as tmp:
                # frozen parameters (the verifier's lm_head and norm, the embeddings unless trained) are rebuilt
                # from the verifier on resume; everything else is saved in full precision
                frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
                model.save_pretrained(tmp, state_dict=convert_float_dtype(state_dict, torch.bfloat16))
                patch_config_dtype(tmp / "config.json", torch.bfloat16)
                torch.save(
                    {
                        "format": STATE_FORMAT,
                        "epoch": epoch,
                        "local_step": local_step,
                        "global_step": self.global_step,
                        "model": {k: v.detach().cpu() for k, v in state_dict.items() if k not in frozen},
                        "frozen": sorted(frozen),
                        "optimizers": optimizer_states,
                        "schedulers": [sched.state_dict() for sched in self.schedulers],
                        "rng": rank_rng[0],
                        "rank_rng": rank_rng,
                        # mid-epoch: the records of the epoch so far too
                        "metrics": self.metric_records + list(self._collector.records),
                    },
                    tmp / TRAINING_STATE,
                )
            clean_work_dir(root)
            _barrier()
            log.info("saved epoch %d%s checkpoint %s", epoch, f" step {local_step}" if local_step else "", final)
            return final

        def _bare_model(self):
            return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

        def _to_device(self, batch):
            return {
                k: v.to(self.local_rank, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()
            }

        def _reduce(self, sums: dict) -> dict:
            """Sum the metric tensors over the ranks; ``x_sum / x_total`` pairs become ``x``."""
            if self.is_distributed:
                sums = _all_reduce_metrics(sums)
            return normalize_counted_metrics({k: float(v) for k, v in sums.items()}, 1)

        def train_epoch(self, epoch: int):
            """One epoch of steps, each the mean gradient of the step's ``batches_per_step`` packed batches
            (this rank's share, gradients accumulated, then averaged over the ranks by DDP), clipped to norm 1,
            then the optimizer and scheduler steps. A resumed epoch starts after the steps already trained."""
            self.model.train()
            sampler = self.train_loader.batch_sampler
            sampler.set_epoch(epoch)
            steps, k = sampler.steps, sampler.per_rank
            skip = self._resume_local_step if epoch == self.current_epoch else 0
            self._resume_local_step = 0
            sampler.skip = skip
            if skip:
                log.info("epoch %d: skipping the %d steps already trained", epoch, skip)
            interval = max(1, round(steps * self.config.checkpoint_freq)) if self.config.checkpoint_freq < 1 else None
            batches = iter(self.train_loader)
            call_kw = self.config.train_call_kwargs or {}
            # progress for a person, from rank 0: steps of this epoch, their rate, the ETA, the step's loss
            what = f"draft epoch {epoch + 1}/{self.config.num_epochs}"
            bar = Progress(what, steps - skip, "steps") if _rank() == 0 and steps > skip else None
            for local_step in range(skip + 1, steps + 1):
                self._optimizers_zero_grad()
                sums: dict = {}
                for i in range(k):
                    batch = next(batches)
                    sync = contextlib.nullcontext()
                    if self.is_distributed and isinstance(self.model, DistributedDataParallel) and i < k - 1:
                        sync = self.model.no_sync()  # gradients are averaged over the ranks after the last batch
                    elif _is_fsdp(self.model):
                        self.model.set_requires_gradient_sync(i == k - 1)
                    with sync:
                        with torch.autocast(self.device_type, dtype=self.config.hidden_states_dtype):
                            _, loss, metrics = self.model(**self._to_device(batch), **call_kw)
                        check_finite_loss(float(loss.detach()), epoch, local_step, i)
                        (loss if k == 1 else loss / k).backward()
                    metrics["error_records_sum"] = torch.tensor(float(batch["error_records"]), device=loss.device)
                    metrics["error_records_total"] = torch.tensor(1.0, device=loss.device)
                    _add_metrics(sums, metrics)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                lr = self.optimizers[0].param_groups[0]["lr"]
                self._optimizers_step()
                self._schedulers_step()
                train = self._reduce(sums)
                metric_logger.info(
                    {"train": train, "epoch": epoch, "lr": lr, "global_step": self.global_step},
                    extra={"step": self.global_step},
                )
                if bar is not None:
                    bar.update(1, extra=f"loss {train['loss']:.4f}" if "loss" in train else "")
                self.global_step += 1
                if (
                    interval is not None
                    and local_step % interval == 0
                    and steps - local_step >= interval * MIN_STEP_PCT
                ):
                    self.maybe_save_checkpoint(epoch, local_step=local_step)

        @torch.no_grad()
        def val_epoch(self, epoch: int):
            """Validation metrics over every packed validation batch (each rank its share, summed over ranks)."""
            self.model.eval()
            sampler = self.val_loader.batch_sampler
            sampler.set_epoch(epoch)
            call_kw = self.config.val_call_kwargs or {}
            sums: dict = {}
            for batch in self.val_loader:
                with torch.autocast(self.device_type, dtype=self.config.hidden_states_dtype):
                    _, _, metrics = self.model(**self._to_device(batch), **call_kw)
                _add_metrics(sums, metrics)
            if self.is_distributed:
                # ranks without a validation batch still join the reduction, with zeros for every metric
                keys = _gather_objects(sorted(sums))
                names = sorted({n for ks in keys for n in ks})
                sums = {n: sums.get(n, torch.zeros((), device=self.local_rank)) for n in names}
            val = {f"{key}_epoch": v for key, v in self._reduce(sums).items()}
            metric_logger.info({"val": val, "epoch": epoch}, extra={"step": self.global_step})
            return val

        def run_training(self):
            """Train the epochs after the last checkpoint (all of them on a fresh work directory)."""
            ckpt = self.checkpointer
            n_epochs = self.config.num_epochs
            if ckpt.state is not None:
                ranks = ckpt.state.get("rank_rng") or [ckpt.state["rng"]]
                set_rng_state(ranks[_rank()] if len(ranks) == _world_size() else ranks[0])
                self.metric_records = list(ckpt.state["metrics"])
                step = ckpt.state.get("local_step", 0)
                log.info(
                    "resuming from epoch %d%s checkpoint %s (global step %d, %d of %d epochs left)",
                    ckpt.previous_epoch,
                    f" step {step}" if step else "",
                    ckpt.prev_path,
                    self.global_step,
                    n_epochs - self.current_epoch,
                    n_epochs,
                )
            else:
                log.info("no checkpoint in %s; training %d epochs from the start", ckpt.path, n_epochs)
            collector = self._collector = _MetricsCollector()
            metric_logger = logging.getLogger("speculators.metrics")
            metric_logger.addHandler(collector)
            metric_logger.setLevel(logging.INFO)
            try:
                for epoch in range(self.current_epoch, n_epochs):
                    self.train_epoch(epoch)
                    if self.val_loader is not None:
                        self.val_epoch(epoch)
                    self.metric_records.extend(collector.take())
                    self.save_epoch_checkpoint(epoch)
            finally:
                metric_logger.removeHandler(collector)

    return ResumableTrainer


class _MetricsCollector(logging.Handler):
    """Collects the dicts speculators' trainer logs to ``speculators.metrics``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[dict] = []

    def emit(self, record):
        if isinstance(record.msg, dict):
            # the per-step timing profile is left out: it differs between runs and is not a training metric
            self.records.append({k: v for k, v in record.msg.items() if k != "profile"})

    def take(self) -> list[dict]:
        """The records collected since the last call."""
        out, self.records = self.records, []
        return out


def epoch_metrics(records: list[dict]) -> list[dict]:
    """Per-epoch rows from the trainer's logged metrics: means of the step metrics (``train_*``) and the
    validation metrics (``val_*``): loss, per-TTT-position loss ``loss_i``, full accuracy ``full_acc_i`` (the
    draft's token at position i is right and all before it were right) and conditional accuracy ``cond_acc_i``."""
    rows: dict[int, dict] = {}
    counts: dict[int, int] = {}
    for rec in records:
        epoch = int(rec.get("epoch", 0))
        row = rows.setdefault(epoch, {"epoch": epoch})
        if "train" in rec:
            counts[epoch] = counts.get(epoch, 0) + 1
            for k, v in rec["train"].items():
                row[f"train_{k}"] = row.get(f"train_{k}", 0.0) + float(v)
        if "val" in rec:
            for k, v in rec["val"].items():
                row[f"val_{k.removesuffix('_epoch')}"] = float(v)
    out = []
    for epoch in sorted(rows):
        row = rows[epoch]
        n = counts.get(epoch, 0)
        for k in list(row):
            if k.startswith("train_") and n:
                row[k] /= n
        row["train_steps"] = n
        out.append(row)
    return out


def build_draft(
    verifier_dir: str, aux_ids: list[int], d2t, t2d, draft_vocab_size: int, s: DraftSettings, attn_impl: str
):
    """Build an untrained ``Eagle3DraftModel`` for the verifier (speculators' ``from_training_args``).

    Raises:
        ValueError: from speculators when the aux ids, head_dim or vocab maps do not fit the verifier.
    """
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(s.seed)
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=verifier_dir,
        num_layers=s.num_layers,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=s.sliding_window or 0,
        full_attention_indices=[] if s.sliding_window else list(range(s.num_layers)),
    )
    if s.head_dim:
        layer_cfg.head_dim = s.head_dim
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg,
        t2d=t2d,
        d2t=d2t,
        target_layer_ids=list(aux_ids),
        verifier_name_or_path=verifier_dir,
        draft_attn_impl=attn_impl,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=s.norm_before_residual,
        norm_before_fc=s.norm_before_fc,
        norm_output=s.norm_output,
        ttt_steps=s.ttt_steps,
    )


def attention_implementation(on_gpu: bool) -> str:
    """The draft's ``attn_implementation`` in training: speculators' ``simple_flex_attention`` on an accelerator
    (its block mask skips the masked blocks), :mod:`draftpipe.stages.draft.attention`'s packed TTT attention on a CPU (the same
    values as ``sdpa`` over only the columns that attend: a training step on 2 CPU cores about 3x faster, see
    ``benchmarks/draft_step.py``)."""
    if on_gpu:
        return "simple_flex_attention"
    return attention.register()


def train_draft(
    verifier_dir: str,
    shards: list[str],
    vocab_maps: str,
    work_dir: str,
    s: DraftSettings,
    checkpoints_per_epoch: int = 1,
    ranks: int = 1,
    threads: int | None = None,
    fsdp: bool = False,
    nodes: int = 1,
) -> tuple[Path, list[dict]]:
    """Train the draft; return the directory of the final epoch's checkpoint and the per-epoch metrics.

    Training state lives in ``work_dir``: one exact checkpoint, ``<epoch>/`` at the end of an epoch or
    ``<epoch>-step<k>/`` after ``k`` steps of it (see the module docstring). ``checkpoints_per_epoch`` > 1 also saves
    every ``1/checkpoints_per_epoch`` of an epoch (speculators' ``checkpoint_freq``), for long epochs; it does not
    change the result. A rerun with the same ``work_dir`` resumes there (the batches of an epoch are a function of
    the seed and the epoch, so the data position is the step), logging ``resuming from epoch N [step K] checkpoint
    <dir>``, and ends with the same weights as an uninterrupted run.

    ``ranks`` > 1 trains with that many ranks under torchrun on this node, ``nodes`` > 1 with ``ranks`` on each
    node of a SLURM job (``srun`` + a torchrun rendezvous) (DDP; NCCL on GPUs, gloo on CPUs; each rank
    ``threads // ranks`` threads); the ranks share each step's ``s.batches_per_step`` packed batches, so the
    draft is the one-rank draft up to floating-point reduction order (:mod:`draftpipe.stages.draft.ranks`). Only rank 0 writes.
    Called under torchrun (``LOCAL_RANK`` set), it trains as one of the ranks. ``fsdp`` shards the draft, its
    gradients and optimizer states over the ranks (speculators' ``fully_shard`` of each decoder layer and of the
    model) instead of replicating it (DDP), for drafts that do not fit one device; checkpoints still hold the full
    states, gathered on rank 0.

    Raises:
        ShardError: a shard is truncated or corrupt. ValueError: inconsistent shards (aux ids, hidden size), or
        ``ranks`` does not divide ``s.batches_per_step``. RuntimeError: a rank failed.
    """
    import torch

    world = max(1, ranks) * max(1, nodes)
    check_batches_per_step(s.batches_per_step, world)  # before any rank starts
    if world > 1 and "LOCAL_RANK" not in os.environ:
        from dataclasses import asdict

        Path(work_dir).mkdir(parents=True, exist_ok=True)
        launch(
            ranks,
            {
                "entry": f"{__name__}:train_rank",
                "verifier_dir": str(verifier_dir),
                "shards": [str(p) for p in shards],
                "vocab_maps": str(vocab_maps),
                "work_dir": str(work_dir),
                "s": asdict(s),
                "checkpoints_per_epoch": checkpoints_per_epoch,
                "fsdp": fsdp,
            },
            Path(str(work_dir) + ".launch.json"),
            threads,
            nodes,
        )
        final = Path(work_dir) / str(s.epochs - 1)
        state = torch.load(final / TRAINING_STATE, map_location="cpu", weights_only=True)
        return final, epoch_metrics(state["metrics"])
    distributed = init_ranks()
    try:
        return _train_here(verifier_dir, shards, vocab_maps, work_dir, s, checkpoints_per_epoch, fsdp and distributed)
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def train_rank(spec: dict) -> None:
    """One torchrun rank of :func:`train_draft` (the ``entry`` of its launch spec, :func:`draftpipe.stages.draft.ranks.main`):
    ``spec`` holds train_draft's arguments, the settings ``s`` as a dict."""
    train_draft(**{**spec, "s": DraftSettings(**spec["s"])})


def _train_here(
    verifier_dir, shards, vocab_maps, work_dir, s: DraftSettings, checkpoints_per_epoch: int, fsdp: bool = False
):
    """:func:`train_draft` in this process (one rank, or one of several under torchrun)."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.trainer import TrainerConfig
    from torch.utils.data import DataLoader

    metas = [read_shard_metadata(p) for p in shards]
    aux_ids = metas[0]["aux_layer_ids"]
    for p, m in zip(shards, metas):
        if m["aux_layer_ids"] != aux_ids:
            raise ValueError(f"{p}: aux layer ids {m['aux_layer_ids']} differ from {shards[0]}'s {aux_ids}")
    common_template([(p, m.get("chat_template_sha256")) for p, m in zip(shards, metas)])
    d2t, t2d, vd = read_maps(vocab_maps)
    on_gpu = torch.accelerator.current_accelerator() is not None
    attn = attention_implementation(on_gpu)
    loss_impl = "fused" if on_gpu else "eager"
    model = build_draft(verifier_dir, aux_ids, d2t, t2d, vd, s, attn)
    hidden_size = model.config.transformer_layer_config.hidden_size
    # speculators trains under bfloat16 autocast (right on GPUs). On a CPU, bfloat16 matmuls without native support
    # (AVX2-only x86, e.g. AMD EPYC before Zen 4) run about 70x slower than float32 (0.58 against 43 GFLOPS on one
    # core, measured on a 2-core AMD EPYC with AVX2), so the CPU trains in float32 (autocast off: torch warns that CPU autocast
    # supports only bfloat16 and float16). Like the attention and loss kernels above, the device shapes the draft.
    hs_dtype = torch.bfloat16 if on_gpu else torch.float32
    Dataset = _dataset_class()
    train_ds = Dataset(shards, s.total_seq_len, "train", s.val_every, hs_dtype)
    val_ds = Dataset(shards, s.total_seq_len, "val", s.val_every, hs_dtype)
    rank, size = _rank(), _world_size()
    if rank == 0:
        for split, ds in (("train", train_ds), ("validation", val_ds)):
            print(accounting_line(split, ds.accounting, s.total_seq_len), flush=True)

    def loader(ds):
        # speculators' collation; the batches of each step from StepBatchSampler (speculators' multipack packing)
        sampler = StepBatchSampler(ds.approx_lengths, s.total_seq_len, s.batches_per_step, rank, size, s.seed)
        return DataLoader(
            ds,
            batch_sampler=sampler,
            num_workers=0,
            pin_memory=on_gpu,
            collate_fn=CollateFn(
                s.total_seq_len, hidden_size, num_target_layers=len(aux_ids), dtype=hs_dtype, preprocess=shift_batch
            ),
        )

    train_loader = loader(train_ds)
    val_loader = loader(val_ds) if len(val_ds) else None
    call_kw = {
        "ttt_steps": s.ttt_steps,
        "ttt_step_loss_decay": s.ttt_step_loss_decay,
        "loss_config": resolve_loss_config(s.loss_fn, loss_impl),
    }
    cfg = TrainerConfig(
        lr=s.lr,
        num_epochs=s.epochs,
        save_path=str(work_dir),
        resume_from_checkpoint=True,
        train_call_kwargs=call_kw,
        val_call_kwargs=call_kw,
        scheduler_type=s.scheduler_type,
        # the schedule counts optimizer steps, not this rank's packed batches
        scheduler_total_steps=s.epochs * train_loader.batch_sampler.steps,
        hidden_states_dtype=hs_dtype,
        fsdp_shard=fsdp,
        checkpoint_freq=1 if checkpoints_per_epoch <= 1 else 1 / checkpoints_per_epoch,
    )
    trainer = _trainer_class()(model, cfg, train_loader, val_loader)
    trainer.run_training()
    return Path(work_dir) / str(s.epochs - 1), epoch_metrics(trainer.metric_records)


def finalize_config(config: dict, aux_ids: list[int], verifier: str) -> dict:
    """Write the aux ids where each vLLM runner reads them and record the verifier in the speculators config.

    - top-level ``eagle_aux_hidden_state_layer_ids``: copied by vLLM's ``update_eagle3`` and read by the V1 runner
      (``gpu_model_runner.py``) and the V2 runner (``eagle3_utils.py``) to choose the captured layers;
    - ``transformer_layer_config.eagle_config.eagle_aux_hidden_state_layer_ids``: read by ``Eagle3LlamaForCausalLM``
      for the ``fc`` width (otherwise 3, vLLM issue #54526).
    """
    config = json.loads(json.dumps(config))
    config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    layer = config.setdefault("transformer_layer_config", {})
    eagle = dict(layer.get("eagle_config") or {})
    eagle["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    layer["eagle_config"] = eagle
    config.setdefault("speculators_config", {}).setdefault("verifier", {})["name_or_path"] = verifier
    return config


def export_draft(checkpoint_dir: Path, out_model: str, out_config: str, aux_ids: list[int], verifier: str) -> None:
    """Copy a trained checkpoint's weights and its finalized config to the draft artifacts, atomically."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    with atomic_path(out_model) as tmp:
        shutil.copyfile(checkpoint_dir / "model.safetensors", tmp)
    write_json(out_config, finalize_config(config, aux_ids, verifier))


def training_summary(metrics_csv: str | os.PathLike) -> str:
    """One line for a person about a trained draft, from its ``metrics.csv``: epochs, the last epoch's train and
    validation loss (``train_loss``, ``val_loss``: sums over the TTT steps) and steps; ``no epoch`` for an empty
    file."""
    import pandas as pd

    try:
        frame = pd.read_csv(metrics_csv)
    except pd.errors.EmptyDataError:
        return "no epoch trained"
    if frame.empty:
        return "no epoch trained"
    last = frame.iloc[-1]
    parts = [f"{len(frame)} epoch(s)"]
    for key, name in [("train_loss", "train loss"), ("val_loss", "val loss")]:
        if key in frame:
            parts.append(f"{name} {float(last[key]):.4f}")
    if "train_steps" in frame:
        parts.append(f"{int(frame['train_steps'].sum())} steps")
    return ", ".join(parts)


def metrics_frame(rows: list[dict]):
    """The per-epoch metrics as a pandas DataFrame (one row per epoch)."""
    import pandas as pd

    return pd.DataFrame(rows)


def settings_from_params(params: dict[str, Any]) -> DraftSettings:
    """``DraftSettings`` from the rule's ``params.draft`` mapping (unknown keys go to ``extra``)."""
    known = {f for f in DraftSettings.__dataclass_fields__ if f != "extra"}
    return DraftSettings(
        **{k: v for k, v in params.items() if k in known}, extra={k: v for k, v in params.items() if k not in known}
    )

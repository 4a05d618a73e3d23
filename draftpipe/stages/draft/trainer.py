"""speculators' trainer and checkpointer made exact and resumable (:class:`ResumableTrainer`,
:class:`ExactCheckpointer`): one module per concern, like speculators' ``train/trainer.py`` and
``train/checkpointer.py``."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from speculators.train.checkpointer import SingleGPUCheckpointer, convert_float_dtype, patch_config_dtype
from speculators.train.distributed import get_rank, get_world_size
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

from draftpipe.core.gates import check_finite_loss
from draftpipe.core.io import atomic_dir
from draftpipe.core.progress import Progress
from draftpipe.stages.draft.checkpoint import (
    STATE_FORMAT,
    TRAINING_STATE,
    best_epoch,
    checkpoint_name,
    clean_work_dir,
    keep_best,
    kept_best,
    latest_checkpoint,
    rng_state,
    set_rng_state,
)
from draftpipe.stages.draft.metrics import epoch_metrics

log = logging.getLogger(__name__)


def current_rank() -> int:
    """This rank (0 in a single process): speculators' topology, set by :func:`draftpipe.stages.draft.ranks.init_ranks`."""
    return get_rank()


def world_size() -> int:
    """The number of ranks (1 in a single process), from speculators' topology."""
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


class ExactCheckpointer(SingleGPUCheckpointer):
    """speculators' single-process checkpointer reading the exact state of :data:`TRAINING_STATE` (its own
    files hold the weights and optimizer moments in bfloat16, which a resumed run cannot continue exactly) and
    counting only complete checkpoints (:func:`latest_checkpoint`)."""

    def __init__(self, path):
        if current_rank() == 0:
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
                f"{self.prev_path / TRAINING_STATE} does not fit the draft: missing {missing}, unexpected {unexpected}"
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
        set_optimizer_state_dict(model, optimizers, saved, options=StateDictOptions(full_state_dict=_is_fsdp(model)))

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


class StepValues:
    """A training step's losses (one per packed batch, this rank's) and metric sums (over the ranks), on their way
    to the host without stalling the device: on an accelerator they are copied into pinned memory behind the
    step's work, and :meth:`read` waits for that copy only, so the trainer reads a step's values once the next
    step is queued (speculators' loop reads its metrics every ``log_freq`` steps for the same reason)."""

    def __init__(self, losses: list[torch.Tensor], sums: dict[str, torch.Tensor], record: dict):
        self.record, self.keys, self.n = record, list(sums), len(losses)
        values = torch.stack([v.float().reshape(()) for v in [*losses, *sums.values()]])
        self.event = None
        if values.device.type == "cpu":
            self.host = values
        else:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.Event(device=values.device)
            self.event.record()

    def read(self) -> tuple[list[float], dict[str, float]]:
        """``(losses, {metric: sum})`` as Python floats, once the device has computed them."""
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()
        return values[: self.n], dict(zip(self.keys, values[self.n :], strict=True))


class ResumableTrainer(Trainer):
    """speculators' Trainer, placed on the CPU when the machine has no accelerator (it assumes ``cuda:rank``),
    that saves an exact, atomically written checkpoint after each epoch and resumes from the last one, and
    whose steps are made of ``batches_per_step`` packed batches shared by the ranks (:mod:`draftpipe.stages.draft.ranks`):
    its own :meth:`train_epoch` and :meth:`val_epoch` replace speculators' one-batch-per-rank loop, which
    ties the global batch to the world size. Model set-up (DDP), optimizers and schedulers are speculators'."""

    #: the loss implementation (:mod:`draftpipe.stages.draft.loss`), logged with each step when set
    loss_impl: str | None = None
    #: keep the weights of the epoch with the lowest validation loss in ``<work_dir>/best/`` (``draft.select:
    #: best_val``: :meth:`keep_best_epoch`)
    keep_best: bool = False

    def setup_trainer(self):
        """Place the trainer, then find the last complete checkpoint (speculators' setup reads the epoch and
        global step to continue from through :meth:`_load_training_state`)."""
        if torch.accelerator.current_accelerator() is None:
            self.local_rank = torch.device("cpu")
            self.device_type = "cpu"
        self.checkpointer = ExactCheckpointer(self.config.save_path)
        self.metric_records: list[dict] = []
        super().setup_trainer()

    @property
    def resume_point(self) -> tuple[int, int]:
        """``(epoch, steps of it already trained)`` where :meth:`run_training` continues (``(0, 0)`` when fresh)."""
        return self.current_epoch, self._resume_local_step

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
            state_dict = model.state_dict() if current_rank() == 0 else None
            optimizer_states = get_optimizer_state_dict(self.model, self.optimizers) if current_rank() == 0 else None
        if current_rank() != 0:
            _barrier()
            return final
        with atomic_dir(final) as tmp:
            # frozen parameters (the verifier's lm_head and norm, the embeddings unless trained) are rebuilt
            # from the verifier on resume; everything else is saved in full precision
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            model.save_pretrained(tmp, state_dict=convert_float_dtype(state_dict, torch.bfloat16))
            patch_config_dtype(tmp / "config.json", torch.bfloat16)
            # through a Python file object: a full disk then raises OSError ENOSPC (draftpipe.core.io.no_room)
            # where torch's own file writer says "basic_ios::clear: iostream error"
            with open(tmp / TRAINING_STATE, "wb") as state_file:
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
                    state_file,
                )
        clean_work_dir(root)
        _barrier()
        log.info("saved epoch %d%s checkpoint %s", epoch, f" step {local_step}" if local_step else "", final)
        return final

    def keep_best_epoch(self) -> None:
        """Rank 0, after an end-of-epoch checkpoint and on resume: when the latest checkpoint ends the epoch with
        the lowest validation loss so far (:func:`draftpipe.stages.draft.checkpoint.best_epoch`, speculators'
        rule) and ``best/`` does not hold it yet, copy its weights there
        (:func:`draftpipe.stages.draft.checkpoint.keep_best`). A later epoch's checkpoint is only written after
        this, so the best epoch's weights are never lost, whenever the process is killed."""
        if current_rank() != 0:
            return
        root = self.checkpointer.path
        found = latest_checkpoint(root)
        if found is None or found[1].name != checkpoint_name(found[0]):
            return  # none yet, or part-way through an epoch: nothing validated since the last end of epoch
        best = best_epoch(epoch_metrics(self.metric_records))
        if best is None or best[0] != found[0] or kept_best(root) == found[0]:
            return
        keep_best(found[1], root, *best)
        log.info("epoch %d has the lowest validation loss so far (%.6f): its weights kept in %s", best[0], best[1],
                 root / "best")  # fmt: skip

    def _bare_model(self):
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def _to_device(self, batch):
        return {
            k: v.to(self.local_rank, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
        }

    def _reduce(self, sums: dict) -> dict:
        """Sum the metric tensors over the ranks; ``x_sum / x_total`` pairs become ``x``."""
        if self.is_distributed:
            sums = _all_reduce_metrics(sums)
        return normalize_counted_metrics({k: float(v) for k, v in sums.items()}, 1)

    def train_epoch(self, epoch: int):
        """One epoch of steps, each the mean gradient of the step's ``batches_per_step`` packed batches
        (this rank's share, gradients accumulated, then averaged over the ranks by DDP), clipped to norm 1,
        then the optimizer and scheduler steps. A resumed epoch starts after the steps already trained.

        The host waits for the device once a step, for the step before (:class:`StepValues`): a non-finite loss
        stops training one step after it was applied, before any checkpoint holds it."""
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
        bar = Progress(what, steps - skip, "steps") if current_rank() == 0 and steps > skip else None
        pending = None
        for local_step in range(skip + 1, steps + 1):
            self._optimizers_zero_grad()
            sums: dict = {}
            losses, errors = [], 0.0
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
                    (loss if k == 1 else loss / k).backward()
                losses.append(loss.detach())
                errors += float(batch["error_records"])
                _add_metrics(sums, metrics)
            sums["error_records_sum"] = torch.tensor(errors, device=loss.device)
            sums["error_records_total"] = torch.tensor(float(k), device=loss.device)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            lr = self.optimizers[0].param_groups[0]["lr"]
            self._optimizers_step()
            self._schedulers_step()
            if pending is not None:  # the step before: the device has this step queued behind it
                self._log_step(pending, bar)
            if self.is_distributed:
                sums = _all_reduce_metrics(sums)
            record = {"epoch": epoch, "lr": lr, "global_step": self.global_step, "local_step": local_step}
            pending = StepValues(losses, sums, record)
            self.global_step += 1
            if interval is not None and local_step % interval == 0 and steps - local_step >= interval * MIN_STEP_PCT:
                self._log_step(pending, bar)  # a checkpoint holds only checked steps
                pending = None
                self.maybe_save_checkpoint(epoch, local_step=local_step)
        if pending is not None:
            self._log_step(pending, bar)

    def _log_step(self, step: StepValues, bar: Progress | None) -> None:
        """Check a trained step's losses (:func:`draftpipe.core.gates.check_finite_loss`) and log its metrics
        (speculators' ``speculators.metrics`` record, the progress bar); waits for the device to reach the end of
        that step only."""
        losses, sums = step.read()
        info = step.record
        for i, value in enumerate(losses):
            check_finite_loss(value, info["epoch"], info["local_step"], i)
        train = normalize_counted_metrics(sums, 1)
        record = {"train": train, "epoch": info["epoch"], "lr": info["lr"], "global_step": info["global_step"]}
        if self.loss_impl:
            record["loss_impl"] = self.loss_impl
        metric_logger.info(record, extra={"step": info["global_step"]})
        if bar is not None:
            bar.update(1, extra=f"loss {train['loss']:.4f}" if "loss" in train else "")

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
            set_rng_state(ranks[current_rank()] if len(ranks) == world_size() else ranks[0])
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
            if self.keep_best:  # a process killed between the last checkpoint and its copy
                self.keep_best_epoch()
        else:
            log.info("no checkpoint in %s; training %d epochs from the start", ckpt.path, n_epochs)
        collector = self._collector = MetricsCollector()
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
                if self.keep_best:
                    self.keep_best_epoch()
        finally:
            metric_logger.removeHandler(collector)


class MetricsCollector(logging.Handler):
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

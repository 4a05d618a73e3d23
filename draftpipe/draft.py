"""EAGLE-3 draft training with speculators 0.9 (its model, data collation, trainer and checkpointer).

Data: the hidden-state shards of :mod:`draftpipe.hidden_states` are read by :class:`ShardDataset`, a
speculators ``BaseDataset``; speculators' ``CollateFn`` packs samples into ``[1, total_seq_len]`` batches and its
``shift_batch`` aligns inputs and targets. Model: ``Eagle3DraftModel.from_training_args`` with the decoder config
that speculators' training CLI builds (``create_transformer_layer_config``), optionally with another ``head_dim``.
Trainer: ``speculators.train.trainer.Trainer``; on machines without an accelerator the draft uses the ``sdpa``
attention and the eager loss (the defaults, flex attention and a Triton loss, need a GPU; tiny-verifier §10).

The exported directory holds ``model.safetensors`` and ``config.json`` in the speculators format (what
``speculators`` saves; vLLM reads it as ``SpeculatorsConfig``), with the aux layer ids written both at the top
level (read by vLLM's V1 and V2 model runners) and in ``transformer_layer_config.eagle_config`` (read by vLLM's
Llama EAGLE-3 model for the width of ``fc``, vLLM issue #54526).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftpipe.hidden_states import iter_shard, read_shard_metadata


@dataclass
class DraftSettings:
    """Every knob that shapes the draft checkpoint (all reach the rule through ``params:``)."""

    num_layers: int = 1
    head_dim: int | None = None
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    epochs: int = 3
    lr: float = 1e-3
    total_seq_len: int = 2048
    seed: int = 0
    val_every: int = 10
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    norm_output: bool = True
    loss_fn: str = "kl_div"
    scheduler_type: str = "linear"
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict)


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
                        self.samples.append({
                            "input_ids": sample["input_ids"].long(),
                            "loss_mask": sample["loss_mask"].long(),
                            "hidden_states": sample["hidden_states"],
                            "verifier_last_hidden_states": sample["verifier_last_hidden_states"],
                        })
            self._torch = torch
            super().__init__(max_len, hidden_states_dtype)

        def _compute_approx_lengths(self):
            return [min(int(s["input_ids"].shape[0]), self.max_len) for s in self.samples]

        def __len__(self):
            return len(self.samples)

        def _get_raw_data(self, index):
            return {k: v.clone() for k, v in self.samples[index].items()}

    return ShardDataset


def _trainer_class():
    import time

    import torch
    from speculators.train import trainer as trainer_module
    from speculators.train.trainer import Trainer

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

    class DeviceAwareTrainer(Trainer):
        """speculators' Trainer, placed on the CPU when the machine has no accelerator (it assumes ``cuda:rank``)."""

        def setup_trainer(self):
            if torch.accelerator.current_accelerator() is None:
                self.local_rank = torch.device("cpu")
                self.device_type = "cpu"
            super().setup_trainer()

    return DeviceAwareTrainer


class _MetricsCollector(logging.Handler):
    """Collects the dicts speculators' trainer logs to ``speculators.metrics``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[dict] = []

    def emit(self, record):
        if isinstance(record.msg, dict):
            self.records.append(record.msg)


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


def build_draft(verifier_dir: str, aux_ids: list[int], d2t, t2d, draft_vocab_size: int, s: DraftSettings, attn_impl: str):
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
        verifier_config=layer_cfg, t2d=t2d, d2t=d2t,
        target_layer_ids=list(aux_ids), verifier_name_or_path=verifier_dir,
        draft_attn_impl=attn_impl, draft_vocab_size=draft_vocab_size,
        norm_before_residual=s.norm_before_residual, norm_before_fc=s.norm_before_fc,
        norm_output=s.norm_output, ttt_steps=s.ttt_steps,
    )


def train_draft(verifier_dir: str, shards: list[str], vocab_maps: str, work_dir: str, s: DraftSettings) -> tuple[Path, list[dict]]:
    """Train the draft; return the directory of the final epoch's checkpoint and the per-epoch metrics.

    Training state lives in ``work_dir`` (speculators' checkpointer layout ``<epoch>/``); a rerun with the same
    ``work_dir`` resumes after the last finished epoch.

    Raises:
        ShardError: a shard is truncated or corrupt. ValueError: inconsistent shards (aux ids, hidden size).
    """
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import TrainerConfig

    from draftpipe.vocab import read_maps

    metas = [read_shard_metadata(p) for p in shards]
    aux_ids = metas[0]["aux_layer_ids"]
    for p, m in zip(shards, metas):
        if m["aux_layer_ids"] != aux_ids:
            raise ValueError(f"{p}: aux layer ids {m['aux_layer_ids']} differ from {shards[0]}'s {aux_ids}")
    d2t, t2d, vd = read_maps(vocab_maps)
    on_gpu = torch.accelerator.current_accelerator() is not None
    attn = "simple_flex_attention" if on_gpu else "sdpa"
    loss_impl = "fused" if on_gpu else "eager"
    model = build_draft(verifier_dir, aux_ids, d2t, t2d, vd, s, attn)
    hidden_size = model.config.transformer_layer_config.hidden_size
    hs_dtype = torch.bfloat16
    Dataset = _dataset_class()
    train_ds = Dataset(shards, s.total_seq_len, "train", s.val_every, hs_dtype)
    val_ds = Dataset(shards, s.total_seq_len, "val", s.val_every, hs_dtype)
    loader_kw = dict(total_seq_len=s.total_seq_len, hidden_size=hidden_size, num_workers=0,
                     num_target_layers=len(aux_ids), prefetch_factor=None, preprocess=shift_batch, seed=s.seed)
    train_loader = _setup_dataloader(train_ds, **loader_kw)
    val_loader = _setup_dataloader(val_ds, **loader_kw) if len(val_ds) else None
    call_kw = {"ttt_steps": s.ttt_steps, "ttt_step_loss_decay": s.ttt_step_loss_decay,
               "loss_config": resolve_loss_config(s.loss_fn, loss_impl)}
    cfg = TrainerConfig(lr=s.lr, num_epochs=s.epochs, save_path=str(work_dir), resume_from_checkpoint=True,
                        train_call_kwargs=call_kw, val_call_kwargs=call_kw, scheduler_type=s.scheduler_type,
                        hidden_states_dtype=hs_dtype)
    metric_logger = logging.getLogger("speculators.metrics")
    collector = _MetricsCollector()
    metric_logger.addHandler(collector)
    metric_logger.setLevel(logging.INFO)
    try:
        trainer = _trainer_class()(model, cfg, train_loader, val_loader)
        trainer.run_training()
    finally:
        metric_logger.removeHandler(collector)
    history = Path(work_dir) / "metrics.jsonl"
    with open(history, "a", encoding="utf-8") as fh:
        for rec in collector.records:
            fh.write(json.dumps(rec) + "\n")
    records = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    return Path(work_dir) / str(s.epochs - 1), epoch_metrics(records)


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
    from draftpipe.io import atomic_path, write_json

    config = json.loads((checkpoint_dir / "config.json").read_text())
    with atomic_path(out_model) as tmp:
        shutil.copyfile(checkpoint_dir / "model.safetensors", tmp)
    write_json(out_config, finalize_config(config, aux_ids, verifier))


def metrics_frame(rows: list[dict]):
    """The per-epoch metrics as a pandas DataFrame (one row per epoch)."""
    import pandas as pd

    return pd.DataFrame(rows)


def settings_from_params(params: dict[str, Any]) -> DraftSettings:
    """``DraftSettings`` from the rule's ``params.draft`` mapping (unknown keys go to ``extra``)."""
    known = {f for f in DraftSettings.__dataclass_fields__ if f != "extra"}
    return DraftSettings(**{k: v for k, v in params.items() if k in known},
                         extra={k: v for k, v in params.items() if k not in known})

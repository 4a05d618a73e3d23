"""The draft's training metrics: per-epoch rows from what the trainer logs, the metrics table and a summary line."""

from __future__ import annotations

import os


def epoch_metrics(records: list[dict]) -> list[dict]:
    """Per-epoch rows from the trainer's logged metrics: means of the step metrics (``train_*``) and the
    validation metrics (``val_*``): loss, per-TTT-position loss ``loss_i``, full accuracy ``full_acc_i`` (the
    draft's token at position i is right and all before it were right) and conditional accuracy ``cond_acc_i``;
    ``loss_impl``, the loss implementation the steps trained with (:mod:`draftpipe.stages.draft.loss`), when
    logged."""
    rows: dict[int, dict] = {}
    counts: dict[int, int] = {}
    for rec in records:
        epoch = int(rec.get("epoch", 0))
        row = rows.setdefault(epoch, {"epoch": epoch})
        if "train" in rec:
            counts[epoch] = counts.get(epoch, 0) + 1
            for k, v in rec["train"].items():
                row[f"train_{k}"] = row.get(f"train_{k}", 0.0) + float(v)
        if rec.get("loss_impl"):  # the loss implementation of the epoch's steps (a resumed epoch: its last)
            row["loss_impl"] = rec["loss_impl"]
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


def training_summary(metrics_csv: str | os.PathLike) -> str:
    """One line for a person about a trained draft, from its ``metrics.csv``: epochs, the last epoch's train and
    validation loss (``train_loss``, ``val_loss``: sums over the TTT steps), steps and the loss implementation
    (a fallback to the eager loss said in words); ``no epoch`` for an empty file."""
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
    if "loss_impl" in frame:
        impls = sorted(set(frame["loss_impl"].dropna().astype(str)))
        if "eager-fallback" in impls:
            parts.append("eager loss: the fused Triton kernels failed their check (see the log)")
        elif impls:
            parts.append(f"{'/'.join(impls)} loss")
    return ", ".join(parts)


def metrics_frame(rows: list[dict]):
    """The per-epoch metrics as a pandas DataFrame (one row per epoch)."""
    import pandas as pd

    return pd.DataFrame(rows)

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


def mark_exported(rows: list[dict], epoch: int, why: str) -> list[dict]:
    """``rows`` with the column ``exported``: ``why`` the draft exports this epoch (``last``, ``best_val`` or
    ``last: no validation samples``: :func:`draftpipe.stages.draft.checkpoint.selected_checkpoint`) on its row,
    empty on the others."""
    return [{**row, "exported": why if int(row["epoch"]) == epoch else ""} for row in rows]


def exported_row(rows: list[dict]) -> tuple[dict, str]:
    """The exported epoch's row among ``metrics.csv``'s rows (one dict per epoch, empty cells None or NaN), and why
    it was chosen: the row marked in ``exported`` (:func:`mark_exported`), else the last row (a draft trained
    before the column existed: ``last``)."""
    marked = [row for row in rows if isinstance(row.get("exported"), str) and row["exported"]]
    return (marked[-1], marked[-1]["exported"]) if marked else (rows[-1], "last")


def _val_loss(row: dict) -> float | None:
    value = row.get("val_loss")
    return None if value is None or value != value else float(value)  # NaN: an empty cell


def selection_line(rows: list[dict]) -> str:
    """Which epoch the draft exports and why, for a person (the training summary, the benchmark report, the model
    card): its number of the epochs trained, the rule (``draft.select``), and the lowest validation loss when that
    is another epoch's."""
    row, why = exported_row(rows)
    epoch, n = int(row["epoch"]) + 1, len(rows)
    if why == "best_val":
        text = f"exported epoch {epoch} of {n}: the lowest validation loss (draft.select: best_val)"
        last = _val_loss(rows[-1])
        return text + (f"; the last epoch's is {last:.4f}" if epoch < n and last is not None else "")
    if why != "last":  # best_val without validation samples
        return f"exported epoch {epoch} of {n}, the last: draft.select: best_val found no validation samples"
    text = f"exported epoch {epoch} of {n}, the last (draft.select: last)"
    scored = [(loss, int(r["epoch"])) for r in rows if (loss := _val_loss(r)) is not None]
    if scored:
        loss, best = min(scored)
        if best + 1 != epoch:
            text += f"; epoch {best + 1} had the lowest validation loss, {loss:.4f} (draft.select: best_val exports it)"
    return text


def training_summary(metrics_csv: str | os.PathLike) -> str:
    """One line for a person about a trained draft, from its ``metrics.csv``: epochs, the exported epoch's train
    and validation loss (``train_loss``, ``val_loss``: sums over the TTT steps) and why it was chosen
    (:func:`selection_line`), steps and the loss implementation (a fallback to the eager loss said in words);
    ``no epoch`` for an empty file."""
    import pandas as pd

    try:
        frame = pd.read_csv(metrics_csv)
    except pd.errors.EmptyDataError:
        return "no epoch trained"
    if frame.empty:
        return "no epoch trained"
    rows = frame.to_dict("records")
    row, _ = exported_row(rows)
    parts = [f"{len(frame)} epoch(s)"]
    for key, name in [("train_loss", "train loss"), ("val_loss", "val loss")]:
        if key in frame:
            parts.append(f"{name} {float(row[key]):.4f}")
    parts.append(selection_line(rows))
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

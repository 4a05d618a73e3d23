"""Exact training checkpoints in a work directory: their names, the last complete one, the clean-up of interrupted
saves, the weights of the best epoch kept beside them (``draft.select: best_val``), and the random states a resume
restores (see :mod:`draftpipe.stages.draft.trainer`)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from pathlib import Path

from draftpipe.core.io import atomic_dir

#: The file of a checkpoint directory that holds the exact training state (see the module docstring).

TRAINING_STATE = "training_state.pt"


STATE_FORMAT = "draftpipe.draft_training_state.v1"

#: The directory of a work directory that holds the weights of the epoch with the lowest validation loss so far
#: (``draft.select: best_val``): the end-of-epoch checkpoint's ``model.safetensors`` and ``config.json``, and
#: :data:`BEST_RECORD`. Not a checkpoint: :func:`clean_work_dir` leaves it.
BEST = "best"

#: The file of :data:`BEST` naming its epoch and validation loss (``{"epoch": int, "val_loss": float}``).
BEST_RECORD = "best.json"


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


def best_epoch(rows: list[dict]) -> tuple[int, float] | None:
    """``(epoch, val_loss)`` of the epoch with the lowest validation loss among per-epoch rows
    (:func:`draftpipe.stages.draft.metrics.epoch_metrics`), or None when no row has one (no validation samples).

    speculators' rule (``Trainer.maybe_update_best``): an epoch replaces the best only when its ``val_loss`` is
    strictly lower, so of equal losses the earliest epoch is kept. Non-finite losses never count (training stops
    on one: :func:`draftpipe.core.gates.check_finite_loss`)."""
    best = None
    for row in sorted(rows, key=lambda r: int(r["epoch"])):
        loss = row.get("val_loss")
        if loss is None or not math.isfinite(float(loss)):
            continue
        if best is None or float(loss) < best[1]:
            best = (int(row["epoch"]), float(loss))
    return best


def kept_best(work_dir: str | os.PathLike) -> int | None:
    """The epoch whose weights :data:`BEST` holds in a work directory, or None (none kept, or its record is
    unreadable: the directory is written atomically, so that only happens to a directory changed by hand)."""
    try:
        record = json.loads((Path(work_dir) / BEST / BEST_RECORD).read_text())
        return int(record["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_best(checkpoint_dir: Path, work_dir: str | os.PathLike, epoch: int, val_loss: float) -> Path:
    """Copy an end-of-epoch checkpoint's exported files (``model.safetensors``, ``config.json``: bfloat16, what the
    draft exports) to ``<work_dir>/best/`` with its :data:`BEST_RECORD`, atomically
    (:func:`draftpipe.core.io.atomic_dir`: a process killed during the copy leaves the previous best or none, and a
    resume copies it again from the checkpoint, which is the latest while this epoch is the best). Returns the
    directory."""
    dest = Path(work_dir) / BEST
    with atomic_dir(dest) as tmp:
        for name in ("model.safetensors", "config.json"):
            shutil.copyfile(checkpoint_dir / name, tmp / name)
        (tmp / BEST_RECORD).write_text(json.dumps({"epoch": epoch, "val_loss": val_loss}) + "\n")
    return dest


#: ``draft.select``: which epoch's weights the draft exports
SELECT_CHOICES = ("last", "best_val")

#: what :func:`selected_checkpoint` says when ``best_val`` has no validation loss to go by
NO_VALIDATION = "last: no validation samples"


def selected_checkpoint(
    work_dir: str | os.PathLike, epochs: int, rows: list[dict], select: str
) -> tuple[Path, int, str]:
    """The checkpoint directory whose weights the draft exports after training ``epochs`` epochs, its epoch, and
    why (the metrics' ``exported`` column): ``last``, ``best_val`` (the epoch with the lowest validation loss,
    :func:`best_epoch`, kept in :data:`BEST` unless it is the last) or :data:`NO_VALIDATION`.

    Raises:
        ValueError: ``select`` is not one of :data:`SELECT_CHOICES`.
        RuntimeError: the best epoch is not the last and :data:`BEST` does not hold it (a work directory changed by
            hand, or trained without ``best_val``).
    """
    if select not in SELECT_CHOICES:
        raise ValueError(f"draft.select: {select!r} is not one of {', '.join(SELECT_CHOICES)}")
    root, last = Path(work_dir), epochs - 1
    if select == "last":
        return root / checkpoint_name(last), last, "last"
    best = best_epoch(rows)
    if best is None:
        return root / checkpoint_name(last), last, NO_VALIDATION
    if best[0] == last:
        return root / checkpoint_name(last), last, "best_val"
    if kept_best(root) != best[0]:
        raise RuntimeError(
            f"draft.select: best_val: epoch {best[0]} has the lowest validation loss, but {root / BEST} does not "
            "hold its weights; remove the training directory to train again"
        )
    return root / BEST, best[0], "best_val"


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

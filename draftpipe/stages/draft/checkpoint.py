"""Exact training checkpoints in a work directory: their names, the last complete one, the clean-up of interrupted
saves, and the random states a resume restores (see :mod:`draftpipe.stages.draft.trainer`)."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
from pathlib import Path

#: The file of a checkpoint directory that holds the exact training state (see the module docstring).

TRAINING_STATE = "training_state.pt"


STATE_FORMAT = "draftpipe.draft_training_state.v1"


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

"""A real dataset built with ``datasets`` and laid out as the Hugging Face Hub cache lays out a downloaded dataset
repository (``datasets--ORG--NAME/{blobs,refs,snapshots}``, files in ``blobs/`` named by content, linked from the
commit's snapshot), so that the product reads it through the code path of a Hub download, offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def hub_dataset(cache: Path, repo_id: str, rows: list[dict], *, ref: str = "main", split: str = "train") -> str:
    """Write ``rows`` as the ``split`` of dataset ``repo_id`` at a new commit in the Hub cache ``cache``
    (``HF_HUB_CACHE``), the branch ``ref`` pointing at it; returns the commit (40 hex digits, from the content).

    The data file is ``data/<split>-00000-of-00001.parquet`` (written by ``datasets.Dataset.to_parquet``), the
    layout ``datasets`` infers splits from; a second call adds another commit and moves ``ref`` to it."""
    import datasets

    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    tmp = repo / "tmp.parquet"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp))
    blob = hashlib.sha256(tmp.read_bytes()).hexdigest()
    commit = hashlib.sha1(f"{repo_id} {split} {blob}".encode()).hexdigest()
    (repo / "blobs").mkdir(exist_ok=True)
    os.replace(tmp, repo / "blobs" / blob)
    link = repo / "snapshots" / commit / "data" / f"{split}-00000-of-00001.parquet"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


def offline_hub(monkeypatch, root: Path) -> Path:
    """Point the Hub and ``datasets`` caches at ``root`` and go offline (``HF_HUB_OFFLINE=1``); returns the Hub
    cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(root / "datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root / "hub"

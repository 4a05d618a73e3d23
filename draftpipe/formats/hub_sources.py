"""Prompt sources on the Hugging Face Hub: ``prompts.sources[i].dataset`` names a dataset repository (``ORG/NAME``)
or a shortcut of :data:`SHORTCUTS`, read with the ``datasets`` library.

How a source is read (:func:`dataset_rows_file`):

1. The revision (``revision``, default ``main``) is resolved to its commit (:func:`resolve_dataset`): on line by
   the Hub's API (``HfApi.dataset_info``), with ``HF_HUB_OFFLINE=1`` (or when the Hub cannot be reached) from the
   Hub cache's ``refs/<revision>`` (``HF_HUB_CACHE``, where ``hf download`` puts a repository); a commit
   (40 hex digits) names itself, with no request.
2. The first ``max_records`` rows of the split (all rows without it) are streamed by ``datasets.load_dataset(...,
   streaming=True)``: from the Hub at that commit, so a cap on a million-row set does not download it all, or, when
   the Hub cache holds the commit's snapshot (offline it must), the same call on the snapshot's folder (offline,
   ``datasets`` reads only its own cache for a dataset id, never the Hub cache: ``datasets/load.py``,
   ``CachedDatasetModuleFactory``).
3. The rows are kept as JSON lines under ``<HF_DATASETS_CACHE>/draftpipe/`` (keyed by repository, commit, config,
   split and cap), so the next read of the same commit reads that file, not the Hub.

What a record holds is read from those lines exactly as from a local ``.jsonl`` source
(:mod:`draftpipe.formats.prompts`). The prompt set's fingerprint is its records' content
(:mod:`draftpipe.workflow.fingerprint`): a new revision reruns the prompt shards whose records it changes, and
nothing else. Messages name a row as ``hf://datasets/ORG/NAME@<commit>/<config>/<split>: row N``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from draftpipe.core.io import atomic_path
from draftpipe.core.layout import ml_python

#: dataset shortcuts, each the settings of a source entry: the sets speculators 0.9.0 names in its data generation
#: presets (``speculators/data_generation/configs.py``, ``DATASET_CONFIGS``: repository, config, split, prompt
#: field) that draftpipe reads as they are (conversations, ``messages``, or a prompt field)
SHORTCUTS: dict[str, dict] = {
    "sharegpt": {"dataset": "Aeala/ShareGPT_Vicuna_unfiltered", "split": "train"},
    "ultrachat": {"dataset": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"},
    "gsm8k": {"dataset": "openai/gsm8k", "name": "main", "split": "train", "field": "question", "ignore": ["answer"]},
    "magpie": {"dataset": "Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", "split": "train"},
    "open-perfectblend": {"dataset": "mlabonne/open-perfectblend", "split": "train"},
}

#: seconds the Hub's API may take to name a revision's commit
API_TIMEOUT = 20

#: a Hub repository id, ``ORG/NAME`` (datasets and models alike)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubSourceError(ValueError):
    """A Hub prompt source cannot be resolved or read; the message names the source and what to do."""


@dataclass(frozen=True)
class HubDataset:
    """A Hub prompt source resolved to a commit.

    ``repo_id``: ``ORG/NAME``; ``name``: the dataset's config (None: its default); ``split``; ``revision``: as the
    source asks (branch, tag or commit); ``sha``: the commit it resolved to; ``snapshot``: the cached snapshot folder
    read offline (None: streamed from the Hub)."""

    repo_id: str
    name: str | None
    split: str
    revision: str
    sha: str
    snapshot: str | None = None

    @property
    def label(self) -> str:
        """How records and messages name the source: ``hf://datasets/ORG/NAME@<commit 12>/[<config>/]<split>``."""
        config = f"{self.name}/" if self.name else ""
        return f"hf://datasets/{self.repo_id}@{self.sha[:12]}/{config}{self.split}"


def with_shortcut(src: dict) -> dict:
    """A source entry with its shortcut's settings filled in (the entry's own keys win); an entry naming a
    repository (``ORG/NAME``) or a file is returned as it is."""
    short = SHORTCUTS.get(src.get("dataset") or "")
    return {**short, **{k: v for k, v in src.items() if k != "dataset"}} if short else dict(src)


def check_dataset_id(dataset: str, field: str) -> None:
    """Refuse a ``dataset`` that is neither ``ORG/NAME`` nor a shortcut.

    Raises:
        HubSourceError: naming ``field`` and the shortcuts."""
    if dataset not in SHORTCUTS and not REPO_ID.match(dataset):
        raise HubSourceError(
            f"{field}: {dataset!r} is neither a Hub dataset id (ORG/NAME) nor a shortcut "
            f"({', '.join(sorted(SHORTCUTS))})"
        )


def hub_cache() -> Path:
    """The Hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), read per call."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def rows_cache() -> Path:
    """Where the rows read from the Hub are kept: ``<HF_DATASETS_CACHE>/draftpipe`` (``datasets``' own cache,
    ``HF_HOME/datasets`` by default)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser() / "draftpipe"
    return hub_cache().parent / "datasets" / "draftpipe"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` set to a true value (huggingface_hub's own reading of it), read per call."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cached_commit(repo_id: str, revision: str) -> str | None:
    """The commit ``revision`` names in the Hub cache (``datasets--ORG--NAME/refs/<revision>``, or the revision itself
    when it is a commit with a cached snapshot), or None when the cache does not hold it."""
    repo = hub_cache() / f"datasets--{repo_id.replace('/', '--')}"
    if _COMMIT.match(revision):
        return revision if (repo / "snapshots" / revision).is_dir() else None
    ref = repo / "refs" / revision
    if ref.is_file():
        sha = ref.read_text().strip()
        return sha if (repo / "snapshots" / sha).is_dir() else None
    return None


def resolve_dataset(src: dict, field: str) -> HubDataset:
    """Resolve a source entry (``dataset``, optional ``name``, ``split`` (default ``train``) and ``revision``
    (default ``main``); a shortcut's settings filled in) to the commit its rows are read at.

    On line the Hub's API names the commit; offline (``HF_HUB_OFFLINE=1``), or when the API cannot be reached, the
    Hub cache does, and the rows are then read from the cached snapshot.

    Raises:
        HubSourceError: an unknown repository or revision, a gated or private repository without a token, or no
            network and no cached copy; the message names ``field`` and what to do.
    """
    if offline():  # the cache's refs, read again each time
        return _resolve(with_shortcut(src), field)
    key = json.dumps([src, str(hub_cache()), os.environ.get("HF_ENDPOINT")], sort_keys=True, default=str)
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve(with_shortcut(src), field)
    return _RESOLVED[key]


#: the sources this process resolved on line (the plan and the fingerprints read the same source): one API call each
_RESOLVED: dict[str, HubDataset] = {}


def _resolve(src: dict, field: str) -> HubDataset:
    repo_id, revision = src["dataset"], src.get("revision") or "main"
    check_dataset_id(repo_id, f"{field}.dataset")
    name, split = src.get("name"), src.get("split") or "train"
    if _COMMIT.match(revision):  # a commit names itself: no request
        snapshot = _snapshot(repo_id, revision)
        if snapshot.is_dir() or not offline():
            return HubDataset(repo_id, name, split, revision, revision, str(snapshot) if snapshot.is_dir() else None)
    why, fix = "HF_HUB_OFFLINE is set", " or unset HF_HUB_OFFLINE"
    if not offline():
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        try:
            api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
            # a timeout: the client's default is none, and a Hub that accepts the connection but never answers
            # would hang the workflow's parse
            sha = api.dataset_info(repo_id, revision=revision, timeout=API_TIMEOUT).sha
            snapshot = _snapshot(repo_id, sha)  # a commit downloaded before is read from the cache
            return HubDataset(repo_id, name, split, revision, sha, str(snapshot) if snapshot.is_dir() else None)
        except GatedRepoError as exc:
            raise HubSourceError(
                f"{field}.dataset: {repo_id} is gated: accept its terms on the Hub and log in (`hf auth login`) "
                f"({exc.__class__.__name__})"
            ) from None
        except RevisionNotFoundError:
            raise HubSourceError(f"{field}.revision: {revision!r} is no branch, tag or commit of {repo_id}") from None
        except RepositoryNotFoundError:
            raise HubSourceError(
                f"{field}.dataset: no dataset {repo_id} on the Hub (or it is private: log in with `hf auth login`)"
            ) from None
        except Exception as exc:  # no network: httpx's and the OS's errors share no base class worth naming
            why, fix = f"the Hub cannot be reached ({exc.__class__.__name__}: {str(exc)[:200]})", ""
    sha = cached_commit(repo_id, revision)
    if sha is None:
        raise HubSourceError(
            f"{field}.dataset: {repo_id} (revision {revision}) is not in the Hub cache {hub_cache()} and {why}: "
            f"download it once on line (`hf download {repo_id} --repo-type dataset`){fix}"
        )
    return HubDataset(repo_id, name, split, revision, sha, str(_snapshot(repo_id, sha)))


def _snapshot(repo_id: str, sha: str) -> Path:
    """The Hub cache's folder of a commit of a dataset repository (it may not exist)."""
    return hub_cache() / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / sha


def dataset_rows_file(src: dict, field: str) -> tuple[HubDataset, Path]:
    """The rows of a Hub source as a JSON Lines file, one row per line (row N on line N), read once per commit.

    Args:
        src: the source entry (``dataset`` and its settings, ``max_records`` the rows read).
        field: how messages name the entry (``prompts.sources[0]``).

    Returns:
        ``(the resolved dataset, the file)``; the file is kept under :func:`rows_cache` for the next read.

    Raises:
        HubSourceError: what :func:`resolve_dataset` raises, an unknown config or split, or rows ``datasets``
            cannot read (the message names the source and the library's reason).
    """
    ds = resolve_dataset(src, field)
    cap = src.get("max_records")
    key = f"{ds.repo_id.replace('/', '--')}/{ds.sha}/{ds.name or 'default'}/{ds.split}.{cap or 'all'}.jsonl"
    rows = rows_cache() / key
    if rows.is_file():
        return ds, rows
    if importlib.util.find_spec("datasets") is None:
        # the orchestration environment (Snakemake on a login node) has no `datasets`: the ML environment streams
        args = [json.dumps(asdict(ds)), str(cap or 0), str(rows), field]
        proc = subprocess.run(
            [ml_python(), "-m", "draftpipe.formats.hub_sources", *args], capture_output=True, text=True, check=False
        )
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
            raise HubSourceError(lines[-1].removeprefix("HubSourceError: "))
    else:
        stream_rows(ds, cap, rows, field)
    return ds, rows


def stream_rows(ds: HubDataset, cap: int | None, rows: Path, field: str) -> None:
    """Stream the first ``cap`` rows (all for None) of a resolved dataset into the JSON Lines file ``rows``
    (written whole or not at all).

    Raises:
        HubSourceError: ``datasets`` cannot read the config or split (its reason named)."""
    import datasets  # lazy: a workflow without Hub sources never imports it

    try:
        stream = datasets.load_dataset(
            ds.snapshot or ds.repo_id,
            ds.name,
            split=ds.split,
            revision=None if ds.snapshot else ds.sha,
            streaming=True,
        )
        with atomic_path(rows) as tmp, open(tmp, "w", encoding="utf-8") as out:
            for row in itertools.islice(stream, cap):
                out.write(json.dumps(_plain(row), ensure_ascii=False, default=str) + "\n")
    except Exception as exc:  # datasets' errors (ValueError, FileNotFoundError, DatasetNotFoundError, ...)
        raise HubSourceError(
            f"{field}: {ds.label} cannot be read ({exc.__class__.__name__}: {str(exc)[:400]})"
        ) from None


def _plain(value):
    """A row's value as JSON: numpy arrays and scalars as lists and numbers, nested structures kept."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


if __name__ == "__main__":  # python -m draftpipe.formats.hub_sources DATASET_JSON CAP ROWS FIELD (dataset_rows_file)
    _ds, _cap, _rows, _field = sys.argv[1:5]
    try:
        stream_rows(HubDataset(**json.loads(_ds)), int(_cap) or None, Path(_rows), _field)
    except HubSourceError as _exc:
        sys.exit(f"HubSourceError: {_exc}")

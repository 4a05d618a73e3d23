"""Integrity of a results tree: every artifact against its provenance manifest, and damaged hidden-state shards
kept out of training.

:func:`verify_tree` checks a results directory against its manifests (``python -m draftpipe.checks.verify``): artifacts
whose bytes no longer match (``CORRUPT``), artifacts built from inputs that have changed since (``STALE``),
hidden-state shards that fail :func:`draftpipe.formats.hidden_states.validate_shard` (``CORRUPT``), and artifacts without a
manifest (``NOTE``). :func:`require_sound_shards` quarantines damaged shards, and the stage-store entries they
link, before the draft trains on them. :func:`damaged_artifacts` is what every run asks before it plans: which
artifacts no longer hold the bytes their manifests record, reading only files whose stat changed.

This is the policy layer above the formats (manifests in :mod:`draftpipe.formats.provenance`, shards in
:mod:`draftpipe.formats.hidden_states`) and the results layout (:mod:`draftpipe.core.layout`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from draftpipe.core.io import load_json, read_cache, sha256_file, write_cache
from draftpipe.core.layout import QUARANTINE, STORE
from draftpipe.formats.hidden_states import ShardError, check_shards_cached, validate_shard
from draftpipe.formats.provenance import (
    SUFFIX,
    UNTRACKED_DIRS,
    _tree_sha256,
    digest_problem,
    digest_record_path,
    manifest_path,
    quarantine,
)

CORRUPT, STALE, NOTE = "CORRUPT", "STALE", "NOTE"


@dataclass(frozen=True)
class TreeFinding:
    """One result of :func:`verify_tree`: ``status`` is ``CORRUPT``, ``STALE`` or ``NOTE``; ``path`` the artifact
    (joined onto the results directory as given); ``reason`` one line."""

    status: str
    path: str
    reason: str

    def line(self) -> str:
        """``STATUS path: reason``."""
        return f"{self.status} {self.path}: {self.reason}"


class _Hasher:
    """sha256 of files by their current bytes, each file read at most once per instance."""

    def __init__(self):
        self._cache: dict[str, tuple[int, int, str]] = {}

    def __call__(self, path: Path) -> str:
        key = os.path.realpath(path)
        st = path.stat()
        hit = self._cache.get(key)
        if hit is not None and hit[:2] == (st.st_size, st.st_mtime_ns):
            return hit[2]
        sha = _tree_sha256(path) if path.is_dir() else sha256_file(path)
        self._cache[key] = (st.st_size, st.st_mtime_ns, sha)
        return sha


def _short(sha: str | None) -> str:
    return (sha or "none")[:12]


def _walk(results: Path) -> tuple[list[Path], list[Path]]:
    """Artifacts and manifests of a results tree, sorted; skips hidden entries (temporary files, ``.train``,
    :data:`QUARANTINE`) and :data:`UNTRACKED_DIRS` at the top. A directory with a manifest beside it is one
    artifact (``directory()`` outputs) and is not descended into."""
    artifacts, manifests = [], []
    for root, dirs, files in os.walk(results):
        top = Path(root) == results
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (top and d in UNTRACKED_DIRS))
        for d in [d for d in dirs if f"{d}{SUFFIX}" in files]:
            artifacts.append(Path(root) / d)
            dirs.remove(d)
        for f in files:
            if f.startswith(".") or (top and f == "README.md"):
                continue
            (manifests if f.endswith(SUFFIX) else artifacts).append(Path(root) / f)
    return sorted(artifacts), sorted(manifests)


def _changed_inputs(inputs: list[dict], base: Path, sha: _Hasher) -> list[str]:
    """What changed of an artifact's recorded inputs (``{"path", "sha256"}``, relative paths against ``base``):
    ``input <path> is missing`` or ``input <path> changed (sha256 ...)``."""
    changed = []
    for rec in inputs:
        rel = rec.get("path")
        if not rel or rec.get("sha256") is None:
            continue
        p = Path(rel) if os.path.isabs(rel) else base / rel
        if not p.exists():
            changed.append(f"input {rel} is missing")
            continue
        now = sha(p)
        if now != rec["sha256"]:
            changed.append(f"input {rel} changed (sha256 {_short(now)}... != recorded {_short(rec['sha256'])}...)")
    return changed


def verify_tree(
    results_dir: str | os.PathLike = "results", *, workdir: str | os.PathLike | None = None, check_shards: bool = True
) -> list[TreeFinding]:
    """Check every artifact of a results tree against its manifest.

    For each artifact (every file except manifests, hidden files and directories, ``logs/`` and
    ``benchmarks/``): no manifest gives ``NOTE``; an unreadable manifest, a size or sha256 different from the
    manifest's, or (with ``check_shards``) a ``hidden_states/*.safetensors`` that fails
    :func:`draftpipe.formats.hidden_states.validate_shard` gives ``CORRUPT``; an input whose sha256 now differs from the
    one recorded, or that no longer exists, gives ``STALE`` naming the input. A manifest without its artifact
    gives ``NOTE``. Every file is hashed from its bytes, once. The stage stores' entries are checked too
    (:func:`store_findings`): the tree is never clean while a stored entry differs from its record.

    Args:
        results_dir: the results directory.
        workdir: the directory that relative input paths in manifests are relative to (the workflow's working
            directory); default the parent of ``results_dir``.
        check_shards: run the full shard validation (reads every tensor).

    Returns:
        Findings sorted by path, at most one ``CORRUPT`` and one ``STALE`` per artifact.
    """
    results = Path(results_dir)
    base = Path(workdir) if workdir is not None else results.resolve().parent
    artifacts, manifests = _walk(results)
    sha = _Hasher()
    findings: list[TreeFinding] = []
    for art in artifacts:
        shown = str(art)
        corrupt: list[str] = []
        man = None
        mpath = manifest_path(art)
        if not mpath.exists():
            findings.append(TreeFinding(NOTE, shown, "no manifest"))
        else:
            try:
                man = load_json(mpath.read_text(encoding="utf-8"))
                recorded = man["artifact"]
                inputs = list(man.get("inputs") or [])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                corrupt.append(f"manifest {mpath.name} unreadable ({exc})")
                man = None
        if man is not None:
            size = art.stat().st_size
            if recorded.get("kind") != "directory" and size != recorded.get("size"):
                corrupt.append(f"size {size} != manifest {recorded.get('size')}")
            else:
                got = sha(art)
                if got != recorded.get("sha256"):
                    corrupt.append(f"sha256 {_short(got)}... != manifest {_short(recorded.get('sha256'))}...")
        if check_shards and art.parent.name == "hidden_states" and art.suffix == ".safetensors":
            try:
                validate_shard(str(art))
            except ShardError as exc:
                corrupt.append(f"invalid shard: {str(exc).removeprefix(f'{art}: ')}")
        if corrupt:
            findings.append(TreeFinding(CORRUPT, shown, "; ".join(corrupt)))
        changed = _changed_inputs(inputs, base, sha) if man is not None else []
        if changed:
            findings.append(TreeFinding(STALE, shown, "; ".join(changed)))
    for mpath in manifests:
        art = Path(str(mpath)[: -len(SUFFIX)])
        if not art.exists():
            findings.append(TreeFinding(NOTE, str(art), f"manifest {mpath.name} without its artifact"))
    findings += store_findings(results)
    order = {CORRUPT: 0, STALE: 1, NOTE: 2}
    return sorted(findings, key=lambda f: (f.path, order.get(f.status, 3)))


def store_entries(results_dir: str | os.PathLike) -> list[Path]:
    """The entry files of a results tree's stage stores (``<results>/.store/<stage>/<entry>`` and the files of
    directory entries ``<results>/.store/<stage>/<key>/<file>``), sorted; hidden names (locks, digest records,
    temporary files) are not entries."""
    out = []
    store = Path(results_dir) / STORE
    for stage in sorted(store.iterdir()) if store.is_dir() else []:
        if not stage.is_dir() or stage.name.startswith("."):
            continue
        for p in sorted(stage.iterdir()):
            if p.name.startswith("."):
                continue
            out += sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")) if p.is_dir() else [p]
    return out


def store_findings(results_dir: str | os.PathLike) -> list[TreeFinding]:
    """Every stage-store entry against its digest record (:func:`draftpipe.formats.provenance.digest_problem`, every byte
    hashed): ``CORRUPT`` when it differs, ``NOTE`` when it has no record (stored before records existed)."""
    findings = []
    for entry in store_entries(results_dir):
        if not digest_record_path(entry).exists():
            findings.append(TreeFinding(NOTE, str(entry), "store entry without a digest record"))
        elif (reason := digest_problem(entry, full=True)) is not None:
            findings.append(TreeFinding(CORRUPT, str(entry), f"store entry: {reason}"))
    return findings


def require_sound_shards(paths: list[str], results_dir: str | os.PathLike, cache_file: str | os.PathLike) -> None:
    """Refuse to train on a damaged shard: run the full check (:func:`draftpipe.formats.hidden_states.check_shards_cached` with ``full``) and move
    every shard that fails into ``<results_dir>/.quarantine/`` (:func:`draftpipe.formats.provenance.quarantine`), together
    with the stage-store entry it links (``<results_dir>/.store/hidden_states/``, the same file), so that the next
    run computes it again instead of linking the damaged data.

    Raises:
        ShardError: naming each damaged shard, why, and where it was moved; the next ``snakemake`` run rebuilds
            them (they are missing inputs of the job that failed).
    """
    bad = check_shards_cached(paths, cache_file, full=True)
    if not bad:
        return
    store = Path(results_dir) / STORE / "hidden_states"
    entries = list(store.glob("*.safetensors")) if store.is_dir() else []
    for path in bad:
        st = os.stat(path)
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                est = entry.stat()
                if (est.st_ino, est.st_dev) == (st.st_ino, st.st_dev):
                    entry.unlink()
                    digest_record_path(entry).unlink(missing_ok=True)
    moved = {str(src): dest for src, dest in quarantine(sorted(bad), results_dir)}
    lines = [f"{path}: {reason}; moved to {moved.get(str(Path(path)), '?')}" for path, reason in sorted(bad.items())]
    raise ShardError(
        f"{len(bad)} damaged hidden-state shard(s), not trained on:\n"
        + "\n".join(lines)
        + "\nrun snakemake again: it rebuilds them"
    )


def repaired_pending(results_dir: str | os.PathLike = "results") -> dict[str, list[str]]:
    """Artifacts that ``--repair`` (:func:`draftpipe.formats.provenance.quarantine`) moved aside and no run has
    rebuilt yet, with the artifacts built from them: ``{missing path: [dependent artifact, ...]}``.

    Snakemake does not rerun anything for a missing intermediate file whose dependents are up to date ("Nothing to
    be done"), so the workflow forces these paths (``rules/common.smk``). A path counts while it is missing from the
    results tree, a copy of it lies in ``<results>/.quarantine/<stamp>/`` (stage-store entries, under hidden
    folders, are not artifacts), and an artifact's manifest names it as an input and finished before it was
    quarantined: once the dependents are rebuilt, or when the user removes a rebuilt file later, nothing is forced.
    Reads nothing but the quarantine folder while it holds no missing artifact (the usual case).

    Args:
        results_dir: the results directory; manifests' input paths are taken relative to its parent.

    Returns:
        Paths as manifests name them (``results/hidden_states/train_00001.safetensors``), sorted, each with its
        dependents.
    """
    results = Path(results_dir).resolve()
    base = results.parent
    moved: dict[str, float] = {}
    quarantined = results / QUARANTINE
    for stamp in sorted(quarantined.iterdir()) if quarantined.is_dir() else []:
        for f in stamp.rglob("*"):
            rel = f.relative_to(stamp)
            if not f.is_file() or f.name.endswith(SUFFIX) or any(p.startswith(".") for p in rel.parts):
                continue
            path = results / rel
            if not path.exists():
                key = str(path.relative_to(base))
                moved[key] = max(moved.get(key, 0.0), f.stat().st_ctime)
    if not moved:
        return {}
    pending: dict[str, list[str]] = {}
    for mpath in _walk(results)[1]:
        try:
            man = load_json(mpath.read_text(encoding="utf-8"))
            finished = datetime.fromisoformat(man["finished_at"]).timestamp()
            inputs = [rec["path"] for rec in man.get("inputs") or [] if isinstance(rec.get("path"), str)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        for rel in inputs:
            key = os.path.relpath(rel, base) if os.path.isabs(rel) else os.path.normpath(rel)
            if key in moved and finished < moved[key]:
                pending.setdefault(key, []).append(str(mpath.relative_to(base))[: -len(SUFFIX)])
    return {k: sorted(v) for k, v in sorted(pending.items())}


def _stat_sign(st: os.stat_result, sha: str) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, sha]


def damaged_artifacts(results_dir: str | os.PathLike, cache_file: str | os.PathLike | None) -> dict[str, str]:
    """Artifacts of a results tree whose bytes are not those their manifest records: ``{path: reason}``.

    A file is read only when its stat changed: an artifact whose size, ``mtime_ns``, ``ctime_ns`` and inode are
    those remembered in ``cache_file`` for its manifest's sha256 (or, the first time it is seen with that manifest,
    whose size, ``mtime_ns`` and inode are those the manifest records: as its job left it) is taken as unchanged.
    Any write changes ``ctime``, which no user tool can set back, so a byte changed in place is always read; a
    copy, a move or a new hard link is read once (and remembered when its bytes are the recorded ones). Directory artifacts, artifacts without a
    manifest and missing ones are left out (Snakemake or :func:`verify_tree` deal with those).

    Args:
        results_dir: the results directory (paths are returned joined onto it as given).
        cache_file: where the stat of each checked artifact is remembered (:func:`draftpipe.core.io.read_cache`);
            None reads every artifact whose stat differs from its manifest, every time.

    Returns:
        ``{path: reason}`` sorted by path, the reason one line (``size 1000 != manifest 4096``, ``sha256
        0123456789ab... != manifest ba9876543210...``, ``manifest <name> unreadable (...)``).
    """
    results = Path(results_dir)
    cache = read_cache(cache_file) if cache_file is not None else {}
    damaged: dict[str, str] = {}
    changed = False
    for art in _walk(results)[0]:
        mpath = manifest_path(art)
        if art.is_dir() or not mpath.exists():
            continue
        try:
            st = art.stat()
        except FileNotFoundError:
            continue
        try:
            rec = load_json(mpath.read_text(encoding="utf-8"))["artifact"]
            sha, size = rec["sha256"], rec["size"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            damaged[str(art)] = f"manifest {mpath.name} unreadable ({exc})"
            continue
        key, hit = str(art), cache.get(str(art))
        if hit == _stat_sign(st, sha):
            continue
        fresh = not isinstance(hit, list) or len(hit) != 5 or hit[4] != sha  # first seen with this manifest
        if fresh and [st.st_size, st.st_mtime_ns, st.st_ino] == [size, rec.get("mtime_ns"), rec.get("inode")]:
            cache[key], changed = _stat_sign(st, sha), True  # as its job left it
            continue
        if st.st_size != size:
            damaged[key] = f"size {st.st_size} != manifest {size}"
            continue
        got = sha256_file(art)
        if got != sha:
            damaged[key] = f"sha256 {_short(got)}... != manifest {_short(sha)}..."
            continue
        cache[key], changed = _stat_sign(st, sha), True
    if changed and cache_file is not None:
        write_cache(cache_file, cache)
    return dict(sorted(damaged.items()))


def unrebuilt_damaged(found: dict[str, str], record_file: str | os.PathLike) -> dict[str, str]:
    """Artifacts an earlier run found damaged (:func:`damaged_artifacts`) whose rebuild did not finish:
    ``{path: reason}``.

    A run forces what it finds damaged; Snakemake removes the output before its job runs, so when that job fails (a
    full disk, a kill, Ctrl-C) the next run sees a missing intermediate file whose dependents are up to date and,
    alone, reruns nothing ("Nothing to be done"). ``record_file`` remembers each damaged path with its reason;
    a path stays pending while it is missing, and is forgotten once it exists again (its job finished: a file that
    is damaged again is found again by its stat). Damaged paths found this run (``found``) are recorded, not
    returned.

    Args:
        found: this run's :func:`damaged_artifacts`.
        record_file: a JSON cache file (:func:`draftpipe.core.io.read_cache`; a write that fails, a read-only tree,
            forgets nothing this run forces).

    Returns:
        the recorded paths, not in ``found``, that are missing, sorted.
    """
    record = read_cache(record_file)
    pending = {p: str(r) for p, r in sorted(record.items()) if p not in found and not os.path.lexists(p)}
    keep = {**pending, **found}
    if keep != record:
        write_cache(record_file, keep)
    return pending


def damage_to_rebuild(
    results_dir: str | os.PathLike, cache_file: str | os.PathLike | None, record_file: str | os.PathLike
) -> tuple[dict[str, str], list[str]]:
    """What a run forces for damage: the artifacts damaged now (:func:`damaged_artifacts`) and those whose rebuild
    an earlier run started and did not finish (:func:`unrebuilt_damaged`), ``{path: reason}``, with a line for each
    to print (``draftpipe: <path> is damaged (<reason>); rebuilding it and what is built from it``)."""
    found = damaged_artifacts(results_dir, cache_file)
    earlier = unrebuilt_damaged(found, record_file)
    lines = [
        f"draftpipe: {path} is damaged ({why}); rebuilding it and what is built from it" for path, why in found.items()
    ]
    lines += [
        f"draftpipe: {path} was found damaged ({why}) and its rebuild did not finish; rebuilding it and what is built "
        "from it"
        for path, why in earlier.items()
    ]
    return {**found, **earlier}, lines

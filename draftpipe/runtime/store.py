"""One verifier load per stage, with per-shard jobs: a content-addressed store filled by the first job of a stage.

A verifier of 1T parameters takes many minutes to load. The `completions` and `hidden_states` stages keep one
Snakemake job per shard (so a dry run lists exactly the stale shards, and each shard is its own artifact), but the
first of those jobs to run loads the verifier once and fills every shard of the stage that is stale and ready:

- Each shard's result is stored under a *content key*: the SHA-256 of its input files' bytes, the job's params
  (minus the list of the stage's shards) and the job script, which is what Snakemake tracks for the job (it
  tracks the script, not the modules it imports: a change to the package reruns nothing by itself). The
  store is ``<results>/.store/<stage>/<shard>.<key>.<ext>``; the shard's declared output is a hard link to its
  entry (a copy where the file system has no hard links).
- A job takes the stage lock, lists the shards whose inputs exist and whose entry is missing, computes them with
  one verifier load (none when nothing is missing), then links its own output. The next jobs of the stage find
  their entries and only link.
- The key changes exactly when what Snakemake tracks for the job changes (params, input content, script), so a
  shard that Snakemake does not plan keeps its entry; a shard that it plans finds its entry missing, unless only
  the script's mtime changed (``touch``), in which case it links the unchanged result without loading anything.
  To recompute with the same inputs, params and script (a new package version), remove the stage's store
  directory (``results/.store/<stage>/``) and force the stage (``--forcerun <rule>``).
- Entries are written atomically, so a crash loses only the shard being computed; entries of finished shards
  survive the crash and the rerun links them. When a shard's output is relinked, entries of that shard that no
  output links any longer are removed, so the store holds no more than one result per shard beyond a run.
- Damage never spreads: a finished entry is made read-only and its SHA-256 recorded beside it
  (:func:`draftpipe.formats.provenance.record_digest`); before a job links an entry it checks the entry against the record
  (hashing it only when its inode, size, mtime or ctime changed), and a damaged entry is quarantined and computed
  again, never linked. A shard's output is a hard link to its entry (shards are the large artifacts: a copy would
  double the disk), so damage to the output is damage to the entry, and the next job that links it recomputes it;
  the draft's outputs (:func:`run_stored`) are copies, so its entry survives damage to them and comes back
  without training again. ``python -m draftpipe.checks.verify`` checks every entry against its record.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftpipe.core.io import cached_sha256s, sha256_file
from draftpipe.core.layout import SOURCE_ROOT, STORE, shard_ids  # noqa: F401  (STORE: the store directory of every stage)
from draftpipe.formats.provenance import (
    DIGEST_SUFFIX,
    digest_problem,
    digest_record_path,
    jsonable,
    quarantine,
    record_digest,
)


@dataclass
class ShardTask:
    """One shard of a stage: its inputs, its declared output and, once keyed, its store entry."""

    shard: str
    inputs: list[str]
    output: str
    key: str | None = None
    entry: Path | None = None
    extra: dict = field(default_factory=dict)


def sibling(path: str, shard: str, other: str) -> str:
    """``path`` of shard ``shard`` rewritten for shard ``other`` (the shard id appears once, as ``_<id>.``).

    Raises:
        ValueError: ``path`` does not contain ``_<shard>.`` exactly once.
    """
    token = f"_{shard}."
    if Path(path).name.count(token) != 1:
        raise ValueError(f"{path}: expected the shard id {shard!r} once in the file name")
    parent, name = os.path.split(path)
    return os.path.join(parent, name.replace(token, f"_{other}."))


def package_sources(root: str | os.PathLike = SOURCE_ROOT / "draftpipe") -> list[Path]:
    """The package's Python sources (``draftpipe/**/*.py``, without the shipped data), sorted by path."""
    root = Path(root)
    return sorted(p for p in root.rglob("*.py") if "data" not in p.relative_to(root).parts)


def code_digest(paths: list[str | os.PathLike], package: str | os.PathLike | None = None) -> str:
    """SHA-256 over the bytes of the files that compute a stage (its job script).

    Args:
        paths: the stage's job script (and any other file whose bytes shape its result).
        package: also hash the Python sources of this package directory (:func:`package_sources`, each with its
            path relative to the package): the draft's key, so that after draftpipe itself changed (an upgrade) a
            forced rerun trains afresh instead of copying the stored draft back. The shard stages leave it out: a
            package change would otherwise recompute every stored shard at the next run of any one of them.
    """
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    if package is not None:
        for src in package_sources(package):
            h.update(str(src.relative_to(package)).encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def content_key(inputs: list[str], settings: Any, code: str, cache_file: str | os.PathLike | None = None) -> str:
    """The content key of one shard (or of a job's result, :func:`run_stored`).

    Args:
        inputs: the shard's input files (hashed by content).
        settings: JSON-serialisable params of the job without the shard's own wildcard.
        code: :func:`code_digest` of the stage's code.
        cache_file: remember the inputs' digests there (:func:`draftpipe.core.io.cached_sha256s`: each file version is
            read once); None reads them every time.

    Returns:
        64-character hex SHA-256.

    Raises:
        FileNotFoundError: an input is missing.
    """
    digests = cached_sha256s(inputs, cache_file) if cache_file else [sha256_file(p) for p in inputs]
    doc = {"inputs": digests, "settings": settings, "code": code}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def stage_lock(store: Path) -> Iterator[None]:
    """Hold the stage's lock (``flock`` on ``<store>/.lock``) for the block; waits while another job holds it."""
    store.mkdir(parents=True, exist_ok=True)
    with open(store / ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def sweep_interrupted(store: Path) -> None:
    """Remove the temporary files and directories (``.<name>.tmp-<pid>``) that killed jobs left in a stage's store.
    Call it under :func:`stage_lock`: then nothing writes into the store, so every such entry is a killed job's."""
    for tmp in store.glob(".*.tmp-*"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        print(f"removed {tmp.name} (left in the store by an interrupted job)", flush=True)


def link_output(entry: Path, output: str, *, copy: bool = False) -> None:
    """Make ``output`` a hard link to ``entry`` (a copy across file systems), or a copy with ``copy``, replacing it
    atomically.

    An output that already is ``entry`` (a job forced beside another with ``--unlock``) is left as it is: renaming
    one name of an inode onto another name of it does nothing, and would leave the temporary link behind.
    """
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not copy:
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(entry, out):
                return
    tmp = out.with_name(f".{out.name}.tmp-link-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    if copy:
        shutil.copyfile(entry, tmp)
    else:
        try:
            os.link(entry, tmp)
        except OSError:
            shutil.copyfile(entry, tmp)
    os.replace(tmp, out)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # another job linked the same entry there in between: the rename did nothing


def quarantine_entry(entry: Path, store: Path) -> Path:
    """Move a damaged store entry (a file with its digest record, or a directory of files and their records) to
    the results tree's quarantine (:func:`draftpipe.formats.provenance.quarantine`); returns where it went."""
    root = store.parent.parent if store.parent.name == STORE else store.parent
    [(_, dest)] = quarantine([entry], root)[:1]
    return dest


def collect_garbage(store: Path, task: ShardTask) -> list[Path]:
    """Remove entries of ``task.shard`` other than its current one that no output links any more."""
    removed = []
    for p in store.glob(f"{task.shard}.*"):
        if p != task.entry and p.is_file() and os.stat(p).st_nlink == 1:
            p.unlink()
            removed.append(p)
    for rec in store.glob(f".{task.shard}.*{DIGEST_SUFFIX}"):
        if not (store / rec.name[1 : -len(DIGEST_SUFFIX)]).exists():
            rec.unlink(missing_ok=True)
    return removed


def run_stage(
    own: ShardTask,
    siblings: list[ShardTask],
    store: Path,
    suffix: str,
    settings: Any,
    code: str,
    compute: Callable[[list[ShardTask]], None],
    share: bool = True,
    check: Callable[[Path], str | None] | None = None,
) -> dict:
    """Fill the stage's stale shards with one verifier load, then link this job's output.

    Args:
        own: this job's shard.
        siblings: every shard of the stage (``own`` included); ignored when ``share`` is false.
        store: the stage's store directory (``results/.store/<stage>``).
        suffix: file extension of the entries (``.jsonl``, ``.safetensors``).
        settings, code: see :func:`content_key`.
        compute: called at most once with the shards to compute; it loads the verifier and writes each task's
            result to ``task.entry`` atomically (an exception leaves the entries it finished).
        share: fill the other ready shards too (one load per stage); false computes only ``own``.
        check: returns why an existing entry is unusable (truncated, corrupt), or None. This job's entry is also
            checked against its recorded digest (:func:`draftpipe.formats.provenance.digest_problem`). An unusable
            entry is moved to the quarantine (:func:`quarantine_entry`) and computed again. An output is a hard
            link to its entry, so damage to one is damage to both: the record is what finds it.

    Returns:
        ``{"computed": [shard ids], "loads": 0 or 1, "linked": own.entry}``.
    """
    tasks = siblings if share else [own]
    if own.shard not in {t.shard for t in tasks}:
        tasks = [*tasks, own]
    with stage_lock(store):
        sweep_interrupted(store)
        todo = []
        for t in tasks:
            if not all(os.path.exists(p) for p in t.inputs):
                continue  # not ready: its own job computes it later
            t.key = content_key(t.inputs, settings, code)
            t.entry = store / f"{t.shard}.{t.key[:32]}{suffix}"
            if t.entry.exists():
                # the entry this job links is checked against its recorded digest (a hash only when it changed
                # since); the others are checked by their own jobs
                reason = (digest_problem(t.entry) if t is own else None) or (check(t.entry) if check else None)
                if reason is None:
                    if not digest_record_path(t.entry).exists():
                        record_digest(t.entry)  # stored before records existed
                    continue
                dest = quarantine_entry(t.entry, store)
                print(
                    f"shard {t.shard}: store entry {t.entry.name} is damaged ({reason}); moved to {dest}, "
                    "computing it again",
                    flush=True,
                )
            # Another shard is computed now only if its output is missing or links an older entry (its job is
            # then planned); an output of unknown origin is left to its own job, which Snakemake may not plan.
            if t is own or not os.path.exists(t.output) or os.stat(t.output).st_nlink > 1:
                todo.append(t)
        if own.entry is None:
            raise FileNotFoundError(f"inputs of shard {own.shard} are missing: {own.inputs}")
        t0 = time.perf_counter()
        if todo:
            print(f"verifier load 1 for {len(todo)} shard(s): {', '.join(t.shard for t in todo)}", flush=True)
            try:
                compute(todo)
            finally:  # the entries it finished, also when it failed part-way: each is new, so always recorded
                for t in todo:
                    if t.entry.exists():
                        record_digest(t.entry)
            print(f"computed {len(todo)} shard(s) in {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            print(f"shard {own.shard}: found in the store, no verifier load", flush=True)
        link_output(own.entry, own.output)
        collect_garbage(store, own)
    return {"computed": [t.shard for t in todo], "loads": 1 if todo else 0, "linked": str(own.entry)}


def run_stored(
    store: Path, key: str, outputs: list[str], build: Callable[[list[str]], None], *, what: str = "result"
) -> bool:
    """A job of several outputs (the draft's model, config and metrics) through the stage store: one entry per
    content key, so a finished result survives a failed rebuild and comes back when the config does.

    Snakemake removes a job's outputs before the job runs, and a failed job leaves none: a rebuild that fails
    would otherwise lose the last good result. The entry ``<store>/<key[:32]>/`` holds the outputs (by file
    name), read-only, each with its digest record (:func:`draftpipe.formats.provenance.record_digest`); each declared
    output is a copy of its file there, so damage to an output never reaches the entry. Under the stage lock: a
    complete entry whose files match their records is copied without calling ``build`` (a damaged one is
    quarantined and built again); otherwise ``build`` writes the outputs to a temporary directory of the store,
    which is renamed to the entry when ``build`` returns (an exception leaves no entry and removes the temporary
    directory; a killed job's is removed by the next run). After copying, the other entries are removed, so the
    store holds the current result and, after a failed rebuild, the last good one.

    Args:
        store: the stage's store directory (``results/.store/<stage>``).
        key: the content key of what the job tracks (:func:`content_key`).
        outputs: the job's declared output paths (distinct file names).
        build: called with the paths to write instead of ``outputs``, in the same order.
        what: named in the log lines.

    Returns:
        True when ``build`` ran, False when the entry was found sound.

    Raises:
        ValueError: two outputs share a file name.
    """
    names = [Path(o).name for o in outputs]
    if len(set(names)) != len(names):
        raise ValueError(f"outputs must have distinct file names: {outputs}")
    entry = store / key[:32]
    with stage_lock(store):
        sweep_interrupted(store)
        built = not (entry.is_dir() and all((entry / n).is_file() for n in names))
        if not built:
            damaged = {n: r for n in names if (r := digest_problem(entry / n)) is not None}
            if damaged:
                dest = quarantine_entry(entry, store)
                why = "; ".join(f"{n}: {r}" for n, r in damaged.items())
                print(f"{what}: store entry {entry.name} is damaged ({why}); moved to {dest}, computing it again")
                built = True
            else:
                for n in names:
                    if not digest_record_path(entry / n).exists():
                        record_digest(entry / n)  # stored before records existed
        if built:
            tmp = store / f".{entry.name}.tmp-{os.getpid()}"
            tmp.mkdir(parents=True)
            try:
                build([str(tmp / n) for n in names])
                missing = [n for n in names if not (tmp / n).is_file()]
                if missing:
                    raise FileNotFoundError(f"{what}: not written: {', '.join(missing)}")
                for n in names:
                    record_digest(tmp / n)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            shutil.rmtree(entry, ignore_errors=True)  # an incomplete entry of the same key
            os.replace(tmp, entry)
        else:
            print(f"{what}: found in the store ({entry.name}), not computed again", flush=True)
        for name, output in zip(names, outputs):
            link_output(entry / name, output, copy=True)
        for other in store.iterdir():  # the outputs are copies of this entry now: the others go
            if other.is_dir() and other != entry and not other.name.startswith("."):
                shutil.rmtree(other, ignore_errors=True)
    return built


def stage_tasks(smk: Any, input_names: list[str]) -> tuple[ShardTask, list[ShardTask]]:
    """This job's shard and all shards of its stage, from the Snakemake job object.

    The other shards' paths are this job's paths with the shard id replaced; ``params.num_shards`` says how many
    shards the stage has (ids :func:`draftpipe.core.layout.shard_ids`).
    """
    shard = smk.wildcards.shard
    own_inputs = [str(getattr(smk.input, n)) for n in input_names]
    own = ShardTask(shard, own_inputs, str(smk.output[0]))
    sibs = [
        ShardTask(s, [sibling(p, shard, s) for p in own_inputs], sibling(own.output, shard, s)) if s != shard else own
        for s in shard_ids(smk.params.num_shards)
    ]
    return own, sibs


def stage_settings(smk: Any) -> dict:
    """The job's params without the stage's shard count and its untracked settings
    (:mod:`draftpipe.workflow.settings`): what, with the inputs and code, keys a shard (so a
    shard's entry survives a change of the count, and the entries of stores written when the params held the
    id list, ``shards``, still match). ``smk`` is the job script's ``snakemake`` object, or a Snakemake ``Job``
    (both have ``params``)."""
    params = {k: v for k, v in smk.params.items() if k not in ("num_shards", "shards", "untracked")}
    return jsonable(params)


def stored_already(job: Any, store: Path, suffix: str, code: str) -> bool:
    """Whether a planned shard job will only link: its inputs exist and its entry is in the store. What the disk
    check before a run leaves out (a shard to link takes no space).

    Args:
        job: a Snakemake ``Job`` of a shard rule (``wildcards.shard``, ``input``, ``params``).
        store: the stage's store directory.
        suffix: the entries' extension (``.safetensors``).
        code: :func:`code_digest` of the stage's job script.
    """
    inputs = [str(f) for f in job.input]
    if not all(os.path.exists(f) for f in inputs):
        return False
    key = content_key(inputs, stage_settings(job), code)
    return (store / f"{job.wildcards.shard}.{key[:32]}{suffix}").is_file()

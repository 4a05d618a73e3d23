"""Fault injection across the pipeline: the main job SIGKILLed part-way through every stage, then rerun.

In a fresh copy of the workflow, ``snakemake results/draft/model.safetensors`` runs in its own process group. The
whole group (Snakemake, its job scripts, vLLM's engine processes) is SIGKILLed as soon as a stage that has not been
killed yet is part-way:

- ``verifier``, ``prompt_shard``, ``vocab_maps``: a job script of the stage is running;
- ``completions``, ``hidden_states``: a job of the stage is running with one shard finished in its store
  (``draftpipe/runtime/store.py``) and another still to do (for completions, the second shard's job is loading its own
  engine, ``resources.completions.share_engine`` false; for hidden states, the vLLM engine is extracting the second
  shard in calls of 256 tokens, ``resources.hidden_states.batch_tokens``, as in the ``built`` run);
- ``draft``: training runs and its first checkpoint is complete (one epoch, ``draft.epochs: 1``, with 4 checkpoints,
  ``resources.draft.checkpoints_per_epoch``: the kill lands part-way through the epoch).

A SIGKILLed Snakemake leaves its lock behind, so each rerun is ``--unlock`` then ``--rerun-incomplete``; reruns go
on until every stage has been killed once, then one runs to the end. The finished tree must hold no temporary file,
the draft must have resumed from its checkpoint, shards finished before a kill must not have been computed again,
and every artifact must have the bytes of the uninterrupted run (the ``one_epoch`` fixture: the session build, its
draft trained for one epoch).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CORES
from helpers.workflow import (
    copy_build,
    copy_workflow,
    damage,
    one_epoch_config,
    planned_jobs,
    set_resources,
    small_extraction_calls,
    snakemake,
    verify,
)

from draftpipe.core.io import sha256_file
from draftpipe.formats.provenance import digest_problem, digest_record_path
from draftpipe.stages.draft.checkpoint import latest_checkpoint

TARGET = "results/draft/model.safetensors"
SHARDS = 2  # training shards of the embedded default
# rule -> its job script
STAGES = {
    "verifier": "convert_verifier",
    "prompt_shard": "prompt_shard",
    "completions": "completions",
    "hidden_states": "hidden_states",
    "vocab_maps": "vocab_maps",
    "draft": "train_draft",
}
ARTIFACTS = (
    "results/verifier/*",
    "results/prompts/train_*.jsonl",
    "results/completions/*.jsonl",
    "results/hidden_states/*.safetensors",
    "results/vocab/*",
    "results/draft/*",
)
# what an interrupted write leaves: draftpipe.core.io.atomic_path's ".<name>.tmp-*" files, stage links'
# ".<name>.tmp-link-*", the verifier's ".verifier.tmp-*" build directory, the draft trainer's ".<epoch>.tmp-*"
# and ".<epoch>.old-*" checkpoint directories
TEMPORARY = re.compile(r"\.tmp-|\.old-")


class Run:
    """``snakemake TARGET`` in its own session (process group), its output in ``log``."""

    started: list[Run] = []

    def __init__(self, work: Path, log: Path, *args: str):
        self.work, self.log = work, log
        self.started_ns = time.time_ns()
        self.out = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", str(CORES), TARGET, *args],
            cwd=work,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        Run.started.append(self)

    def tail(self) -> str:
        self.out.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL the whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            self.proc.wait()
            self.out.close()
        assert self.proc.returncode == -signal.SIGKILL
        # every process of the run was in the group: none is left working in the directory
        deadline = time.monotonic() + 60
        while _processes_in(self.work) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_in(self.work) == {}


@pytest.fixture
def runs():
    """Ends every run a failed test left running."""
    yield Run.started
    for run in Run.started:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
        run.out.close()
    Run.started.clear()


def _processes_in(work: Path) -> dict[int, str]:
    """Live processes whose working directory is inside ``work`` (zombies have none): pid -> command line."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cwd == work or work in cwd.parents:
            found[int(proc.name)] = cmdline
    return found


def running_stages(work: Path) -> set[str]:
    """Rules with a job script running in ``work`` (Snakemake runs ``.snakemake/scripts/tmp<random>.<name>.py``)."""
    scripts = {f".{script}.py": rule for rule, script in STAGES.items()}
    running = set()
    for cmdline in _processes_in(work).values():
        for arg in cmdline.split():
            if "/.snakemake/scripts/" in arg or arg.startswith(".snakemake/scripts/"):
                rule = next((r for suffix, r in scripts.items() if arg.endswith(suffix)), None)
                if rule:
                    running.add(rule)
    return running


def store_entries(work: Path, rule: str) -> list[Path]:
    """The finished shard results of a stage in its content-addressed store (``draftpipe/runtime/store.py``)."""
    store = work / "results/.store" / rule
    suffix = ".jsonl" if rule == "completions" else ".safetensors"
    return sorted(p for p in store.glob(f"*{suffix}") if not p.name.startswith(".")) if store.is_dir() else []


def output_of(entry: Path) -> Path:
    """The declared output a store entry ``results/.store/<rule>/<shard>.<key>.<ext>`` is linked to."""
    return entry.parents[2] / entry.parent.name / f"train_{entry.name.split('.')[0]}{entry.suffix}"


def draft_checkpoint(work: Path):
    train = work / "results/draft/.train"
    dirs = sorted(train.iterdir()) if train.is_dir() else []
    return next((c for c in map(latest_checkpoint, dirs) if c is not None), None)


def part_way(work: Path, run: Run, todo: set[str], seen: dict | None = None) -> set[str]:
    """The stages of ``todo`` that are part-way now (see the module docstring); ``seen`` collects, for a failure's
    message, each running stage's shards finished in this run when it was last seen."""
    hits = set()
    for rule in running_stages(work) & todo:
        if rule in ("completions", "hidden_states"):
            done = [e for e in store_entries(work, rule) if e.stat().st_mtime_ns >= run.started_ns]
            if seen is not None:
                seen.setdefault(rule, set()).add(len(done))
            if not 1 <= len(done) < SHARDS:
                continue
        if rule == "draft" and draft_checkpoint(work) is None:
            continue
        hits.add(rule)
    return hits


def artifacts(work: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(work)): p
        for pattern in ARTIFACTS
        for p in sorted(work.glob(pattern))
        if p.is_file() and not p.name.endswith(".manifest.json")
    }


def test_a_kill_in_every_stage_ends_in_the_uninterrupted_artifacts(one_epoch, tmp_path, runs):
    work = copy_workflow(tmp_path / "workflow").resolve()
    # small vLLM calls for hidden states, as in the `built` run: they stretch the time between the stage's first
    # and last finished shard, where the kill lands
    small_extraction_calls(work)
    # one engine per completions job (resources.completions.share_engine false, which shapes no artifact): the first
    # shard is stored while the second job loads its engine, a window of a minute; with one shared engine it is
    # the second shard's generation alone, about a second on this tiny verifier, too short to land a kill in on a
    # loaded machine
    set_resources(work, "completions", share_engine=False)
    # the draft of the reference, one epoch, with checkpoints part-way through it (which shape nothing)
    cfg = one_epoch_config(work, "kill", lambda c: c["resources"]["draft"].update(checkpoints_per_epoch=4))
    todo, kills, finished = set(STAGES), [], {}
    run = Run(work, tmp_path / "run1.log", "--configfile", cfg)
    while todo:
        seen: dict[str, set[int]] = {}
        while not (hit := part_way(work, run, todo, seen)):
            if run.proc.poll() is not None:
                counts = {rule: sorted(n) for rule, n in seen.items()}
                pytest.fail(
                    f"snakemake exited ({run.proc.returncode}) before {sorted(todo)} were killed "
                    f"part-way (killed: {kills}; shards finished when last seen running: {counts}):\n"
                    f"{run.tail()}"
                )
            time.sleep(0.05)
        run.kill()
        if "draft" in hit:
            ckpt = draft_checkpoint(work)  # the last checkpoint complete when the kill landed
        kills.append(sorted(hit))
        todo -= hit
        for rule in ("completions", "hidden_states"):
            finished.update({e: e.stat().st_ino for e in store_entries(work, rule)})
        if len(kills) == 1:  # Snakemake left its lock: without --unlock the rerun is refused
            refused = snakemake(work, TARGET, check=False)
            assert refused.returncode != 0 and "LockException" in refused.stdout + refused.stderr
        snakemake(work, "--unlock")
        run = Run(work, tmp_path / f"run{len(kills) + 1}.log", "--configfile", cfg, "--rerun-incomplete")
    assert run.proc.wait() == 0, run.tail()
    print(f"killed part-way, in order: {kills}")

    # shards finished before a kill were not computed again: each output is the entry stored then
    assert len(finished) >= 2
    for entry, inode in finished.items():
        assert output_of(entry).stat().st_ino == inode, entry
    # no temporary file of an interrupted write is left
    assert [str(p) for p in (work / "results").rglob("*") if TEMPORARY.search(p.name)] == []
    # the draft resumed from the checkpoint it was killed after
    draft_log = (work / "results/logs/draft.log").read_text()
    resumed = rf"resuming from epoch {ckpt[0]}( step \d+)? checkpoint {re.escape(str(ckpt[1].relative_to(work)))} "
    assert re.search(resumed, draft_log), draft_log[-3000:]
    assert "epochs from the start" not in draft_log
    # every artifact has the bytes of the uninterrupted run
    mine, ref = artifacts(work), artifacts(one_epoch)
    assert sorted(mine) == sorted(ref) and len(mine) >= 14
    assert [n for n, p in mine.items() if sha256_file(p) != sha256_file(ref[n])] == []
    # and the provenance manifests describe the finished tree
    verify = subprocess.run(
        [sys.executable, "-m", "draftpipe.checks.verify", "results"], cwd=work, capture_output=True, text=True
    )
    assert not re.search(r"^(CORRUPT|STALE)", verify.stdout, re.M), verify.stdout[-3000:]


def test_damage_in_place_is_repaired_to_the_uninterrupted_bytes_and_never_linked_again(built, tmp_path):
    """Issue 28's probe: the draft truncated, a hidden-state shard and a completions file with bytes flipped, in
    place. ``--repair`` quarantines them (and the store entries the shards are, the same files, with their digest
    records); the plain main job plans their rebuild by itself; the printed command computes the shards again
    (their damaged entries are never linked) and copies the draft back from its entry, which damage to the output
    could not reach. Every artifact ends with the bytes of the uninterrupted run, every store entry read-only and
    matching its record. Then, without verify, a plain run finds a changed draft and shard by itself and rebuilds
    them to the same bytes."""
    work = tmp_path / "workflow"
    copy_build(built, work)  # hard links kept
    damaged = {
        "results/draft/model.safetensors": "truncate",
        "results/hidden_states/train_00001.safetensors": "flip",
        "results/completions/train_00000.jsonl": "flip",
    }
    for rel, how in damaged.items():
        damage(work / rel, how)
    found = verify(work)
    assert found.returncode == 1
    for rel in damaged:
        assert re.search(rf"^CORRUPT {re.escape(rel)}: ", found.stdout, re.M), found.stdout
    # the shard outputs are their store entries: those are found damaged too
    assert re.search(
        r"^CORRUPT results/\.store/hidden_states/00001\.\w+\.safetensors: store entry: sha256 ", found.stdout, re.M
    )
    assert re.search(
        r"^CORRUPT results/\.store/completions/00000\.\w+\.jsonl: store entry: sha256 ", found.stdout, re.M
    )
    # the draft's entry is not: its output is a copy
    assert not re.search(r"^CORRUPT results/\.store/draft/", found.stdout, re.M), found.stdout

    repair = verify(work, "--repair")
    command = re.search(r"rebuild with: snakemake (.*)$", repair.stdout, re.M)
    assert command, repair.stdout
    assert ".store" not in command.group(1)
    assert verify(work).returncode == 1  # missing artifacts: their dependents' inputs are missing
    # the plain main job plans the same rebuild by itself (Snakemake alone would say "Nothing to be done")
    plan = snakemake(work, TARGET, "-n")
    lines = [line for line in (plan.stdout + plan.stderr).splitlines() if "quarantined by --repair" in line]
    assert lines == [
        "draftpipe: results/completions/train_00000.jsonl was quarantined by --repair; rebuilding it and "
        "results/completions/stats.json, results/hidden_states/train_00000.safetensors, results/vocab/token_freq.csv, "
        "results/vocab/vocab_maps.safetensors",
        "draftpipe: results/hidden_states/train_00001.safetensors was quarantined by --repair; rebuilding it and "
        "results/draft/config.json, results/draft/metrics.csv",
    ]
    assert planned_jobs(work) == {"completions": 1, "hidden_states": 2, "vocab_maps": 1, "draft": 1}
    # the printed command, without the stages after the draft that its `all` also runs (the compatibility report,
    # the benchmark, the model card): none of them was damaged, and this test compares the artifacts up to the draft
    rebuild = snakemake(work, *command.group(1).split(), TARGET, "--omit-from", "compat_report")
    log = rebuild.stdout + rebuild.stderr
    assert "draft: found in the store" in (work / "results/logs/draft.log").read_text()

    mine, ref = artifacts(work), artifacts(built)
    assert sorted(mine) == sorted(ref)
    differ = [n for n, p in mine.items() if sha256_file(p) != sha256_file(ref[n])]
    assert differ == [], log[-3000:]
    clean = verify(work)
    assert clean.returncode == 0 and "0 corrupt, 0 stale" in clean.stdout, clean.stdout[-3000:]
    # every store entry is read-only and matches its record, the recomputed ones too
    for entry in store_entries(work, "hidden_states") + store_entries(work, "completions"):
        assert entry.stat().st_mode & 0o777 == 0o444, entry
        assert digest_record_path(entry).is_file() and digest_problem(entry, full=True) is None, entry
    # and nothing is forced once the rebuild is done
    again = snakemake(work, TARGET, "-n")
    assert "quarantined by --repair" not in again.stdout + again.stderr
    assert "Nothing to be done" in again.stdout + again.stderr

    # Without verify: a plain run finds bytes changed in the draft and in a shard by itself (their stat changed),
    # names them, and rebuilds them and what is built from them, to the uninterrupted bytes again
    for rel in ("results/draft/model.safetensors", "results/hidden_states/train_00001.safetensors"):
        damage(work / rel, "flip")
    plan = snakemake(work, TARGET, "-n")
    lines = sorted(line for line in (plan.stdout + plan.stderr).splitlines() if " is damaged (" in line)
    assert [re.sub(r"\(sha256 \w+\.\.\. != manifest \w+\.\.\.\)", "(sha256)", x) for x in lines] == [
        f"draftpipe: {rel} is damaged (sha256); rebuilding it and what is built from it"
        for rel in ("results/draft/model.safetensors", "results/hidden_states/train_00001.safetensors")
    ], lines
    assert planned_jobs(work) == {"hidden_states": 1, "draft": 1}
    snakemake(work, TARGET)
    assert "draft: found in the store" in (work / "results/logs/draft.log").read_text()
    mine = artifacts(work)
    assert [n for n, p in mine.items() if sha256_file(p) != sha256_file(ref[n])] == []
    again = snakemake(work, TARGET, "-n")
    assert " is damaged (" not in again.stdout + again.stderr and "Nothing to be done" in again.stdout + again.stderr

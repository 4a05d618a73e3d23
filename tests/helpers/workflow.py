"""Running the workflow in a throw-away copy: copy, run, dry-run job tables, config variants."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import CORES, REPO

WORKFLOW_FILES = ("Snakefile", "config.yaml", "rules", "scripts", "profiles", "configs", "draftpipe", "envs")


def copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def set_resources(workdir: Path, stage: str, **values) -> None:
    """Add ``values`` to ``resources.<stage>`` in this copy's ``config.yaml`` (a text edit of the stage's one-line
    flow mapping, so the rest of the file, comments included, stays as it is). Resources shape no artifact."""
    cfg = workdir / "config.yaml"
    lines = cfg.read_text().splitlines(keepends=True)
    pattern = re.compile(rf"^  {re.escape(stage)}: \{{(.*)\}}$")
    hits = [i for i, line in enumerate(lines) if pattern.match(line.rstrip("\n"))]
    assert len(hits) == 1, f"config.yaml: no single resources line for {stage!r}"
    line = lines[hits[0]].rstrip("\n")
    extra = ", ".join(f"{k}: {json.dumps(v)}" for k, v in values.items())  # JSON values are YAML flow values
    lines[hits[0]] = f"{line[:-1]}, {extra}}}\n"
    cfg.write_text("".join(lines))
    assert yaml.safe_load(cfg.read_text())["resources"][stage].items() >= values.items()


def small_extraction_calls(workdir: Path, tokens: int = 256) -> None:
    """Send hidden-state requests to vLLM in calls of ``tokens`` tokens in this copy (``resources.hidden_states.
    batch_tokens``, which shapes no artifact). vLLM's states depend on the batch at the last bit, so runs whose
    bytes are compared use the same calls; small calls also stretch the extraction of each shard."""
    set_resources(workdir, "hidden_states", batch_tokens=tokens)


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--cores", str(CORES), *args]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def planned_jobs(workdir: Path, *args: str, target: str = "results/draft/model.safetensors") -> dict[str, int]:
    """Job counts of a dry run for `target`, without the `all` target rule."""
    out = snakemake(workdir, target, *args, "-n", "-q", "rules").stdout
    if "Nothing to be done" in out:
        return {}
    table = out[out.index("Job stats:") :]
    jobs = {}
    for line in table.splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m or m.group(1) == "total":
            break
        jobs[m.group(1)] = int(m.group(2))
    jobs.pop("all", None)
    return jobs


def copy_build(built: Path, dest: Path) -> Path:
    """A copy of a built workflow (``cp -a``: mtimes, modes and the store's hard links kept, Snakemake's metadata
    with it) at ``dest``, for a test that runs jobs or edits files: the session build itself is never changed."""
    subprocess.run(["cp", "-a", str(built), str(dest)], check=True)
    return dest


def damage(path: Path, how: str) -> None:
    """Damage a file in place, as a user or a failing disk would: ``truncate`` it or flip bytes in its middle."""
    os.chmod(path, 0o644)  # store entries are read-only; root (and the owner, with chmod) can still write them
    if how == "truncate":
        os.truncate(path, 1000)
    else:
        with open(path, "r+b") as fh:
            fh.seek(path.stat().st_size // 2)
            chunk = fh.read(4)
            fh.seek(-len(chunk), os.SEEK_CUR)
            fh.write(bytes(b ^ 0xFF for b in chunk))


def verify(work: Path, *args: str) -> subprocess.CompletedProcess:
    """``draftpipe-verify results`` (its module) in a workflow copy, with ``args`` (``--repair``)."""
    return subprocess.run(
        [sys.executable, "-m", "draftpipe.checks.verify", "results", *args], cwd=work, capture_output=True, text=True
    )


def variants_dir(workdir: Path) -> Path:
    """Where the config variants of a workflow copy and the files they name are written: beside the copy, never
    inside it (``<copy>-variants/``)."""
    path = workdir.parent / f"{workdir.name}-variants"
    path.mkdir(exist_ok=True)
    return path


def variant(workdir: Path, name: str, change) -> str:
    """The copy's ``config.yaml`` changed by ``change(cfg)``, written to :func:`variants_dir` as ``<name>.yaml``;
    returns its path for ``--configfile``."""
    cfg = yaml.safe_load((workdir / "config.yaml").read_text())
    change(cfg)
    path = variants_dir(workdir) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))  # keys sorted: key order must not count as a change
    return str(path)


def one_epoch(cfg: dict) -> None:
    """A config change: the draft trains one epoch (``draft.epochs: 1``; the default trains four)."""
    cfg["draft"]["epochs"] = 1


def one_epoch_config(workdir: Path, name: str = "one-epoch", change=None) -> str:
    """:func:`variant` ``name`` of the copy's config with :func:`one_epoch`, then ``change(cfg)`` if given: the
    config of the session's one-epoch reference (the ``one_epoch`` fixture) and of the runs compared with it."""

    def both(cfg):
        one_epoch(cfg)
        if change is not None:
            change(cfg)

    return variant(workdir, name, both)


def stream_figures(log: str) -> dict[str, int]:
    """The streamed draft's figures from its job log (``draftpipe.stages.draft.training.stream_line``): ``steps``,
    ``tokens`` extracted, the spool's ``peak`` bytes and the ``budget``."""
    m = re.search(
        r"draft stream: (\d+) step\(s\), ([\d,]+) tokens extracted by vLLM; spool peak ([\d,]+) bytes of a "
        r"([\d,]+)-byte budget",
        log,
    )
    assert m, "no stream line in the draft's log"
    steps, tokens, peak, budget = (int(g.replace(",", "")) for g in m.groups())
    return {"steps": steps, "tokens": tokens, "peak": peak, "budget": budget}

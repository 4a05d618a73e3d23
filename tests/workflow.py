"""Running the workflow in a throw-away copy: copy, run, dry-run job tables, config variants."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import REPO

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


HIDDEN_STATES_RESOURCES = "  hidden_states: {gpus: 0, threads: 2, mem_mb: 8000, runtime: 120}"


def small_extraction_calls(workdir: Path, tokens: int = 256) -> None:
    """Send hidden-state requests to vLLM in calls of ``tokens`` tokens in this copy (``resources.hidden_states.
    batch_tokens``, which shapes no artifact). vLLM's states depend on the batch at the last bit, so runs whose
    bytes are compared use the same calls; small calls also stretch the extraction of each shard."""
    cfg = workdir / "config.yaml"
    text = cfg.read_text()
    assert HIDDEN_STATES_RESOURCES in text
    cfg.write_text(text.replace(HIDDEN_STATES_RESOURCES, HIDDEN_STATES_RESOURCES[:-1] + f", batch_tokens: {tokens}}}"))


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
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


def variant(workdir: Path, name: str, change) -> str:
    cfg = yaml.safe_load((workdir / "config.yaml").read_text())
    change(cfg)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))  # keys sorted: key order must not count as a change
    return str(path)

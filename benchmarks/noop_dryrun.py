"""Benchmark: the time of a no-op `snakemake -n` (everything up to date) as the shard count grows.

Builds a results tree of empty artifacts for the embedded default with N shards, records Snakemake's metadata
for it with `--touch` (so the dry run checks mtimes, checksums and params exactly as after a real run), then times
`snakemake -n results/draft/model.safetensors` (best of --repeat). The figure of merit is the ratio of the time
at the largest shard count to the time at the smallest, measured in one run, next to the absolute seconds.

    .venv/bin/python benchmarks/noop_dryrun.py --shards 10 1000
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ("Snakefile", "config.yaml", "rules", "scripts", "profiles", "configs", "draftpipe", "envs")
TARGET = "results/draft/model.safetensors"


def smk(work: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", *args], cwd=work, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"snakemake {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def write_tiny_shard(path: Path) -> None:
    """A valid hidden-state shard of one 4-token sample (3 aux states of width 8)."""
    import torch

    sys.path.insert(0, str(REPO))
    from draftpipe.formats.hidden_states import write_shard

    sample = {
        "input_ids": torch.arange(4),
        "loss_mask": torch.tensor([0, 1, 1, 1], dtype=torch.uint8),
        "hidden_states": torch.zeros(4, 24, dtype=torch.bfloat16),
        "verifier_last_hidden_states": torch.zeros(4, 8, dtype=torch.bfloat16),
    }
    write_shard(str(path), [sample], {"aux_layer_ids": [1, 2, 4], "hidden_size": 8})


def copy_workflow(work: Path) -> Path:
    """A copy of the workflow's files (no results) in the new directory ``work``, for a benchmark to run in."""
    work.mkdir(parents=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, work / name)
    return work


def up_to_date_tree(root: Path, shards: int) -> Path:
    """A copy of the workflow with `shards` shards whose every artifact exists and is recorded as up to date."""
    work = copy_workflow(root / f"wf_{shards}")
    cfg = yaml.safe_load((work / "config.yaml").read_text())
    cfg["prompts"]["num_shards"] = shards
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = smk(work, "--summary", TARGET).stdout.splitlines()[1:]
    outputs = [line.split("\t")[0] for line in summary if "\t" in line]
    for out in outputs:  # empty artifacts; --touch then orders their mtimes and records the metadata
        (work / out).parent.mkdir(parents=True, exist_ok=True)
        (work / out).touch()
    for out in outputs:  # hidden-state shards must pass the header check made when the workflow is read
        if out.startswith("results/hidden_states/"):
            write_tiny_shard(work / out)
    smk(work, "--touch", TARGET)
    out = smk(work, "-n", TARGET).stdout
    if "Nothing to be done" not in out or any((work / "results").glob(".quarantine")):
        raise RuntimeError(f"the tree with {shards} shards is not up to date:\n{out[-2000:]}")
    return work


def time_dry_run(work: Path, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        smk(work, "-n", TARGET)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[10, 1000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.shards:
            work = up_to_date_tree(Path(tmp), n)
            results[n] = time_dry_run(work, args.repeat)
            print(f"{n:>6} shards: no-op dry run {results[n]:.2f} s (best of {args.repeat})", flush=True)
    lo, hi = min(args.shards), max(args.shards)
    print(
        json.dumps(
            {
                "seconds": {str(k): round(v, 3) for k, v in results.items()},
                f"ratio_{hi}_to_{lo}": round(results[hi] / results[lo], 2),
            }
        )
    )


if __name__ == "__main__":
    main()

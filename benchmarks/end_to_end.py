"""Benchmark: the embedded default end to end from a fresh results tree, with the time of each stage.

    .venv/bin/python benchmarks/end_to_end.py [--target results/draft/model.safetensors] [--configfile FILE ...]

Copies the workflow into a temporary directory (the README's quick start without the set-up), runs
``snakemake <target> --cores all`` there with this interpreter's Snakemake, and reports the wall time and the
seconds of each rule (summed over its jobs, from ``results/benchmarks/``). With ``--configfile`` (YAML files
merged over ``config.yaml``, e.g. one holding ``hidden_states: {dtype: float8_e4m3fn}``) it measures another setting; with a target under
``results/bench/`` it also reports the served acceptance length at each ``num_speculative_tokens``. Prints one
JSON line last.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from noop_dryrun import copy_workflow  # noqa: E402


def stage_seconds(results: Path) -> dict[str, float]:
    """Seconds per rule from Snakemake's ``benchmark:`` files (``results/benchmarks/<rule>[/<wildcards>].tsv``)."""
    out: dict[str, float] = defaultdict(float)
    for tsv in sorted((results / "benchmarks").rglob("*.tsv")):
        rel = tsv.relative_to(results / "benchmarks")
        rule = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        with tsv.open() as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        out[rule] += sum(float(r["s"]) for r in rows)
    return {k: round(v, 1) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="results/draft/model.safetensors")
    ap.add_argument("--configfile", nargs="*", default=[], help="YAML files merged over config.yaml")
    ap.add_argument("--keep", help="copy the results tree here afterwards")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = copy_workflow(Path(tmp) / "wf")
        cmd = [sys.executable, "-m", "snakemake", args.target, "--cores", "all"]
        if args.configfile:
            cmd += ["--configfile", "config.yaml", *(str(Path(f).resolve()) for f in args.configfile)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            sys.exit(f"snakemake failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        out = {"target": args.target, "configfile": args.configfile, "wall_s": round(wall, 1),
               "stages_s": stage_seconds(work / "results")}  # fmt: skip
        summary = work / "results/bench/summary.json"
        if summary.exists():
            out["acceptance_length"] = {
                f"{r['prompt_set']} k={r['num_speculative_tokens']} T={r['temperature']}": round(
                    r["acceptance_length"], 3
                )
                for r in json.loads(summary.read_text())["results"]
            }
        if args.keep:
            shutil.copytree(work / "results", args.keep, dirs_exist_ok=True)
        print(json.dumps(out))


if __name__ == "__main__":
    main()

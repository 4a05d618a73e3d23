"""The benchmark suite: every benchmark, each a ratio measured side by side in one run, printed as one table.

    .venv/bin/python benchmarks/run.py            # the full suite (about 10 min on 2 CPU cores)
    .venv/bin/python benchmarks/run.py --quick    # CI size (about 2 min): fewer shards and steps, no vLLM engine
    .venv/bin/python benchmarks/run.py --only dry_run draft_step

Each benchmark is a script of this directory run in its own process; its last output line is JSON, from which the
table takes the figures. The table names the command that reproduces each row. Timings are of this machine at this
moment: compare ratios, measured in the same run, not seconds across machines.

| benchmark | what is compared |
|---|---|
| ``dry_run`` | no-op ``snakemake -n`` at many shards against few (``noop_dryrun.py``) |
| ``draft_step`` | tokens/s of a draft training step: the packed TTT attention the ``draft`` rule uses on a CPU against speculators' ``sdpa``; float8 shards' bytes against bfloat16 (``draft_step.py``) |
| ``hidden_states`` | vLLM extraction tokens/s against the bare prefill and against transformers (``hidden_states.py``) |
| ``end_to_end`` | the embedded default from a fresh tree, per stage (``end_to_end.py``; full suite only) |
| ``stream`` | the draft target with hidden states streamed against shards on disk: wall time, peak bytes (``stream_vs_disk.py``; full suite only) |

Outside the suite, for a GPU machine: ``gpu_train.py`` (draft training at the size of a real verifier: tokens/s,
fraction of the bf16 peak, memory, compile time, the loader against the step, the trainer against speculators',
torchrun with DDP and FSDP).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> (script arguments of the quick suite, of the full suite); None leaves it out of that suite
SUITE = {
    "dry_run": (["--shards", "10", "300", "--repeat", "1"], ["--shards", "10", "1000", "--repeat", "3"]),
    "draft_step": (["--steps", "4", "--fp8"], ["--steps", "12", "--fp8"]),
    "hidden_states": (None, ["--rows", "200"]),
    "end_to_end": (None, ["--target", "results/bench/summary.json"]),
    "stream": (None, []),
}
SCRIPTS = {"dry_run": "noop_dryrun.py", "draft_step": "draft_step.py", "hidden_states": "hidden_states.py",
           "end_to_end": "end_to_end.py", "stream": "stream_vs_disk.py"}  # fmt: skip


def rows_of(name: str, r: dict) -> list[tuple[str, str, str]]:
    """``(measure, value, ratio)`` rows of one benchmark's JSON result."""
    if name == "dry_run":
        (lo, lo_s), (hi, hi_s) = sorted(((int(k), v) for k, v in r["seconds"].items()))
        ratio = r[f"ratio_{hi}_to_{lo}"]
        return [(f"no-op dry run, {hi} vs {lo} shards", f"{hi_s:.2f} s vs {lo_s:.2f} s", f"{ratio:.2f}x")]
    if name == "draft_step":
        t = r["tokens_per_s"]
        out = [
            (
                f"draft step tokens/s ({r['tokens_per_step']} tokens), packed vs sdpa",
                f"{t['packed']:.0f} vs {t['sdpa']:.0f}",
                f"{r['ratio_packed_to_sdpa']:.2f}x",
            ),
            ("  same loss, largest gradient difference", f"{r['agreement']['max_grad_diff']:.1e}", ""),
        ]
        if "fp8" in r:
            out.append(("hidden-state shard bytes, float8 vs bfloat16", "", f"{r['fp8']['bytes_ratio_to_bf16']:.3f}x"))
            out.append(
                ("draft step tokens/s, float8 vs bfloat16 shards", f"{r['fp8']['tokens_per_s']:.0f} vs {t['packed']:.0f}",
                 f"{r['fp8']['tokens_per_s'] / t['packed']:.2f}x")
            )  # fmt: skip
        return out
    if name == "hidden_states":
        tps = r["tokens_per_s"]
        return [
            ("extraction tokens/s, vLLM vs bare prefill", f"{tps['extract']:.0f} vs {tps['prefill']:.0f}",
             f"{r['extract_over_prefill']:.2f}x"),
            ("extraction tokens/s, vLLM vs transformers", f"{tps['extract']:.0f} vs {tps['transformers']:.0f}",
             f"{r['extract_over_transformers']:.2f}x"),
        ]  # fmt: skip
    if name == "end_to_end":
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in r["stages_s"].items())
        out = [(f"embedded default end to end ({r['target']})", f"{r['wall_s']:.0f} s ({stages})", "")]
        out += [(f"  served acceptance length {k}", f"{v:.2f}", "") for k, v in r.get("acceptance_length", {}).items()]
        return out
    if name == "stream":
        w, b = r["wall_s"], r["peak_hidden_bytes"]
        return [
            ("draft target, hidden states streamed vs on disk: wall time", f"{w['stream']:.0f} s vs {w['disk']:.0f} s",
             f"{r['wall_stream_over_disk']:.2f}x"),
            ("  peak hidden-state bytes on disk (stream budget " f"{r['budget']:,})", f"{b['stream']:,} vs {b['disk']:,}",
             f"{r['peak_stream_over_disk']:.3f}x"),
        ]  # fmt: skip
    return [(name, json.dumps(r), "")]


def run_one(name: str, args: list[str]) -> tuple[dict | None, float, str]:
    cmd = [sys.executable, str(HERE / SCRIPTS[name]), *args]
    shown = " ".join(["python", f"benchmarks/{SCRIPTS[name]}", *args])
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}\n")
        return None, wall, shown
    return json.loads(lines[-1]), wall, shown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI-sized suite")
    ap.add_argument("--only", nargs="+", choices=sorted(SUITE), help="run only these benchmarks")
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args()
    table, results, failed = [], {}, []
    for name, (quick, full) in SUITE.items():
        if args.only and name not in args.only:
            continue
        bench_args = quick if args.quick else full
        if bench_args is None:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        r, wall, shown = run_one(name, bench_args)
        if r is None:
            failed.append(name)
            continue
        results[name] = r
        for i, (measure, value, ratio) in enumerate(rows_of(name, r)):
            table.append((measure, value, ratio, f"`{shown}` ({wall:.0f} s)" if i == 0 else ""))
    print("| measure | value | ratio | command |")
    print("|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()

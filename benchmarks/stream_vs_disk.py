"""Benchmark: the draft target with the hidden states on disk against streamed (``hidden_states.storage``), in one
run, on the embedded default.

    .venv/bin/python benchmarks/stream_vs_disk.py [--budget 1572864]

Builds the embedded default up to its completions and vocab maps once in a temporary copy of the workflow, copies
that tree twice (``cp -a``), then runs ``snakemake results/draft/model.safetensors`` in each: on disk (the
``hidden_states`` jobs write the shards, then the ``draft`` job trains on them) and streamed (the ``draft`` job
extracts as it trains, within ``--budget`` bytes). Reports the wall time of each and the peak bytes of hidden states
on disk while it ran (shards and the stage store, each file counted once, against the spool), sampled every 10 ms.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from noop_dryrun import copy_workflow  # noqa: E402

TARGET = "results/draft/model.safetensors"
HIDDEN = ("results/hidden_states", "results/.store/hidden_states", "results/draft/.train")


def hidden_bytes(work: Path) -> int:
    """Bytes of hidden states under ``work`` now: shards, store entries and request files, the stream's spool;
    hard links counted once."""
    seen, total = set(), 0
    for top in HIDDEN:
        for root, _, files in os.walk(work / top):
            for name in files:
                try:
                    st = os.stat(os.path.join(root, name))
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) not in seen and (top != HIDDEN[2] or ".spool" in root):
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def timed_run(work: Path, args: list[str]) -> tuple[float, int]:
    """Wall seconds of ``snakemake TARGET *args`` in ``work`` and the peak of :func:`hidden_bytes` meanwhile."""
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], hidden_bytes(work))
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "snakemake", TARGET, "--cores", "all", *args], cwd=work,
                          capture_output=True, text=True)  # fmt: skip
    wall = time.monotonic() - t0
    done.set()
    t.join()
    if proc.returncode != 0:
        sys.exit(f"snakemake failed in {work} (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, max(peak[0], hidden_bytes(work))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=1_572_864, help="hidden_states.disk_budget of the stream, bytes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = copy_workflow(Path(tmp) / "base")
        subprocess.run([sys.executable, "-m", "snakemake", "results/vocab/vocab_maps.safetensors", "--cores", "all"],
                       cwd=base, check=True, capture_output=True)  # fmt: skip
        stream_cfg = Path(tmp) / "stream.yaml"
        stream_cfg.write_text(f"hidden_states: {{storage: stream, disk_budget: {args.budget}}}\n")
        out = {"budget": args.budget, "wall_s": {}, "peak_hidden_bytes": {}}
        for mode, extra in (("disk", []), ("stream", ["--configfile", "config.yaml", str(stream_cfg)])):
            work = Path(tmp) / mode
            subprocess.run(["cp", "-a", str(base), str(work)], check=True)
            wall, peak = timed_run(work, extra)
            out["wall_s"][mode], out["peak_hidden_bytes"][mode] = round(wall, 1), peak
        out["wall_stream_over_disk"] = round(out["wall_s"]["stream"] / out["wall_s"]["disk"], 2)
        out["peak_stream_over_disk"] = round(out["peak_hidden_bytes"]["stream"] / out["peak_hidden_bytes"]["disk"], 4)
        print(json.dumps(out))


if __name__ == "__main__":
    main()

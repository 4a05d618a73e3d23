"""The benchmark suite's quick mode runs and reports every ratio (figures of this machine; no timing is asserted)."""

import json
import subprocess
import sys

from conftest import REPO


def test_quick_suite_prints_every_ratio(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/run.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| measure | value | ratio | command |"
    measures = [row.split(" | ")[0] for row in table[1:]]
    assert measures == [
        "| no-op dry run, 300 vs 10 shards",
        "| draft step tokens/s (2048 tokens), packed vs sdpa",
        "|   same loss, largest gradient difference",
        "| hidden-state shard bytes, float8 vs bfloat16",
        "| draft step tokens/s, float8 vs bfloat16 shards",
    ]
    results = json.loads(out.read_text())
    dry = results["dry_run"]
    assert set(dry["seconds"]) == {"10", "300"} and dry["ratio_300_to_10"] > 0
    step = results["draft_step"]
    assert step["tokens_per_step"] == 2048 and min(step["tokens_per_s"].values()) > 0
    # the two attentions compute the same loss and gradients on the same batch from the same weights
    agree = step["agreement"]
    assert abs(agree["loss_packed"] - agree["loss_sdpa"]) < 1e-4 * abs(agree["loss_sdpa"])
    assert agree["max_grad_diff"] < 1e-4
    # float8 values and their scales: (H + 4) / 2H of the state bytes at H = 64, with the ids and headers beside
    assert 0.5 < step["fp8"]["bytes_ratio_to_bf16"] < 0.6

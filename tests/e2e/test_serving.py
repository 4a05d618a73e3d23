"""The served benchmark on the embedded default: `vllm serve` with and without the draft, a concurrency sweep, the
served acceptance length against the offline one, what reruns it, and no vLLM process or listening port left after a
success, a failed run or SIGTERM of the job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CORES
from helpers.workflow import copy_build, planned_jobs, snakemake, variant

from draftpipe.bench.serve import port_listening, session_processes

#: |served - offline| acceptance length allowed on the same prompts at temperature 0 (tokens per verifier step): the
#: two engines batch the requests differently, and a verifier step's numerics depend on its batch
TOLERANCE = 0.1
SERVE = {"concurrency": [1, 4], "acceptance_tolerance": TOLERANCE}
SERVER_LINE = re.compile(r"vLLM server \((.+?)\): pid (\d+), port (\d+), log")


def servers(log: Path) -> list[tuple[str, int, int]]:
    """(label, pid, port) of every server the job log says it started."""
    return [(m.group(1), int(m.group(2)), int(m.group(3))) for m in SERVER_LINE.finditer(log.read_text())]


def assert_nothing_left(started: list[tuple[str, int, int]]) -> None:
    assert started
    for label, pid, port in started:
        assert session_processes(pid) == [], f"{label}: processes of the server's session remain"
        assert not port_listening(port), f"{label}: port {port} still listens"


@pytest.fixture(scope="module")
def served(benched, tmp_path_factory):
    work = copy_build(benched, tmp_path_factory.mktemp("serve") / "wf")
    cfg = variant(work, "serve", lambda c: c["bench"].update(serve=SERVE))
    snakemake(work, "results/bench/report.md", "--configfile", cfg)
    return work, cfg


def test_served_sweep_agrees_with_offline_and_leaves_nothing(served):
    work, cfg = served
    serve = json.loads((work / "results/bench/serve.json").read_text())
    offline = json.loads((work / "results/bench/summary.json").read_text())
    assert serve["settings"]["num_speculative_tokens"] == 3 and serve["settings"]["concurrency"] == [1, 4]
    assert serve["settings"]["prompt_sets"] == offline["settings"]["prompt_sets"]  # the same prompts
    off = [r["acceptance_length"] for r in offline["results"] if r["num_speculative_tokens"] == 3]
    for r in serve["results"]:
        d, b = r["draft"], r["baseline"]
        assert r["prompt_set"] == "eval" and d["completed"] == b["completed"] == r["num_prompts"]
        assert d["num_drafts"] > 0 and len(d["per_position_acceptance"]) == 3
        assert d["acceptance_length"] == pytest.approx(1 + d["num_accepted_tokens"] / d["num_drafts"])
        assert abs(d["acceptance_length"] - off[0]) <= TOLERANCE, (d["acceptance_length"], off)
        assert r["speedup"] == pytest.approx(d["output_tokens_per_s"] / b["output_tokens_per_s"])
        assert d["tpot_median_ms"] > 0 and b["itl_p99_ms"] >= b["itl_median_ms"] > 0
        assert r["identical_texts"] >= r["num_prompts"] - 1  # greedy: the draft does not change the text
        print(f"served c={r['concurrency']}: {json.dumps(r)}")
    assert_nothing_left(servers(work / "results/logs/bench_serve.log"))
    md = (work / "results/bench/report.md").read_text()
    assert "## Served: `vllm serve`, concurrency sweep" in md and "![served sweep](serve_sweep.png)" in md
    assert "WARNING" not in md
    assert (work / "results/bench/serve_sweep.png").read_bytes()[:4] == b"\x89PNG"
    # a concurrency list reruns the served benchmark (and the report), nothing else; the report's tolerance only the
    # report, the startup timeout nothing
    more = variant(work, "more", lambda c: c["bench"].update(serve={**SERVE, "concurrency": [1, 2, 8]}))
    assert planned_jobs(work, "--configfile", more, target="results/bench/report.md") == {
        "bench_serve": 1,
        "bench_report": 1,
    }
    tol = variant(work, "tol", lambda c: c["bench"].update(serve={**SERVE, "acceptance_tolerance": 0.5}))
    assert planned_jobs(work, "--configfile", tol, target="results/bench/report.md") == {"bench_report": 1}
    slow = variant(work, "slow", lambda c: c["bench"].update(serve={**SERVE, "startup_timeout": 1200}))
    assert planned_jobs(work, "--configfile", slow, target="results/bench/report.md") == {}


def test_a_failed_or_terminated_served_benchmark_leaves_nothing(served, tmp_path):
    work = copy_build(served[0], tmp_path / "wf")
    log = work / "results/logs/bench_serve.log"
    # a server that does not answer /health in time fails the job, naming the key
    quick = variant(work, "quick", lambda c: c["bench"].update(serve={**SERVE, "startup_timeout": 2}))
    proc = snakemake(work, "results/bench/serve.json", "--configfile", quick, "--forcerun", "bench_serve", check=False)
    assert proc.returncode != 0
    assert "did not answer" in log.read_text() and "(bench.serve.startup_timeout)" in log.read_text()
    assert not (work / "results/bench/serve.json").exists()
    assert_nothing_left(servers(log))
    # SIGTERM of the job while its server serves
    log.unlink()
    cfg = variant(work, "again", lambda c: c["bench"].update(serve=SERVE))
    smk = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", str(CORES), "results/bench/serve.json", "--configfile", cfg],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            started = servers(log) if log.exists() else []
            if started and port_listening(started[0][2]):
                break
            assert smk.poll() is None, "the job ended before its server listened"
            time.sleep(0.5)
        else:
            pytest.fail("no server listened within 300 s")
        pid = started[0][1]
        job_pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the server's parent
        os.kill(job_pid, signal.SIGTERM)  # the job's process (as SLURM's scancel would), not Snakemake
        assert smk.wait(timeout=120) != 0
    finally:
        if smk.poll() is None:
            smk.kill()
    assert "stopped (pid" in log.read_text()
    assert not (work / "results/bench/serve.json").exists()
    assert_nothing_left(servers(log))

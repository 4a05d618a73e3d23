"""The embedded-default pipeline through a real single-node SLURM (scripts/slurm.sh) with profiles/slurm.

Runs when a cluster answers (`sinfo`) and the orchestration environment exists (`bash envs/setup.sh
orchestration`); `.ci/run` starts both and sets DRAFTPIPE_REQUIRE_SLURM=1, which turns a missing cluster into a
failure instead of a skip. DRAFTPIPE_SLURM_SCRATCH names the cluster's scratch folder (its job-completion log);
the cluster keeps finished jobs for an hour (MinJobAge), so `scontrol show job` still shows what each one got.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from helpers.workflow import copy_workflow, variant

ORCH_PYTHON = Path(os.environ.get("DRAFTPIPE_ORCH_PYTHON", REPO / ".venv-orch" / "bin" / "python"))
SCRATCH = os.environ.get("DRAFTPIPE_SLURM_SCRATCH")


def cluster_ready() -> str | None:
    if not shutil.which("sinfo"):
        return "no sinfo on PATH"
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if out.returncode != 0 or "idle" not in out.stdout and "mix" not in out.stdout:
        return f"no idle SLURM node ({out.stdout.strip() or out.stderr.strip()})"
    if not ORCH_PYTHON.exists():
        return f"no orchestration environment at {ORCH_PYTHON}"
    if not SCRATCH:
        return "DRAFTPIPE_SLURM_SCRATCH is not set"
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = cluster_ready()
    if reason:
        if os.environ.get("DRAFTPIPE_REQUIRE_SLURM") == "1":
            pytest.fail(f"SLURM required but unavailable: {reason}")
        pytest.skip(reason)
    return Path(SCRATCH)


def jobcomp_records(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        records.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
    return records


def scontrol_job(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def test_pipeline_runs_through_slurm(cluster, tmp_path):
    work = copy_workflow(tmp_path / "wf")

    # GPU stages ask for one (fake) GPU each, so the scheduler must bind a device per job.
    # The draft trains with 2 ranks on 2 GPUs (torchrun inside the job; gloo on this CPU machine), the global batch
    # 2 packed batches per step. What is tested is the scheduling, so the data is small: 2 answers of at most 64
    # tokens per prompt (most end at the limit: the truncation gate is off), one epoch; every job still runs.
    def slurm_gpus(c):
        for stage in ("completions", "hidden_states"):
            c["resources"][stage]["gpus"] = 1
        c["resources"]["draft"]["gpus"] = 2
        c["draft"].update(batches_per_step=2, epochs=1)
        c["completions"].update(samples_per_prompt=2, max_tokens=64, max_truncated_fraction=1.0)

    cfg = variant(work, "slurm_gpus", slurm_gpus)
    comp = cluster / "log" / "jobcomp.txt"
    before = len(jobcomp_records(comp))
    env = {**os.environ, "DRAFTPIPE_ML_PYTHON": sys.executable, "DRAFTPIPE_SLURM_PARTITION": "debug"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            "timeout",
            "-k",
            "10",
            "2400",
            str(ORCH_PYTHON),
            "-m",
            "snakemake",
            "results/draft/model.safetensors",
            "--workflow-profile",
            "profiles/slurm",
            "--configfile",
            cfg,
            "--slurm-status-command",
            "squeue",
            "--slurm-init-seconds-before-status-checks",
            "1",
            "--seconds-between-status-checks",
            "2",
            "--latency-wait",
            "5",
            "--retries",
            "0",
        ],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wall = time.monotonic() - t0
    print(f"SLURM run: {wall:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert (work / "results/draft/model.safetensors").exists()

    submitted = re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", proc.stdout)
    rules = re.findall(r"^(?:rule|localrule) (\w+):", proc.stdout, flags=re.M)
    assert not [r for r in rules if r.startswith("localrule")]
    assert len(submitted) == 9, proc.stdout[-3000:]  # verifier, 2 prompt_shard, 2 completions, 2 hidden, vocab, draft
    records = {r["JobId"]: r for r in jobcomp_records(comp)[before:]}  # the scheduler's own completion log
    jobs = {slurm_id: scontrol_job(slurm_id) for _, slurm_id in submitted}
    for slurm_id, job in jobs.items():
        assert records[slurm_id]["JobState"] == "COMPLETED", records[slurm_id]
        assert job["JobState"] == "COMPLETED" and job["WorkDir"] == str(work), job
    gpu_jobs = [j for j in jobs.values() if j.get("TresPerJob") == "gres:gpu:1"]
    assert len(gpu_jobs) == 4, [j.get("TresPerJob") for j in jobs.values()]  # 2 completions, 2 hidden
    for log in list((work / "results/logs/completions").glob("*.log")) + list(
        (work / "results/logs/hidden_states").glob("*.log")
    ):
        m = re.search(r"draftpipe.core.gpus: 1 GPU\(s\), CUDA_VISIBLE_DEVICES=(\S+)", log.read_text())
        assert m and re.fullmatch(r"[0-7]", m.group(1)), log
    # the draft: one job with 2 GPUs, its 2 ranks launched by torchrun inside its one task
    draft_job = [j for j in jobs.values() if j.get("TresPerJob") == "gres:gpu:2"]
    assert len(draft_job) == 1 and draft_job[0]["NumNodes"] == "1" and draft_job[0]["NumTasks"] == "1", draft_job
    print("draft job:", {k: draft_job[0].get(k) for k in ("JobId", "TresPerJob", "NumNodes", "NumTasks", "NumCPUs")})
    draft_log = (work / "results/logs/draft.log").read_text()
    m = re.search(r"draftpipe.core.gpus: 2 GPU\(s\), CUDA_VISIBLE_DEVICES=(\S+)", draft_log)
    assert m and re.fullmatch(r"[0-7],[0-7]", m.group(1)), draft_log[-3000:]
    assert (
        "--nproc-per-node=2" in draft_log
        and "[rank 0/2] draftpipe.stages.draft.ranks INFO 2 ranks joined (gloo)" in draft_log
    )
    # Verifier loads per stage: the first job of a stage fills every shard whose input exists; under SLURM the
    # upstream jobs of the other shard may still be running then (no stage-wide ordering), so 1 or 2 loads.
    for stage in ("completions", "hidden_states"):
        logs = [p.read_text() for p in (work / "results/logs" / stage).glob("*.log")]
        loads = sum(log.count("verifier load 1 for") for log in logs)
        print(f"{stage}: {loads} verifier load(s) for 2 shards")
        assert 1 <= loads <= 2 and loads + sum(log.count("found in the store") for log in logs) == 2, stage

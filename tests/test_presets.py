"""Presets dry-run on a machine without their weights, with each job's GPUs, and the plan printed first."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_pipeline import copy_workflow


def dry_run(work, *args, env=None):
    cmd = [sys.executable, "-m", "snakemake", "results/bench/report.md", "-n", *args]
    proc = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def jobs_with_resources(out: str) -> list[tuple[str, dict]]:
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        m = re.match(r"(?:local)?rule (\w+):", block.strip())
        r = re.search(r"resources: (.*)", block)
        if m and r:
            res = dict(kv.split("=", 1) for kv in r.group(1).split(", ") if "=" in kv)
            jobs.append((m.group(1), res))
    return jobs


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("presets"))


@pytest.mark.parametrize("preset,expect", [
    ("kimi-k2.5", {"completions": "8", "hidden_states": "8", "compat_report": "8", "bench_run": "8", "draft": "1"}),
    ("llama-3.1-8b-instruct", {"completions": "1", "hidden_states": "1", "draft": "1"}),
    ("qwen3-8b", {"completions": "1", "hidden_states": "1", "draft": "1"}),
])
def test_preset_dry_runs_without_weights(work, preset, expect):
    out = dry_run(work, "--workflow-profile", "profiles/local", "--configfile", f"configs/{preset}.yaml")
    assert out.index("draftpipe plan (upper bounds):") < out.index("rule prompt_shard:")
    plan = re.search(r"draftpipe plan .*", out).group(0)
    assert "training samples" in plan and "disk needed" in plan
    jobs = jobs_with_resources(out)
    seen = {}
    for rule, res in jobs:
        seen.setdefault(rule, set()).add(res.get("gpu"))
    for rule, gpus in expect.items():
        assert seen[rule] == {gpus}, (rule, seen[rule])
    assert sum(1 for rule, _ in jobs if rule == "completions") == 8  # num_shards
    assert seen["vocab_maps"] == {"0"} and seen["prompt_shard"] == {None}


def test_kimi_plan_numbers(work):
    out = dry_run(work, "--configfile", "configs/kimi-k2.5.yaml")
    plan = re.search(r"draftpipe plan .*", out).group(0)
    # 80 MT-bench + 1319 GSM8K prompts, 5 % eval, 1 sample, hidden states of 3 aux + last layer x 7168 x 2 bytes
    assert "1399 prompts -> 1329 training samples" in plan
    assert "(4 x 7168 x bfloat16 per token)" in plan and "GiB" in plan


def test_slurm_site_settings_reach_the_jobs(work):
    out = dry_run(work, "--configfile", "configs/kimi-k2.5.yaml",
                  env={"DRAFTPIPE_SLURM_PARTITION": "gpu", "DRAFTPIPE_SLURM_ACCOUNT": "llm",
                       "DRAFTPIPE_SLURM_GPU_MODEL": "h200"})
    jobs = dict(jobs_with_resources(out))
    assert jobs["completions"]["slurm_partition"] == "gpu" and jobs["completions"]["slurm_account"] == "llm"
    assert jobs["completions"]["gpu_model"] == "h200"
    assert "gpu_model" not in jobs["vocab_maps"]  # CPU jobs ask for no GPU model


def test_kimi_plan_shows_the_hidden_state_engine(work):
    out = dry_run(work, "--configfile", "configs/kimi-k2.5.yaml")
    engine = re.search(r"hidden_states engine: .*", out).group(0)
    # tensor parallel 8 from resources.hidden_states.gpus; (3 aux + last) x 7168 x 2 bytes = 56 KiB replicated on
    # every GPU; MLA's latent KV cache: 61 layers x (512 + 64) x 2 bytes = 68.6 KiB, also whole on every GPU
    assert "tensor parallel 8" in engine
    assert "hidden-state cache 56.0 KiB per token on every GPU" in engine
    assert "KV cache's 68.6 KiB per token per GPU" in engine


def test_kv_cache_per_token_follows_the_attention():
    from draftpipe.plan import kv_cache_bytes_per_token

    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_cache_bytes_per_token(llama8b, 2, 1) == 32 * 2 * 8 * 128 * 2  # 128 KiB
    assert kv_cache_bytes_per_token(llama8b, 2, 8) == 32 * 2 * 1 * 128 * 2  # one KV head per GPU
    mla = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 64}
    assert kv_cache_bytes_per_token({"text_config": mla}, 2, 8) == 61 * 576 * 2  # the wrapper's text model
    assert kv_cache_bytes_per_token({"hidden_size": 64}) is None

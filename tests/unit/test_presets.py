"""Presets dry-run on a machine without their weights, with each job's GPUs, and the plan printed first."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from helpers.workflow import copy_workflow


def dry_run(work, *args, env=None):
    cmd = [sys.executable, "-m", "snakemake", "results/bench/report.md", "-n", *args]
    proc = subprocess.run(
        cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )
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


@pytest.mark.parametrize(
    "preset,expect",
    [
        ("kimi-k2.5", {"completions": "8", "hidden_states": "8", "compat_report": "8", "bench_run": "8", "draft": "8"}),
        ("llama-3.1-8b-instruct", {"completions": "1", "hidden_states": "1", "draft": "1"}),
        ("qwen3-8b", {"completions": "1", "hidden_states": "1", "draft": "1"}),
    ],
)
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
    # 80 MT-bench + 1319 GSM8K prompts, none empty or repeated; 73 of them in the eval split (5 %, by content id);
    # 1 sample each, of at most max_model_len 8192 tokens (an MT-bench conversation holds two answers of up to
    # 4096 tokens); hidden states of 3 aux + last layer x 7168 x 2 bytes
    assert "1399 prompts -> 1326 training samples of <= 8192 tokens" in plan
    assert "(4 x 7168 x bfloat16 per token)" in plan and "GiB" in plan


def test_slurm_site_settings_reach_the_jobs(work):
    out = dry_run(
        work,
        "--configfile",
        "configs/kimi-k2.5.yaml",
        env={"DRAFTPIPE_SLURM_PARTITION": "gpu", "DRAFTPIPE_SLURM_ACCOUNT": "llm", "DRAFTPIPE_SLURM_GPU_MODEL": "h200"},
    )
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


def test_kimi_plan_trains_the_draft_on_eight_gpus(work):
    out = dry_run(work, "--workflow-profile", "profiles/local", "--configfile", "configs/kimi-k2.5.yaml")
    line = re.search(r"draft training: .*", out).group(0)
    # 8 ranks, one per GPU; a step is 8 packed batches of 8192 tokens whatever the number of ranks
    assert line.startswith(
        "draft training: 8 rank(s) (torchrun, DDP) on 8 GPU(s); each step 8 packed batch(es), 65,536 tokens"
    ), line
    assert dict(jobs_with_resources(out))["draft"]["gpu"] == "8"


def test_draft_on_two_nodes_asks_slurm_for_gpus_per_node_and_a_task_per_node(work):
    import yaml

    cfg = yaml.safe_load((work / "configs/kimi-k2.5.yaml").read_text())
    cfg["resources"]["draft"]["nodes"] = 2
    cfg["draft"]["batches_per_step"] = 16
    (work / "kimi-2nodes.yaml").write_text(yaml.safe_dump(cfg))
    out = dry_run(work, "--configfile", "kimi-2nodes.yaml")
    line = re.search(r"draft training: .*", out).group(0)
    assert line.startswith("draft training: 16 rank(s) (torchrun, DDP) on 8 GPU(s) on each of 2 nodes"), line
    draft = dict(jobs_with_resources(out))["draft"]
    # gres is per node (sbatch --gres=gpu:8), one torchrun task per node, the job's command in the batch step
    assert draft["gres"] == "gpu:8" and draft["nodes"] == "2" and draft["tasks"] == "2" and draft["mpi"] == "srun"
    assert "gpu" not in draft and draft["tasks_per_gpu"] == "0"


def test_multi_node_launch_is_srun_with_a_torchrun_rendezvous():
    from draftpipe.stages.draft.ranks import torchrun_command

    env = {"SLURM_JOB_ID": "4711", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    cmd = torchrun_command(8, "w.launch.json", nnodes=2, env=env, hosts=["gpu07", "gpu08"])
    assert cmd[:5] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert cmd[6:9] == ["-m", "torch.distributed.run", "--nnodes=2"]
    assert "--nproc-per-node=8" in cmd and "--rdzv-backend=c10d" in cmd and "--rdzv-id=4711" in cmd
    assert "--rdzv-endpoint=gpu07:34211" in cmd  # the first node, port 29500 + job id % 10000
    assert cmd[-3:] == ["-m", "draftpipe.stages.draft.ranks", "w.launch.json"]
    one = torchrun_command(2, "w.launch.json")
    assert one[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    with pytest.raises(RuntimeError, match="resources.draft.nodes: 2 needs a SLURM job"):
        torchrun_command(8, "w.launch.json", nnodes=2, env={})


def test_ranks_must_divide_the_global_batch(work):
    import yaml

    cfg = yaml.safe_load((work / "configs/kimi-k2.5.yaml").read_text())
    cfg["draft"]["batches_per_step"] = 4
    (work / "kimi-4.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "results/draft/model.safetensors", "-n", "--configfile", "kimi-4.yaml"]
    proc = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode != 0
    assert "draft.batches_per_step: 4 is not a multiple of the draft's 8 training ranks" in proc.stdout, proc.stdout[
        -2000:
    ]


def test_kv_cache_per_token_follows_the_attention():
    from draftpipe.formats.verifier import kv_cache_bytes_per_token

    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_cache_bytes_per_token(llama8b, 2, 1) == 32 * 2 * 8 * 128 * 2  # 128 KiB
    assert kv_cache_bytes_per_token(llama8b, 2, 8) == 32 * 2 * 1 * 128 * 2  # one KV head per GPU
    mla = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 64}
    assert kv_cache_bytes_per_token({"text_config": mla}, 2, 8) == 61 * 576 * 2  # the wrapper's text model
    assert kv_cache_bytes_per_token({"hidden_size": 64}) is None


def test_the_disk_estimate_follows_the_hidden_state_dtype():
    import copy

    import yaml

    from draftpipe.workflow.config import validate_config
    from draftpipe.workflow.plan import plan

    cfg = yaml.safe_load((REPO / "configs/kimi-k2.5.yaml").read_text())
    validate_config(cfg)
    shape = {"num_hidden_layers": 61, "vocab_size": 163840, "hidden_size": 7168}
    sizes = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        c = copy.deepcopy(cfg)
        c["hidden_states"]["dtype"] = dtype
        sizes[dtype] = plan(c, shape)
    bf16, fp8 = sizes["bfloat16"], sizes["float8_e4m3fn"]
    assert fp8["train_tokens"] == bf16["train_tokens"]
    # per token: 4 states x (7168 one-byte values + a float32 scale) against 4 x 7168 x 2 bytes; id and mask 9 bytes
    per_token = {"bfloat16": 4 * 7168 * 2 + 9, "float8_e4m3fn": 4 * (7168 + 4) + 9}
    assert bf16["hidden_state_bytes"] == bf16["train_tokens"] * per_token["bfloat16"]
    assert fp8["hidden_state_bytes"] == fp8["train_tokens"] * per_token["float8_e4m3fn"]
    assert 0.50 < fp8["hidden_state_bytes"] / bf16["hidden_state_bytes"] < 0.501

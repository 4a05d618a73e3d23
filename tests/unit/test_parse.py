"""What reading the workflow does: no network request, and no prompt source read by a cluster job of another
stage (the job command is the one Snakemake's executors build: `--target-jobs ... --allowed-rules ... --mode
remote`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from helpers.workflow import copy_workflow, variant

# Imported by every Python process started with it on PYTHONPATH: each socket connection fails and is logged.
NO_NETWORK = """
import os, socket

def _refuse(self, address, *a, **k):
    with open(os.environ["DRAFTPIPE_TEST_NETWORK_LOG"], "a") as fh:
        fh.write(repr(address) + "\\n")
    raise OSError("draftpipe-tests: no network while reading the workflow")

socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("parse"))


def _snakemake(workdir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", "Snakefile", "--cores", "1", *args]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env)
    proc.out = proc.stdout + proc.stderr  # Snakemake prints errors on stdout, the plan on stderr
    return proc


def _remote(workdir: Path, target: str, rule: str, *args: str) -> subprocess.CompletedProcess:
    """Read the workflow as a cluster job of `target` does (snakemake_interface_executor_plugins' job args)."""
    return _snakemake(workdir, "--target-jobs", target, "--allowed-rules", rule, "--mode", "remote", "-n", *args)


def test_a_cluster_job_reads_no_prompt_source_it_does_not_need(workdir, tmp_path):
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    source = workdir / config["prompts"]["sources"][0]["path"]
    good = source.read_bytes()
    try:
        source.write_text("not a prompt {\n")
        # the main process plans with the prompt set's fingerprints: a broken source fails there, naming its line
        main = _snakemake(workdir, "-n")
        assert main.returncode != 0
        assert f"prompt source error: {config['prompts']['sources'][0]['path']}:1: malformed JSON line" in main.out
        # a cluster job of another stage reads the workflow without reading the sources
        job = _remote(workdir, "verifier:", "verifier")
        assert job.returncode == 0, job.out[-3000:]
        assert "prompt source error" not in job.out
        # the job that writes a part of the prompt set needs them, and reads them
        part = _remote(workdir, "prompt_shard:part=eval", "prompt_shard")
        assert part.returncode != 0 and "prompt source error" in part.out
    finally:
        source.write_bytes(good)
    assert _snakemake(workdir, "-n").returncode == 0


def _hub_cache(root: Path, repo_id: str, config: dict) -> Path:
    """A Hugging Face hub cache holding only `repo_id`'s config.json (the layout huggingface_hub writes)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "c" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot


def test_reading_the_workflow_makes_no_network_request(workdir, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_NETWORK)
    log = tmp_path / "network.log"
    hub = tmp_path / "hub"
    verifier_config = json.loads((REPO / "tests/data/verifiers/tiny-qwen3.json").read_text())
    _hub_cache(hub, "draftpipe-tests/tiny-qwen3", verifier_config)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "DRAFTPIPE_TEST_NETWORK_LOG": str(log),
        "HF_HUB_CACHE": str(hub),
    }

    def hub_verifier(repo_id):
        def change(cfg):
            cfg["verifier"]["path"] = repo_id
            cfg["hidden_states"]["aux_layer_ids"] = [1, 2]

        return variant(workdir, repo_id.split("/")[1], change)

    cached = _snakemake(workdir, "--configfile", hub_verifier("draftpipe-tests/tiny-qwen3"), "-n", env=env)
    assert cached.returncode == 0, cached.out[-3000:]
    # planned against the cached config: 2 aux ids + the last layer, hidden size 64; a KV cache of 4 layers x (K, V)
    # x 2 KV heads x head_dim 32 x 4 bytes (float32) per token, where the embedded stories260K's is 2.5 KiB
    assert "hidden states (3 x 64 x bfloat16 per token)" in cached.stderr, cached.out[-3000:]
    assert "beside the KV cache's 2.0 KiB per token per GPU" in cached.stderr
    uncached = _snakemake(workdir, "--configfile", hub_verifier("draftpipe-tests/not-cached"), "-n", env=env)
    assert uncached.returncode != 0
    assert "'draftpipe-tests/not-cached' is not a local path, and its config.json is not in" in uncached.out
    assert "hf download draftpipe-tests/not-cached" in uncached.out
    assert not log.exists() or log.read_text() == ""
    # the socket guard is live in those processes: a request from one is refused and logged
    probe = subprocess.run(
        [sys.executable, "-c", "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0 and "127.0.0.1" in log.read_text()


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_the_conda_environment_of_the_rules_has_the_packages_of_the_venv(name):
    """`--sdm conda` (envs/<name>.yaml, every rule's `conda:`) installs what envs/setup.sh installs (envs/<name>.txt)."""
    env = yaml.safe_load((REPO / f"envs/{name}.yaml").read_text())
    assert "python=3.11" in env["dependencies"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    venv = [line.strip() for line in (REPO / f"envs/{name}.txt").read_text().splitlines()]
    assert [p for p in pip if not p.startswith("--")] == [line for line in venv if line and not line.startswith("#")]
    rules = "".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
    assert rules.count("conda:\n") == rules.count("script:\n") == 13


def test_config_errors_print_one_line_without_a_traceback(workdir, tmp_path):
    """A config error stops the workflow with `config error: ...` and exit status 1, without a `File "...", line N`
    fragment that reads as a crash; a tab in config.yaml is named by file and line."""
    over = tmp_path / "over.yaml"
    over.write_text("completions:\n  temprature: 0.5\n")
    proc = _snakemake(workdir, "-n", "--configfile", str(over))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "config error: completions.temprature: unknown key (known keys: max_tokens, max_truncated_fraction, "
        "reasoning, samples_per_prompt, seed, temperature, too_long, top_p, turns)"
    )
    assert 'File "' not in proc.out and "Traceback" not in proc.out and "WorkflowError" not in proc.out
    config = workdir / "config.yaml"
    good = config.read_text()
    lines = good.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("  ") and i > 0)
    try:
        config.write_text("".join(lines[:at] + ["\t" + lines[at][2:]] + lines[at + 1 :]))
        proc = _snakemake(workdir, "-n")
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines()[-1] == (
            f"config error: config.yaml:{at + 1}:1: a tab indents this line; YAML indents with spaces only"
        )
        assert 'File "' not in proc.out
    finally:
        config.write_text(good)


def test_the_plan_warns_of_text_a_source_s_mapping_leaves_out(workdir, tmp_path):
    alpaca = workdir / "alpaca.jsonl"
    rows = [
        {"instruction": "Tell a story about a cat.", "input": "The cat is named Tom.", "output": "Once..."},
        {"instruction": "Tell a story about a dog.", "input": "", "output": "Once..."},
    ]
    alpaca.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    cfg = variant(
        workdir,
        "alpaca",
        lambda c: c["prompts"].update(sources=[{"path": "alpaca.jsonl", "field": "instruction"}], eval_fraction=0.0),
    )
    proc = _snakemake(workdir, "-n", "--configfile", cfg)
    assert proc.returncode == 0, proc.out[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        "warning: prompts.sources[0] (alpaca.jsonl): 4 of 8 record(s) have text under 'input', which field "
        "'instruction' leaves out of the prompt (the first at alpaca.jsonl:1); to keep it, combine the keys "
        "(field: [instruction, input]) or write a template; to silence this, add ignore: [input]"
    ]
    assert not [line for line in _snakemake(workdir, "-n").stderr.splitlines() if line.startswith("warning: ")]

"""Shared fixtures: the repository root and the embedded default verifier converted once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO / "draftpipe" / "data" / "stories260K" / "stories260K.gguf"
TINYSTORIES = REPO / "draftpipe" / "data" / "prompts" / "tinystories_evaluation_prompts.jsonl"


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory) -> Path:
    """stories260K as a Hugging Face directory with head_dim 32 (what the `verifier` rule builds)."""
    import torch

    from draftpipe.verifier import convert_gguf

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("verifier") / "stories260K"
    convert_gguf(GGUF, out, max_position_embeddings=512)
    return out


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """The embedded default built to the draft once per session in a copy of the workflow (uninterrupted run)."""
    from workflow import copy_workflow, small_extraction_calls, snakemake

    work = copy_workflow(tmp_path_factory.mktemp("workflow"))
    small_extraction_calls(work)  # the fault test compares bytes with this run: the same vLLM calls
    proc = snakemake(
        work, "results/draft/model.safetensors", "results/prompts/stats.json", "results/completions/stats.json"
    )
    (work.parent / "build.out").write_text(proc.stdout + proc.stderr)  # what the console showed
    return work


TINY_CONFIGS = REPO / "tests" / "data" / "verifiers"


@pytest.fixture(scope="session")
def tiny_verifier(verifier_dir, tmp_path_factory):
    """``tiny_verifier(name)``: the verifier of ``tests/data/verifiers/<name>.json`` with random weights (seed 0)
    and stories260K's tokenizer, built once per session; ``"stories260K"`` is the embedded default."""
    from draftpipe.verifier import build_random_verifier

    built: dict[str, Path] = {"stories260K": verifier_dir}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_random_verifier(
                TINY_CONFIGS / f"{name}.json", tmp_path_factory.mktemp("tiny") / name, verifier_dir
            )
        return built[name]

    return get

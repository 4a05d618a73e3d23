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
    convert_gguf(GGUF, out)
    return out


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """The embedded default built to the draft once per session in a copy of the workflow (uninterrupted run)."""
    from workflow import copy_workflow, snakemake

    work = copy_workflow(tmp_path_factory.mktemp("workflow"))
    snakemake(work, "results/draft/model.safetensors", "results/prompts/stats.json")
    return work

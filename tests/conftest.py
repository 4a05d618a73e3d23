"""Shared fixtures: the repository root, the embedded default verifier converted once per session, the embedded
default built once per session (no test writes into that build: tests that change it work in a copy), a copy of it
benchmarked once, and the ``unit`` / ``e2e`` marker of every test from its folder."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO / "draftpipe" / "data" / "stories260K" / "stories260K.gguf"
TINYSTORIES = REPO / "draftpipe" / "data" / "prompts" / "tinystories_evaluation_prompts.jsonl"


def pytest_collection_modifyitems(config, items):
    """Mark each test ``unit`` or ``e2e`` after its folder (``tests/unit``, ``tests/e2e``)."""
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in ("unit", "e2e"):
            item.add_marker(kind)


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory) -> Path:
    """stories260K as a Hugging Face directory with head_dim 32 (what the `verifier` rule builds)."""
    import torch

    from draftpipe.stages.verifier import convert_gguf

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("verifier") / "stories260K"
    convert_gguf(GGUF, out, max_position_embeddings=512)
    return out


def tree_state(work: Path) -> dict[str, tuple[int, int]]:
    """``{path: (size, mtime_ns)}`` of every file of a workflow copy outside ``.snakemake/`` (where a dry run keeps
    its locks and the workflow its caches)."""
    return {
        str(p.relative_to(work)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in work.rglob("*")
        if p.is_file() and not p.is_symlink() and ".snakemake" not in p.relative_to(work).parts
    }


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """The embedded default built to the draft once per session in a copy of the workflow (uninterrupted run).

    No test may change it (a test that runs jobs or edits files works in :func:`helpers.workflow.copy_build`, and
    config variants are written beside it): at the end of the session every file must have the size and mtime it
    had after the build, else the fixture fails naming the files."""
    from helpers.workflow import copy_workflow, small_extraction_calls, snakemake

    work = copy_workflow(tmp_path_factory.mktemp("workflow"))
    small_extraction_calls(work)  # the fault test compares bytes with this run: the same vLLM calls
    proc = snakemake(
        work, "results/draft/model.safetensors", "results/prompts/stats.json", "results/completions/stats.json"
    )
    (work.parent / "build.out").write_text(proc.stdout + proc.stderr)  # what the console showed
    before = tree_state(work)
    yield work
    after = tree_state(work)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        pytest.fail(f"tests changed the session build {work}: {changed[:20]}")


@pytest.fixture(scope="session")
def benched(built, tmp_path_factory) -> Path:
    """A copy of the session build with its offline vLLM benchmark (``bench_run``, and the compat report it needs)
    run once, shared by the tests of the benchmark and of the served sweep: each works in a copy of it
    (:func:`helpers.workflow.copy_build`), so the measurement is made once per session, not once per test."""
    from helpers.workflow import copy_build, snakemake

    work = copy_build(built, tmp_path_factory.mktemp("benched") / "wf")
    snakemake(work, "results/bench/summary.json")
    return work


TINY_CONFIGS = REPO / "tests" / "data" / "verifiers"


@pytest.fixture(scope="session")
def tiny_verifier(verifier_dir, tmp_path_factory):
    """``tiny_verifier(name)``: the verifier of ``tests/data/verifiers/<name>.json`` with random weights (seed 0)
    and stories260K's tokenizer, built once per session; ``"stories260K"`` is the embedded default."""
    from helpers.verifiers import build_random_verifier

    built: dict[str, Path] = {"stories260K": verifier_dir}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_random_verifier(
                TINY_CONFIGS / f"{name}.json", tmp_path_factory.mktemp("tiny") / name, verifier_dir
            )
        return built[name]

    return get

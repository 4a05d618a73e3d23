"""The draft folder as it is published: the model card the main job writes beside the draft (Hub metadata read back
as the Hub reads it, the benchmark's numbers), no file naming a folder of the machine that built it, and
``draftpipe-publish --dry-run`` listing what it would push."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.workflow import copy_build, planned_jobs, snakemake, variant


def test_the_draft_folder_has_a_model_card_no_local_path_and_publishes(benched, tmp_path):
    from huggingface_hub import ModelCard

    work = copy_build(benched, tmp_path / "wf")
    card_path = work / "results/draft/README.md"
    assert planned_jobs(work, target="results/draft/README.md") == {"model_card": 1}
    snakemake(work, "results/draft/README.md")
    card = ModelCard.load(card_path)
    assert card.data.base_model == "karpathy/tinyllamas" and card.data.license == "mit"
    assert card.data.library_name == "vllm" and "eagle3" in card.data.tags and card.data.datasets is None
    config = json.loads((work / "results/draft/config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "karpathy/tinyllamas"
    # the card's table is the benchmark's summary
    summary = json.loads((work / "results/bench/summary.json").read_text())
    for row in summary["results"]:
        assert (
            f"| eval | {row['num_speculative_tokens']} | {row['batch_size']} | {row['temperature']} | "
            f"{row['acceptance_length']:.2f} |"
        ) in card.text
    stats = json.loads((work / "results/prompts/stats.json").read_text())
    assert f"`tinystories_evaluation_prompts.jsonl`: {stats['kept']} kept of {stats['read']}" in card.text

    # no file of the draft folder names a folder of this machine (the workflow copy, the one it was copied from)
    roots = {str(work), str(work.resolve()), str(benched), str(benched.resolve()), str(Path.home())}
    files = [p for p in (work / "results/draft").rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"README.md", "config.json", "model.safetensors", "metrics.csv"}
    for path in files:
        data = path.read_bytes()
        assert not [r for r in roots if r.encode() in data], path

    proc = subprocess.run(
        [str(Path(sys.executable).parent / "draftpipe-publish"), str(work / "results/draft"), "--repo",
         "draftpipe-tests/stories260K-eagle3", "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("draftpipe-publish: would upload 4 files, ")
    assert [line.split()[0] for line in lines[1:]] == ["README.md", "config.json", "metrics.csv", "model.safetensors"]

    # the card's tags rewrite the card only; the recorded verifier is the draft's config: the draft job reruns
    tags = variant(work, "tags", lambda c: c["card"].update(tags=["tiny"]))
    assert planned_jobs(work, "--configfile", tags, target="results/draft/README.md") == {"model_card": 1}
    renamed = variant(work, "hub_id", lambda c: c["verifier"].update(hub_id="ORG/renamed"))
    assert planned_jobs(work, "--configfile", renamed, target="results/draft/README.md") == {
        "draft": 1,
        "compat_report": 1,
        "bench_run": 1,
        "model_card": 1,
    }

"""A prompt set from the Hugging Face Hub: the embedded default's 44 TinyStories prompts as a real dataset built with
``datasets`` and laid out as the Hub cache lays out a download (:mod:`helpers.hub`), read offline
(``HF_HUB_OFFLINE=1``) through the code path of a Hub download. The records are the file's, so the session build
(made from the file) is the build of the dataset; a new revision that edits one prompt reruns exactly the prompt
parts it changes and what is built from them."""

from __future__ import annotations

import json

import yaml
from conftest import TINYSTORIES
from helpers.hub import hub_dataset, offline_hub
from helpers.workflow import copy_build, planned_jobs, snakemake, variant

from draftpipe.formats.prompts import is_eval, prompt_id, shard_of

REPO_ID = "draftpipe-tests/tinystories"
TARGET = "results/draft/model.safetensors"


def part_of(text: str, prompts: dict) -> str:
    """The prompt-set part (``train_NNNNN`` or ``eval``) a plain-text prompt falls in."""
    pid = prompt_id([{"role": "user", "content": text}])
    if is_eval(pid, prompts["eval_fraction"], prompts["split_seed"]):
        return "eval"
    return f"train_{shard_of(pid, prompts['num_shards']):05d}"


def test_a_hub_dataset_gives_the_default_s_prompt_set_and_a_new_revision_reruns_what_it_changes(
    built, tmp_path, monkeypatch
):
    cache = offline_hub(monkeypatch, tmp_path / "hf")
    rows = [json.loads(line) for line in TINYSTORIES.read_text().splitlines() if line.strip()]
    first = hub_dataset(cache, REPO_ID, rows)
    cfg = variant(built, "hub", lambda c: c["prompts"].update(sources=[{"dataset": REPO_ID}]))
    prompts = yaml.safe_load((built / "config.yaml").read_text())["prompts"]

    # the same records: the draft built from the file is up to date; only the prompt set's counts name the source
    plan = snakemake(built, TARGET, "--configfile", cfg, "-n")
    assert f"prompt sources: hf://datasets/{REPO_ID}@{first[:12]}/train 44 records (44 kept)" in plan.stderr
    assert planned_jobs(built, "--configfile", cfg) == {}
    assert planned_jobs(built, "--configfile", cfg, target="results/prompts/stats.json") == {"prompt_set": 1}

    # a new revision edits one training prompt: its old part loses it, its new part gains it
    i = next(
        i
        for i, r in enumerate(rows)
        if "eval" not in {part_of(r["prompt"], prompts), part_of(r["prompt"] + " The end.", prompts)}
    )
    edited = [*rows[:i], {"prompt": rows[i]["prompt"] + " The end."}, *rows[i + 1 :]]
    second = hub_dataset(cache, REPO_ID, edited)
    parts = {part_of(rows[i]["prompt"], prompts), part_of(edited[i]["prompt"], prompts)}
    n = len(parts)
    assert planned_jobs(built, "--configfile", cfg) == {
        "prompt_shard": n, "completions": n, "hidden_states": n, "vocab_maps": 1, "draft": 1,
    }  # fmt: skip

    # the prompt-set jobs read the new revision themselves
    work = copy_build(built, tmp_path / "wf")
    snakemake(work, "results/prompts/stats.json", "--configfile", cfg)
    label = f"hf://datasets/{REPO_ID}@{second[:12]}/train"
    stats = json.loads((work / "results/prompts/stats.json").read_text())
    assert stats["per_source"] == {label: {"read": 44, "kept": 44}}
    for part in sorted({f"train_{s:05d}" for s in range(prompts["num_shards"])} | {"eval"}):
        mine, ref = (p / f"results/prompts/{part}.jsonl" for p in (work, built))
        if part in parts:
            records = [json.loads(line) for line in mine.read_text().splitlines()]
            assert {r["source"] for r in records} == {label}
            assert sum(r["messages"][0]["content"] == edited[i]["prompt"] for r in records) == (
                part == part_of(edited[i]["prompt"], prompts)
            )
        else:
            assert mine.read_bytes() == ref.read_bytes(), part  # not rewritten: the file's records, the file's lines

    # a dataset the cache does not hold, offline: one line naming the source and what to do, before any job
    absent = variant(built, "absent", lambda c: c["prompts"].update(sources=[{"dataset": "draftpipe-tests/absent"}]))
    proc = snakemake(work, TARGET, "--configfile", absent, "-n", check=False)
    assert proc.returncode != 0
    assert (
        "prompt source error: prompts.sources[0].dataset: draftpipe-tests/absent (revision main) is not in the Hub "
        f"cache {cache} and HF_HUB_OFFLINE is set: download it once on line (`hf download draftpipe-tests/absent "
        "--repo-type dataset`) or unset HF_HUB_OFFLINE"
    ) in proc.stderr, proc.stderr[-2000:]

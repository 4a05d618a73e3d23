"""Prompt sources on the Hugging Face Hub (``prompts.sources[i].dataset``), read offline from a real dataset laid
out as the Hub cache lays out a download (:mod:`helpers.hub`): the same records as the file they came from, the
first ``max_records`` rows only, a new revision changing the fingerprint of exactly the shards whose records it
changes, and errors that name the source and what to do."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, TINYSTORIES
from helpers.hub import hub_dataset, offline_hub

from draftpipe.formats.hub_sources import SHORTCUTS, HubSourceError, resolve_dataset, rows_cache
from draftpipe.formats.prompts import PromptFormatError, is_eval, load_prompts, prompt_id, shard_of
from draftpipe.workflow.config import ConfigError
from draftpipe.workflow.fingerprint import prompt_fingerprints
from draftpipe.workflow.sources import check_sources

REPO_ID = "draftpipe-tests/tinystories"


def tinystories_rows() -> list[dict]:
    return [json.loads(line) for line in TINYSTORIES.read_text().splitlines() if line.strip()]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hub cache holding the 44 TinyStories prompts as ``draftpipe-tests/tinystories`` (``main``)."""
    cache = offline_hub(monkeypatch, tmp_path)
    return cache, hub_dataset(cache, REPO_ID, tinystories_rows())


def test_a_hub_dataset_gives_the_records_of_the_file_it_holds(hub):
    _, commit = hub
    from_file, file_stats = load_prompts([{"path": str(TINYSTORIES)}])
    from_hub, hub_stats = load_prompts([{"dataset": REPO_ID}])
    assert [(r["id"], r["messages"]) for r in from_hub] == [(r["id"], r["messages"]) for r in from_file]
    assert len(from_hub) == 44 and hub_stats.kept == file_stats.kept == 44
    label = f"hf://datasets/{REPO_ID}@{commit[:12]}/train"
    assert {r["source"] for r in from_hub} == {label}
    # row N of the split is line N of the file the rows came from
    assert sorted((r["line"], r["id"]) for r in from_hub) == sorted((r["line"], r["id"]) for r in from_file)
    assert hub_stats.per_source == {label: {"read": 44, "kept": 44}}


def test_max_records_reads_the_first_rows_only_and_keeps_them_for_the_next_read(hub):
    _, commit = hub
    records, stats = load_prompts([{"dataset": REPO_ID, "max_records": 5}])
    assert stats.read == 5 and sorted(r["line"] for r in records) == [1, 2, 3, 4, 5]
    kept = rows_cache() / "draftpipe-tests--tinystories" / commit / "default" / "train.5.jsonl"
    assert [json.loads(line) for line in kept.read_text().splitlines()] == tinystories_rows()[:5]
    # the next read of the same commit reads the kept rows, not the dataset
    kept.write_text(json.dumps({"prompt": "Once upon a time there was a kept row."}) + "\n")
    again, _ = load_prompts([{"dataset": REPO_ID, "max_records": 5}])
    assert [r["messages"][0]["content"] for r in again] == ["Once upon a time there was a kept row."]


def test_a_new_revision_changes_the_fingerprint_of_exactly_the_shards_it_changes(hub):
    cache, first = hub
    before = prompt_fingerprints([{"dataset": REPO_ID}], 0.1, 4, 0)
    rows = tinystories_rows()
    rows[7] = {"prompt": rows[7]["prompt"] + " The end."}
    second = hub_dataset(cache, REPO_ID, rows)  # main moves to a new commit
    assert second != first
    after = prompt_fingerprints([{"dataset": REPO_ID}], 0.1, 4, 0)
    # an edited prompt is a new record (ids are content hashes): the part that held the old one and the part that
    # holds the new one change, the others keep their fingerprints
    old_id, new_id = (prompt_id([{"role": "user", "content": r[7]["prompt"]}]) for r in (tinystories_rows(), rows))
    parts = {"eval" if is_eval(i, 0.1, 0) else f"train_{shard_of(i, 4)}" for i in (old_id, new_id)}
    changed = {f"train_{i}" for i, (a, b) in enumerate(zip(before["train"], after["train"])) if a != b}
    assert changed | ({"eval"} if before["eval"] != after["eval"] else set()) == parts
    # the old commit is still readable by name
    pinned = prompt_fingerprints([{"dataset": REPO_ID, "revision": first}], 0.1, 4, 0)
    assert pinned["train"] == before["train"] and pinned["eval"] == before["eval"]


def test_a_record_error_names_the_dataset_and_row(hub, tmp_path):
    cache, _ = hub
    rows = [{"messages": [{"role": "user", "content": "fine"}]}, {"messages": [{"role": "robot", "content": "hi"}]}]
    commit = hub_dataset(cache, "draftpipe-tests/bad", rows)
    with pytest.raises(PromptFormatError, match=rf"hf://datasets/draftpipe-tests/bad@{commit[:12]}/train: row 2\b"):
        load_prompts([{"dataset": "draftpipe-tests/bad"}])


def test_a_dataset_neither_cached_nor_reachable_is_refused_naming_what_to_do(hub):
    with pytest.raises(HubSourceError) as err:
        load_prompts([{"dataset": "draftpipe-tests/absent"}])
    msg = str(err.value)
    assert msg.startswith("prompts.sources[0].dataset: draftpipe-tests/absent (revision main) is not in the Hub cache")
    assert "HF_HUB_OFFLINE is set" in msg and "hf download draftpipe-tests/absent --repo-type dataset" in msg
    with pytest.raises(HubSourceError, match=r"revision v9\) is not in the Hub cache"):
        load_prompts([{"dataset": REPO_ID, "revision": "v9"}])


def test_an_unknown_split_is_refused_naming_the_dataset(hub):
    with pytest.raises(HubSourceError, match=rf"prompts.sources\[0\]: hf://datasets/{REPO_ID}@\w{{12}}/test cannot"):
        load_prompts([{"dataset": REPO_ID, "split": "test"}])


def test_an_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch):
    """On line but with no route to the Hub (a port nothing listens on), the cached commit is read."""
    _, commit = hub
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert resolve_dataset({"dataset": REPO_ID, "revision": "main"}, "prompts.sources[0]").sha == commit
    # a commit names itself: no request, the cached snapshot read
    pinned = resolve_dataset({"dataset": REPO_ID, "revision": commit}, "prompts.sources[0]")
    assert pinned.sha == commit and pinned.snapshot.endswith(f"snapshots/{commit}")
    with pytest.raises(HubSourceError, match=r"the Hub cannot be reached \(\w+"):
        resolve_dataset({"dataset": "draftpipe-tests/absent"}, "prompts.sources[0]")


@pytest.mark.parametrize(
    "source, message",
    [
        ({"path": "p.jsonl", "dataset": REPO_ID}, "prompts.sources[0]: give path (a local .jsonl"),
        ({"field": "text"}, "prompts.sources[0]: give path (a local .jsonl"),
        ({"path": str(TINYSTORIES), "split": "test"}, "prompts.sources[0].split: a setting of a Hub dataset"),
        ({"dataset": "sharegtp"}, "prompts.sources[0].dataset: 'sharegtp' is neither a Hub dataset id (ORG/NAME)"),
        ({"dataset": REPO_ID, "field": "a", "template": "{a}"}, "prompts.sources[0]: give field or template"),
    ],
)
def test_source_entries_are_checked_when_the_workflow_is_read(source, message):
    with pytest.raises(ConfigError) as err:
        check_sources([source])
    assert str(err.value).startswith(message)
    with pytest.raises(ConfigError, match=r"prompts.sources\[1\]: dataset openai/gsm8k is listed twice"):
        check_sources(
            [{"dataset": "gsm8k"}, {"dataset": "openai/gsm8k", "name": "main", "split": "train", "field": "question"}]
        )


def test_shortcuts_name_the_sets_speculators_names():
    """Each shortcut is the repository, config and split of speculators' preset of the same name."""
    from speculators.data_generation.configs import DATASET_CONFIGS

    for name, short in SHORTCUTS.items():
        preset = DATASET_CONFIGS[name]
        assert (short["dataset"], short.get("name"), short["split"]) == (preset.hf_path, preset.subset, preset.split)
        if preset.prompt_field and "field" in short:
            assert short["field"] == preset.prompt_field


def test_the_orchestration_environment_reads_a_hub_source_through_the_ml_environment(hub):
    """Snakemake on a login node runs in the orchestration environment, which has no ``datasets``: the workflow's
    parse there streams the rows with the ML environment's interpreter, and reads the same records."""
    import subprocess

    orch = REPO / ".venv-orch" / "bin" / "python"
    if not orch.exists():
        pytest.skip("no orchestration environment (envs/setup.sh orchestration)")
    code = (
        "import importlib.util, json; assert importlib.util.find_spec('datasets') is None; "
        "from draftpipe.formats.prompts import load_prompts; "
        f"print(json.dumps([r['id'] for r in load_prompts([{{'dataset': '{REPO_ID}', 'max_records': 7}}])[0]]))"
    )
    proc = subprocess.run([orch, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = [r["id"] for r in load_prompts([{"path": str(TINYSTORIES), "max_records": 7}])[0]]
    assert json.loads(proc.stdout) == expected
    bad = code.replace("'max_records': 7", "'split': 'test'")
    proc = subprocess.run([orch, "-c", bad], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert re.search(
        rf"HubSourceError: prompts.sources\[0\]: hf://datasets/{REPO_ID}@\w{{12}}/test cannot be read", proc.stderr
    )

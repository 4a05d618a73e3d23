"""The draft's model card: ``README.md`` with the Hub's YAML metadata (``huggingface_hub.ModelCardData``) and what a
user of the draft asks first: which verifier, how to serve it, what it was trained on, whether vLLM loads it and
how often its tokens are accepted."""

from __future__ import annotations

import re
from pathlib import Path

from draftpipe.stages.draft.metrics import exported_row, selection_line

#: tags every draft's card carries (the Hub's speculator cards use the first four), the method's (``eagle3``,
#: ``dflash``) in second place
BASE_TAGS = ("speculative-decoding", "eagle3", "speculators", "vllm", "draftpipe")

#: how the card names each method
METHOD_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


def card_metadata(
    base_model: str | None,
    license: str | None,
    datasets: list[str],
    tags: list[str] | tuple[str, ...] = (),
    method: str = "eagle3",
) -> dict:
    """The card's YAML metadata as a dict of the Hub's model-card keys (absent keys are left out).

    Args:
        base_model: the verifier's Hub id (the Hub links the draft from its page), or None.
        license: a Hub licence id (``mit``, ``apache-2.0``, ``other``), or None.
        datasets: Hub dataset ids the prompts came from.
        tags: added to :data:`BASE_TAGS` (order kept, no repeats).
        method: the draft's method (its ``speculators_model_type``), the second tag in place of ``eagle3``.
    """
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        base_model=base_model,
        license=license,
        library_name="vllm",
        pipeline_tag="text-generation",
        datasets=list(datasets) or None,
        tags=list(dict.fromkeys([BASE_TAGS[0], method, *BASE_TAGS[2:], *tags])),
    )
    return data.to_dict()


def _source_name(label: str) -> str:
    """A prompt source as the card names it: a Hub source's label (``hf://datasets/ORG/NAME@<commit>/<split>``) as
    it is, a local file by its name only (its folder is the builder's)."""
    return label if label.startswith("hf://") else Path(label).name


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of the draft's ``metrics.csv`` (one per epoch) as dicts, empty cells None."""
    import pandas as pd

    frame = pd.read_csv(path)
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def render_card(
    *,
    draft_config: dict,
    metrics: list[dict],
    prompt_stats: dict,
    completion_stats: dict,
    compat: dict,
    bench: dict | None,
    verifier: str,
    base_model: str | None,
    license: str | None,
    datasets: list[str],
    tags: list[str],
    title: str,
    sampling: dict,
) -> str:
    """The model card's text (``---`` YAML metadata ``---`` then Markdown).

    Args:
        draft_config: the draft's ``config.json``.
        metrics: :func:`read_metrics` of its ``metrics.csv`` (its ``exported`` column marks the exported epoch).
        prompt_stats: ``results/prompts/stats.json`` (``read``, ``kept``, ``train``, ``eval``, ``per_source``).
        completion_stats: ``results/completions/stats.json`` (``prompts``, ``rows``, ``truncated``).
        compat: ``results/report/compat.json`` (``ok``, ``counts``, ``live``).
        bench: ``results/bench/summary.json`` (``results``: one row per k, batch size and temperature), or None.
        verifier: what the draft's config records as its verifier (its Hub id, or its name).
        base_model, license, datasets, tags: :func:`card_metadata`'s.
        title: the card's heading.
        sampling: how the verifier's answers were sampled (``samples_per_prompt``, ``temperature``, ``top_p``,
            ``max_tokens``).
    """
    from huggingface_hub import ModelCard, ModelCardData

    meta = card_metadata(base_model, license, datasets, tags, draft_config.get("speculators_model_type") or "eagle3")
    lines = [f"# {title}", "", *_usage_lines(draft_config, verifier, linked=bool(base_model))]
    lines += _data_lines(prompt_stats, completion_stats, sampling)
    lines += _training_lines(metrics) + _compat_lines(compat) + _bench_lines(bench)
    body = "\n".join(lines) + "\n"
    return str(ModelCard(f"---\n{ModelCardData(**meta).to_yaml()}\n---\n\n{body}"))


def _usage_lines(draft_config: dict, verifier: str, linked: bool) -> list[str]:
    """What the draft is, and the ``vllm serve`` line that uses it."""
    layer = draft_config.get("transformer_layer_config") or {}
    methods = (draft_config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens", 3)
    vocab = draft_config.get("draft_vocab_size") or layer.get("vocab_size")
    method = draft_config.get("speculators_model_type") or "eagle3"
    aux = draft_config.get("eagle_aux_hidden_state_layer_ids" if method == "eagle3" else "aux_hidden_state_layer_ids")
    name = f"[{verifier}](https://huggingface.co/{verifier})" if linked else f"the verifier `{verifier}`"
    block = (
        f" (a block of {draft_config.get('block_size', '?')}: {k} token(s) proposed in one pass)"
        if method == "dflash"
        else ""
    )
    article = "An" if METHOD_NAMES.get(method, method)[0] in "AEIOU" else "A"
    return [
        f"{article} {METHOD_NAMES.get(method, method)} draft{block} for {name} in the speculators format: "
        f"{layer.get('num_hidden_layers', '?')} decoder "
        f"layer(s), hidden size {layer.get('hidden_size', '?')}, head_dim {layer.get('head_dim', '?')}, a draft "
        f"vocabulary of {vocab} of the verifier's {layer.get('vocab_size', '?')} tokens (d2t/t2d), aux hidden states "
        f"of layers {aux}. Built by draftpipe: the verifier regenerated every answer it was trained on.",
        "",
        "## Use with vLLM",
        "",
        "```bash",
        f"vllm serve {verifier} \\",
        f'  --speculative-config \'{{"model": "<this repository>", "num_speculative_tokens": {k}, '
        f'"method": "{method}"}}\'',
        "```",
    ]


def _data_lines(prompt_stats: dict, completion_stats: dict, sampling: dict) -> list[str]:
    """The prompts (per source) and the verifier's answers the draft was trained on."""
    lines = [
        "",
        "## Training data",
        "",
        f"- Prompts: {prompt_stats.get('kept', '?')} kept of {prompt_stats.get('read', '?')} read "
        f"({prompt_stats.get('train', '?')} to train on, {prompt_stats.get('eval', '?')} held out):",
    ]
    for label, counts in sorted((prompt_stats.get("per_source") or {}).items()):
        lines.append(f"  - `{_source_name(label)}`: {counts.get('kept', '?')} kept of {counts.get('read', '?')}")
    lines.append(
        f"- Answers: {completion_stats.get('rows', '?')} generated by the verifier for "
        f"{completion_stats.get('prompts', '?')} prompts ({sampling.get('samples_per_prompt', '?')} per prompt, "
        f"temperature {sampling.get('temperature', '?')}, top_p {sampling.get('top_p', '?')}, at most "
        f"{sampling.get('max_tokens', '?')} tokens; {completion_stats.get('truncated', 0)} cut at that length)"
    )
    return lines


def _training_lines(metrics: list[dict]) -> list[str]:
    """Epochs, steps, the exported epoch (which and why: ``draft.select``), its losses and validation accuracy per
    TTT step (EAGLE-3) or per block position with the expected accepted length (DFlash: ``val_position_<i>_acc``,
    ``val_eal``)."""
    if not metrics:
        return []
    row, _ = exported_row(metrics)
    steps = sorted((key[len("val_full_acc_") :] for key in row if key.startswith("val_full_acc_")), key=int)
    acc = ", ".join(_fmt(row.get(f"val_full_acc_{s}")) for s in steps)
    line = f"- Validation accuracy of the draft's token at each TTT step (all earlier ones right): {acc or 'n/a'}"
    if row.get("val_eal") is not None and not steps:
        slots = sorted(int(k.split("_")[2]) for k in row if re.fullmatch(r"val_position_\d+_acc", k))
        acc = ", ".join(_fmt(row.get(f"val_position_{i}_acc")) for i in slots)
        line = (
            f"- Validation accuracy at each position of a block: {acc or 'n/a'}; expected accepted length "
            f"{_fmt(row.get('val_eal'))}"
        )
    return [
        "",
        "## Training",
        "",
        f"- {len(metrics)} epoch(s), {int(sum(r.get('train_steps') or 0 for r in metrics))} optimizer steps; "
        f"{selection_line(metrics)}",
        f"- The exported epoch's train loss {_fmt(row.get('train_loss'), 3)}, validation loss "
        f"{_fmt(row.get('val_loss'), 3)}",
        line,
    ]


def _compat_lines(compat: dict) -> list[str]:
    """The compatibility report's verdict and its live vLLM check."""
    counts = compat.get("counts") or {}
    loader = "DFlash" if "dflash" in (compat.get("format") or "") else "EAGLE-3"
    live = compat.get("live") or {}
    lines = [
        "",
        "## Compatibility with vLLM",
        "",
        f"- {'Passed' if compat.get('ok') else 'FAILED'}: {counts.get('error', 0)} error(s), "
        f"{counts.get('warning', 0)} warning(s) from the check against vLLM's {loader} loader.",
    ]
    if "acceptance_length" in live:
        lines.append(
            f"- Loaded in vLLM with the verifier: acceptance length {_fmt(live['acceptance_length'])} on "
            f"{live.get('num_prompts', '?')} held-out prompts, texts identical with and without the draft: "
            f"{'yes' if live.get('identical') else 'no'}."
        )
    return lines


def _bench_lines(bench: dict | None) -> list[str]:
    """The offline benchmark's table: acceptance length, per position, speedup, identical texts, per row."""
    if not bench or not bench.get("results"):
        return []
    lines = [
        "",
        "## Benchmark (vLLM, offline)",
        "",
        "| prompts | k | batch | temperature | acceptance length | per position | speedup | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in bench["results"]:
        per = " / ".join(_fmt(a) for a in row.get("per_position_acceptance") or [])
        lines.append(
            f"| {row.get('prompt_set')} | {row.get('num_speculative_tokens')} | {row.get('batch_size')} | "
            f"{row.get('temperature')} | {_fmt(row.get('acceptance_length'))} | {per} | "
            f"{_fmt(row.get('speedup'))}x | {'yes' if row.get('identical') else 'no'} |"
        )
    env = bench.get("environment") or {}
    return [
        *lines,
        "",
        f"vLLM {env.get('vllm', '?')} on {env.get('cpu_count', '?')} CPU cores / {env.get('machine', '?')}.",
    ]

"""The hidden-state gate of the draft job: states that are all zero, constant, or not the verifier's are not
trained on.

Before the draft trains on its hidden-state shards, each shard is read once (the result remembered while the file's
size, mtime and inode stay the same, and the gate's settings too) and must pass two checks:

- **Live states** (:func:`draftpipe.formats.state_values.degenerate_layers`): no aux layer, and not the last layer,
  is all zero or the same vector at every token. vLLM has returned all-zero states for some verifiers (vllm #46301,
  speculators #613): training "converges" on them and the draft accepts nothing.
- **The teacher check** (:func:`draftpipe.formats.state_values.teacher_agreement`): the verifier's own next-token
  distribution, computed from the stored last-layer states with its final norm and head (read from the verifier's
  files with speculators' ``load_model_layers``: two tensors, whatever the checkpoint's size), must allow the answer
  tokens it generated, on at least ``hidden_states.min_teacher_agreement`` of the checked tokens (states of another
  sequence, position or batch do not: speculators #279).

A failing shard fails the job naming the shard and the layer or the agreement; the shard stays where it is: it holds
what vLLM returned, and computing it again gives the same states.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from draftpipe.core.gates import QualityGateError
from draftpipe.core.io import read_cache, stat_key, write_cache
from draftpipe.formats.state_values import degenerate_layers, teacher_agreement
from draftpipe.formats.verifier import load_verifier_config

#: model types whose final norm is not ``h * rsqrt(mean(h^2) + eps) * w`` (Gemma's is ``* (1 + w)``): no teacher
#: check for them (the live-states check still runs)
OTHER_FINAL_NORMS = ("gemma", "gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class StateGate:
    """The gate's settings (untracked: changing them retrains nothing).

    Attributes:
        min_agreement: ``hidden_states.min_teacher_agreement``, a fraction in [0, 1]; None turns the teacher check off.
        tokens: ``hidden_states.teacher_check_tokens``, about how many answer tokens of each shard are checked.
        temperature, top_p: ``completions.temperature`` and ``completions.top_p``, the sampler that generated the
            answers.
    """

    min_agreement: float | None
    tokens: int
    temperature: float
    top_p: float

    def teacher_off(self) -> str | None:
        """Why the teacher check cannot say anything with these settings, or None when it runs."""
        if self.min_agreement is None:
            return "hidden_states.min_teacher_agreement is null"
        if self.temperature > 0 and self.top_p >= 1:
            return (
                f"the answers were sampled at temperature {self.temperature} with top_p 1, where every token is in "
                "the verifier's support"
            )
        return None


def final_head(verifier: str) -> tuple:
    """The verifier's final norm weight ``[H]``, its output head ``[V, H]`` (``lm_head.weight``, else the tied
    embeddings), on the job's first GPU when it has one, and the norm's epsilon, read from its directory or hub id (speculators' ``load_model_layers`` reads
    only those tensors); None for a model type of :data:`OTHER_FINAL_NORMS`.

    Raises:
        ValueError: the checkpoint has no final norm or no head.
    """
    from speculators.utils.loading import load_model_layers

    cfg = load_verifier_config(verifier, text=True) if Path(verifier).is_dir() else None
    if cfg is None:
        from transformers import AutoConfig

        full = AutoConfig.from_pretrained(verifier).to_dict()
        cfg = full.get("text_config") or full
    if cfg.get("model_type") in OTHER_FINAL_NORMS:
        return None
    import torch

    norm = load_model_layers(["model.norm.weight"], verifier)["model.norm.weight"]
    try:
        head = load_model_layers(["lm_head.weight"], verifier)["lm_head.weight"]
    except ValueError:  # tied embeddings: no lm_head tensor
        head = load_model_layers(["model.embed_tokens.weight"], verifier)["model.embed_tokens.weight"]
    device = (
        "cuda" if torch.cuda.is_available() else "cpu"
    )  # the draft job's GPUs: a 1T verifier's head is 163,840 rows
    return norm.to(device), head.to(device), float(cfg.get("rms_norm_eps") or 1e-6)


def check_hidden_states(shards: list[str], verifier: str, gate: StateGate, cache_file: str | Path) -> dict:
    """Run the gate (module docstring) over the draft's shards; return ``{shard: {"degenerate": [...],
    "agreement": [agreeing, checked] | None}}`` and print one line with the lowest agreement.

    Raises:
        QualityGateError: naming each shard with a degenerate layer (and the layer) or an agreement below
            ``gate.min_agreement`` (and the counts), and what to do.
    """
    off = gate.teacher_off()
    # what a result depends on: the teacher check's settings (the threshold only judges it)
    tag = json.dumps(None if off else {k: v for k, v in asdict(gate).items() if k != "min_agreement"}, sort_keys=True)
    cache = read_cache(cache_file)
    head = None
    results: dict = {}
    fresh: dict = {}
    failed: list[str] = []
    for shard in shards:
        key = [*stat_key(shard), tag]
        hit = cache.get(shard)
        if isinstance(hit, dict) and hit.get("key") == key:
            results[shard] = hit["result"]
        else:
            result = {"degenerate": degenerate_layers(shard), "agreement": None}
            if off is None and not result["degenerate"]:
                if head is None:
                    head = final_head(verifier) or ()
                if head:
                    norm, weight, eps = head
                    result["agreement"] = list(
                        teacher_agreement(
                            shard,
                            norm,
                            weight,
                            eps,
                            tokens=gate.tokens,
                            temperature=gate.temperature,
                            top_p=gate.top_p,
                        )
                    )
            results[shard] = result
        fresh[shard] = {"key": key, "result": results[shard]}
        failed += _failures(shard, results[shard], gate.min_agreement)
    write_cache(cache_file, fresh)
    print(_summary(results, off), flush=True)
    if failed:
        raise QualityGateError(
            "hidden states not fit to train on (a draft trained on them accepts nothing):\n"
            + "\n".join(failed)
            + "\nvLLM returned them for this verifier (all-zero states are known for some verifiers and vLLM "
            "versions: vllm #46301); try other hidden_states.aux_layer_ids or another vLLM version, then rerun the "
            "hidden_states rule (--forcerun hidden_states). The shards are left in place"
        )
    return results


def _failures(shard: str, result: dict, min_agreement: float | None) -> list[str]:
    """The lines of the gate's error for one shard's result (none when it passes)."""
    lines = [f"{shard}: {line}" for line in result["degenerate"]]
    agree, checked = result["agreement"] or (0, 0)
    if checked and agree / checked < (min_agreement or 0):
        lines.append(
            f"{shard}: the verifier's own sampler allows {agree} of {checked} answer tokens ({agree / checked:.3f}) "
            f"from the stored last-layer states, below hidden_states.min_teacher_agreement={min_agreement}"
        )
    return lines


def _summary(results: dict, off: str | None) -> str:
    """One line for the job's log: shards checked, and the lowest teacher agreement (or why there is none)."""
    rated = []
    for shard, result in results.items():
        agree, checked = result["agreement"] or (0, 0)
        if checked:
            rated.append((agree / checked, checked, Path(shard).name))
    if not rated:
        why = off or "no answer tokens, or a final norm it does not compute"
        return f"hidden-state gate: {len(results)} shard(s) read; teacher check off ({why})"
    low, _, name = min(rated)
    return (
        f"hidden-state gate: {len(results)} shard(s) read; the verifier's sampler allows the stored answer tokens at "
        f"{low:.4f} at the lowest ({name}; {sum(r[1] for r in rated):,} tokens checked)"
    )

"""Checks of the draft's tensors against the effective config: names vLLM's loader maps, shapes, the vocab maps
(``d2t``/``t2d``) and the hidden size."""

from __future__ import annotations

import numpy as np

from draftpipe.checks.compat.effective import expected_shapes
from draftpipe.checks.compat.reading import INT_DTYPES, read_small_tensor
from draftpipe.checks.compat.report import CompatError, Report


def _normalise(name: str) -> str:
    return name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name


def _refused_name(rep: Report, raw: str, name: str, shapes: dict[str, list[int]]) -> bool:
    """Report a tensor vLLM's loader would not load as a draft weight (its name prefixed, a verifier tensor, an
    undeclared bias, a P-EAGLE or vocab-map tensor it ignores or refuses, an unknown name); True when it is left out
    of the shape checks."""
    if name.startswith("model."):
        rep.add(
            "names.model_prefix",
            "error",
            raw,
            "vLLM prefixes names with model., so this becomes model.model.* and fails to load",
            expected=name[len("model.") :],
            found=raw,
            fix="save names without 'model.'",
        )
        return True
    if name.startswith("verifier_"):
        rep.add(
            "names.verifier_tensor",
            "error",
            raw,
            "verifier tensors must not be saved in the draft (unknown names fail to load)",
            expected=None,
            found=raw,
            fix="drop verifier_* tensors before saving",
        )
        return True
    if name.endswith(".bias") and name not in shapes:
        rep.add(
            "names.bias_without_flag",
            "warning",
            raw,
            "vLLM silently ignores a bias the config does not declare, so the draft runs without it",
            expected="attention_bias/mlp_bias: true, or no bias",
            found=raw,
            fix="set attention_bias (or mlp_bias) in the config, or drop the tensor",
        )
        return True
    if name == "mask_hidden":
        rep.add("names.mask_hidden", "info", raw, "P-EAGLE tensor; ignored unless parallel drafting")
        return True
    if name == "t2d" and "t2d" not in shapes:
        rep.add("names.t2d_without_mapping", "info", raw, "t2d is ignored by vLLM")
        return True
    if name == "d2t" and "d2t" not in shapes:
        rep.add(
            "vocab.d2t_forbidden",
            "error",
            raw,
            "draft_vocab_size equals the verifier vocabulary, so vLLM "
            "has no d2t parameter and raises at load (ref §7 a)",
            expected="no d2t",
            found="d2t",
            fix="drop d2t/t2d, or set draft_vocab_size to the mapped size",
        )
        return True
    if name not in shapes:
        rep.add(
            "names.unknown",
            "error",
            raw,
            "vLLM raises ValueError for an unknown tensor name",
            expected=None,
            found=raw,
            fix="remove it or fix its name",
        )
        return True
    return False


def _missing_tensor(rep: Report, name: str, shapes: dict[str, list[int]], e: dict) -> None:
    """Report a weight the draft needs and does not have (vLLM leaves a missing weight uninitialised, or shares the
    verifier's where it must not)."""
    if name == "d2t":
        rep.add(
            "vocab.d2t_missing",
            "error",
            "d2t",
            "draft vocab differs from the verifier's but there is no "
            "d2t: vLLM keeps zeros and maps draft id i to target id i, so acceptance collapses silently "
            "(Automodel PR #2447)",
            expected=[e["draft_vocab_size"]],
            found=None,
            fix="save d2t (int64 offsets)",
        )
    elif name == "lm_head.weight":
        rep.add(
            "names.lm_head_missing",
            "error",
            name,
            "without its own lm_head the draft shares the "
            "verifier's, which is wrong when the vocabularies or hidden sizes differ (SGLang #27908)",
            expected=shapes[name],
            found=None,
            fix="save the draft's lm_head",
        )
    elif name == "embed_tokens.weight":
        rep.add(
            "hidden.embed_missing",
            "error",
            name,
            "draft hidden size differs from the verifier's, so it cannot share the verifier's embedding (vLLM #18906)",
            expected=shapes[name],
            found=None,
            fix="save the draft's own embed_tokens",
        )
    else:
        rep.add(
            "names.missing",
            "error",
            name,
            "vLLM does not fail on a missing weight: it stays uninitialised (ref §1.4)",
            expected=shapes[name],
            found=None,
            fix="save this tensor",
        )


def check_names(rep: Report, tensors: dict[str, dict], e: dict) -> dict[str, dict]:
    """The draft's tensor names against those vLLM's EAGLE-3 model maps (:func:`expected_shapes` of the effective
    config ``e``); returns the tensors it loads, by normalised name."""
    shapes, required = expected_shapes(e)
    names: dict[str, dict] = {}
    if any(n.startswith("midlayer.") for n in tensors):
        rep.add(
            "names.midlayer",
            "info",
            "midlayer.*",
            "EAGLE/SpecForge layer names; vLLM maps midlayer. to layers.0.",
            found="midlayer.*",
        )
    for raw, info in tensors.items():
        name = _normalise(raw)
        if not _refused_name(rep, raw, name, shapes):
            names[name] = info
    for name in sorted(required - set(names)):
        _missing_tensor(rep, name, shapes, e)
    return names


def check_shapes(rep: Report, names: dict[str, dict], e: dict) -> None:
    shapes, _ = expected_shapes(e)
    q = names.get("layers.0.self_attn.q_proj.weight")
    if q and q["shape"] and e["num_attention_heads"]:
        hd_w = q["shape"][0] // e["num_attention_heads"]
        if hd_w != e["head_dim"]:
            how = "explicit" if e["head_dim_explicit"] else "derived as hidden_size // num_attention_heads"
            rep.add(
                "shape.head_dim",
                "error",
                "head_dim",
                f"q_proj has {q['shape'][0]} rows = "
                f"{e['num_attention_heads']} heads x {hd_w}, but the config's head_dim ({how}) is "
                f"{e['head_dim']}: vLLM truncates or fails on q/k/v/o (EAGLE #315)",
                expected=hd_w,
                found=e["head_dim"],
                fix=f"set head_dim: {hd_w} in the draft config",
            )
    for name, info in names.items():
        want = shapes[name]
        if list(info["shape"]) != list(want):
            if name.startswith("layers.") and "self_attn" in name and rep.ids().count("shape.head_dim"):
                continue  # already explained by shape.head_dim
            rep.add(
                f"shape.{name}",
                "error",
                name,
                "shape differs from what vLLM builds for this config",
                expected=want,
                found=list(info["shape"]),
                fix="fix the config or the tensor so they agree",
            )


def check_vocab(rep: Report, names: dict[str, dict], e: dict) -> None:
    """The vocab maps: ``vocab_size`` equal to the verifier's, ``d2t`` integer offsets onto sorted verifier ids (read
    from the file), ``t2d`` marking the same ids (:func:`_check_t2d`)."""
    V, Vd, Vt = e["vocab_size"], e["draft_vocab_size"], e["verifier_vocab_size"]
    if Vt is not None and V != Vt:
        rep.add(
            "vocab.size",
            "error",
            "vocab_size",
            "the draft config's vocab_size must equal the verifier's",
            expected=Vt,
            found=V,
            fix=f"set vocab_size: {Vt}",
        )
    d2t, t2d = names.get("d2t"), names.get("t2d")
    if d2t is None:
        return
    if d2t["dtype"] not in INT_DTYPES:
        rep.add(
            "vocab.d2t_dtype",
            "error",
            "d2t",
            "d2t must be integer offsets; a float d2t loses ids above ~256/2048",
            expected="I64",
            found=d2t["dtype"],
            fix="save d2t as int64",
        )
        return
    if d2t["dtype"] != "I64":
        rep.add(
            "vocab.d2t_dtype",
            "warning",
            "d2t",
            "vLLM copies it into int64 with a warning",
            expected="I64",
            found=d2t["dtype"],
            fix="save d2t as int64",
        )
    if list(d2t["shape"]) != [Vd]:
        return  # reported by the shape check
    try:
        offsets = read_small_tensor(d2t).astype(np.int64)
    except CompatError as exc:
        rep.add("vocab.d2t_unreadable", "error", "d2t", str(exc), fix="save d2t again")
        return
    target = np.arange(Vd, dtype=np.int64) + offsets
    if target.min() < 0 or target.max() >= V:
        rep.add(
            "vocab.d2t_range",
            "error",
            "d2t",
            "i + d2t[i] must be a verifier token id",
            expected=f"[0, {V})",
            found=[int(target.min()), int(target.max())],
            fix="rebuild d2t as offsets of sorted target ids",
        )
    elif Vd > 1 and not bool(np.all(target[1:] > target[:-1])):
        rep.add(
            "vocab.d2t_order",
            "error",
            "d2t",
            "i + d2t[i] must be strictly increasing (sorted target ids; "
            "absolute ids instead of offsets also break this)",
            expected="strictly increasing",
            found="not increasing",
            fix="d2t[i] = sorted_ids[i] - i",
        )
    _check_t2d(rep, t2d, target, V, Vd)


def _check_t2d(rep: Report, t2d: dict | None, target: np.ndarray, V: int, Vd: int) -> None:
    """``t2d`` (a ``[V]`` mask) marks exactly the verifier ids of ``d2t`` (``target``: ``arange(Vd) + d2t``)."""
    if t2d is None or list(t2d["shape"]) != [V]:
        return
    try:
        mask = read_small_tensor(t2d).astype(bool)
    except CompatError as exc:
        rep.add("vocab.t2d_unreadable", "error", "t2d", str(exc), fix="save t2d again")
        return
    if int(mask.sum()) != Vd:
        rep.add(
            "vocab.t2d_count",
            "error",
            "t2d",
            "t2d must mark exactly draft_vocab_size ids",
            expected=Vd,
            found=int(mask.sum()),
            fix="rebuild t2d from d2t",
        )
    elif not np.array_equal(np.nonzero(mask)[0], target):
        rep.add(
            "vocab.t2d_mismatch",
            "warning",
            "t2d",
            "t2d and d2t disagree (vLLM ignores t2d; SGLang reads it)",
            expected="nonzero(t2d) == arange(Vd) + d2t",
            found="different ids",
            fix="rebuild t2d from d2t",
        )


def check_hidden(rep: Report, names: dict[str, dict], e: dict) -> None:
    H, Ht, T = e["hidden_size"], e["verifier_hidden_size"], e["target_hidden_size"]
    if Ht is None:
        return
    if T != Ht:
        rep.add(
            "hidden.target_hidden_size",
            "error",
            "target_hidden_size",
            "fc reads aux states of the verifier's width",
            expected=Ht,
            found=T,
            fix=f"set target_hidden_size: {Ht}",
        )
    if H != Ht:
        rep.add(
            "hidden.draft_width",
            "info",
            "hidden_size",
            "draft is narrower/wider than the verifier; it needs its own embed_tokens and lm_head",
            expected=Ht,
            found=H,
        )

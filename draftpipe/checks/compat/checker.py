"""The check of a draft directory against vLLM's EAGLE-3 loader and the verifier: format, config, tensors, aux
layer ids (:func:`check`); a DFlash draft against vLLM's DFlash loader (:mod:`draftpipe.checks.compat.dflash`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftpipe.checks.compat.dflash import check_dflash, check_model_type
from draftpipe.checks.compat.effective import QWEN3_EAGLE3, REGISTERED_EAGLE3, detect_format, effective, model_config
from draftpipe.checks.compat.fields import SHAPE_FIELDS, VERIFIER_FIELDS, typed_config, typed_fields, typed_tensors
from draftpipe.checks.compat.reading import load_checkpoint, verifier_text_config
from draftpipe.checks.compat.report import CompatError, Report
from draftpipe.checks.compat.tensor_checks import check_hidden, check_names, check_shapes, check_vocab
from draftpipe.formats.hidden_states import vllm_default_aux_layer_ids


def check(draft_dir: str | Path, verifier: str | Path | dict, *, expect: dict | None = None) -> Report:
    """Check a draft directory against vLLM's EAGLE-3 loader and the verifier's config (a DFlash draft,
    ``speculators_model_type: dflash``, against vLLM's DFlash loader: :func:`draftpipe.checks.compat.dflash.check_dflash`).

    Args:
        draft_dir: directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
        verifier: the verifier's directory, its ``config.json`` path, or the config as a dict.
        expect: optional values the build asked for (``head_dim``, ``draft_vocab_size``, ``aux_layer_ids``);
            a checkpoint that differs gets an error. ``max_model_len``: the context the verifier is served with
            (default: its ``max_position_embeddings``); a draft with a shorter context gets a warning.

    Returns:
        A :class:`Report`; ``report.ok`` is False when any finding is an error. Whatever the files hold, the answer
        is findings: unreadable files (``files.unreadable``), config values of the wrong type (``config.type``,
        :data:`CONFIG_FIELDS`), broken tensor entries (``tensor.header``); a fault of the checker itself is a
        ``checker.internal`` finding, not a traceback.
    """
    rep = Report(str(draft_dir), str(verifier if not isinstance(verifier, dict) else "<config>"))
    try:
        config, tensors, _ = load_checkpoint(draft_dir)
        vcfg = verifier_text_config(verifier)
    except CompatError as exc:
        rep.add(
            "files.unreadable",
            "error",
            exc.field,
            str(exc),
            expected="a draft directory with config.json and model.safetensors, and the verifier's config.json",
            found=None,
            fix="write the draft again (atomically) or point at the right directory",
        )
        return rep
    try:
        _check_all(rep, config, tensors, vcfg, expect or {})
    except Exception as exc:  # the checker answers with findings, never a traceback (tests/unit/test_compat_fuzz.py)
        rep.add(
            "checker.internal",
            "error",
            "-",
            f"the checker could not finish: {type(exc).__name__}: {exc}",
            fix="report this checkpoint to draftpipe's maintainers",
        )
    return rep


def _check_all(rep: Report, config: Any, tensors: dict, vcfg: Any, expect: dict) -> None:
    config = typed_config(rep, config)
    vcfg = typed_fields(rep, vcfg, "verifier.", VERIFIER_FIELDS)
    tensors = typed_tensors(rep, tensors)
    if config.get("speculators_model_type") == "dflash":
        rep.format = "speculators (dflash)"
        check_dflash(rep, config, tensors, vcfg, expect)
        return
    fmt = detect_format(config)
    rep.format = fmt
    if fmt is None:
        rep.add(
            "format.unknown",
            "error",
            "config.json",
            "neither a speculators config (speculators_config) nor an EAGLE-style Hugging Face config (architectures)",
            expected="speculators or EAGLE format",
            found=sorted(config),
            fix="write the draft with speculators or as a Llama/Qwen3 EAGLE-3 config",
        )
        return
    rep.add("format.detected", "info", "config.json", f"{fmt} format", found=fmt)
    _check_format(rep, config, fmt)
    mc = model_config(config, fmt)
    e = effective(mc, vcfg)
    rep.effective = e
    _check_config(rep, e, mc, fmt, expect)
    missing = [k for k in SHAPE_FIELDS if e[k] is None]
    for k in missing:
        where = "transformer_layer_config." if fmt == "speculators" else ""
        rep.add(
            "config.missing",
            "error",
            f"{where}{k}",
            "vLLM needs it to build the draft; the tensor shapes were not checked",
            expected="an integer >= 1",
            found=None,
            fix=f"set {where}{k}",
        )
    if not missing:
        names = check_names(rep, tensors, e)
        check_shapes(rep, names, e)
        check_vocab(rep, names, e)
        check_hidden(rep, names, e)
    _check_aux(rep, e, fmt, config, expect)


def _check_format(rep: Report, config: dict, fmt: str) -> None:
    if fmt == "speculators":
        check_model_type(rep, config)
        if config.get("speculators_model_type") != "eagle3":
            rep.add(
                "format.speculators_model_type",
                "error",
                "speculators_model_type",
                "not an EAGLE-3 speculator",
                expected="eagle3",
                found=config.get("speculators_model_type"),
                fix="set speculators_model_type: eagle3",
            )
        sc = config.get("speculators_config") or {}
        methods = sc.get("proposal_methods")
        first = methods[0] if isinstance(methods, list) and methods and isinstance(methods[0], dict) else {}
        tokens = first.get("speculative_tokens")
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
            rep.add(
                "format.speculative_tokens",
                "error",
                "speculators_config.proposal_methods[0].speculative_tokens",
                "vLLM's validate_speculators_config requires it",
                expected="an int >= 1",
                found=tokens,
                fix="set proposal_methods: [{proposal_type: greedy, speculative_tokens: 3}]",
            )
        verifier = sc.get("verifier")
        if not (
            isinstance(verifier, dict) and isinstance(verifier.get("name_or_path"), str) and verifier["name_or_path"]
        ):
            rep.add(
                "format.verifier_name",
                "warning",
                "speculators_config.verifier.name_or_path",
                "`vllm serve <draft dir>` reads the verifier from here",
                expected="a hub id",
                found=None,
                fix="record the verifier's hub id, or serve with --speculative-config",
            )
        lt = (config.get("transformer_layer_config") or {}).get("model_type", "llama")
        if lt not in ("llama", "qwen3"):
            rep.add(
                "format.layer_model_type",
                "error",
                "transformer_layer_config.model_type",
                "update_eagle3 only maps llama and qwen3 (anything else raises)",
                expected="llama or qwen3",
                found=lt,
                fix="build the draft layers as llama or qwen3",
            )
    else:
        arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        vllm_arch = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
        if vllm_arch not in REGISTERED_EAGLE3:
            rep.add(
                "arch.unregistered",
                "error",
                "architectures",
                f"vLLM rewrites {arch} to {vllm_arch}, which it does not register (vLLM #24967)",
                expected=sorted(REGISTERED_EAGLE3),
                found=arch,
                fix="use LlamaForCausalLM / LlamaForCausalLMEagle3 or Qwen3ForCausalLM",
            )


def _check_config(rep: Report, e: dict, mc: dict, fmt: str, expect: dict) -> None:
    """Config values vLLM's loader takes or refuses (activation, layer types, ``target_hidden_size``, the norms),
    then the context and the values the build asked for (:func:`_check_expected`)."""
    if e["hidden_act"] != "silu":
        rep.add(
            "config.hidden_act",
            "error",
            "hidden_act",
            "vLLM's Llama MLP supports only silu",
            expected="silu",
            found=e["hidden_act"],
            fix="train the draft with silu",
        )
    lt = mc.get("layer_types")
    if lt is not None and len(lt) < e["num_hidden_layers"]:
        rep.add(
            "config.layer_types",
            "error",
            "layer_types",
            "vLLM indexes layer_types by draft layer",
            expected=f">= {e['num_hidden_layers']} entries",
            found=len(lt),
            fix="list one layer type per draft layer",
        )
    if fmt == "eagle" and "target_hidden_size" in mc and mc["target_hidden_size"] is None:
        rep.add(
            "config.target_hidden_size_null",
            "warning",
            "target_hidden_size",
            "an explicit null is kept as None and None * num_aux raises TypeError in the fc width",
            expected="an int or no key",
            found=None,
            fix="remove the key or set the verifier's hidden size",
        )
    if e["norm_before_fc"] and e["fc_norm"]:
        rep.add(
            "norm.both",
            "error",
            "norm_before_fc/fc_norm",
            "speculators rejects both together",
            expected="one of them",
            found="both",
            fix="choose one normalisation before fc",
        )
    if fmt == "eagle" and mc.get("norm_output"):
        rep.add(
            "norm.norm_output_meaning",
            "warning",
            "norm_output",
            "SpecForge's norm_output means 'final norm "
            "before lm_head'; vLLM's means 'feed the post-norm state back' (ref §7 d)",
            expected=None,
            found=True,
            fix="check which convention the trainer used",
        )
    _check_expected(rep, e, expect)


def _check_expected(rep: Report, e: dict, expect: dict) -> None:
    """The draft's context against the one the verifier is served with, and ``head_dim`` and ``draft_vocab_size``
    against what the build asked for."""
    # the context the verifier is served with: the build's max_model_len, else the verifier's own
    mpe = e["max_position_embeddings"]
    served = expect.get("max_model_len") or e["verifier_max_position_embeddings"]
    if mpe and served and mpe < served:
        rep.add(
            "config.max_position_embeddings",
            "warning",
            "max_position_embeddings",
            f"the draft's context ({mpe}) is shorter than the {served} tokens the verifier is served with: past it "
            "the draft silently stops helping (vLLM #48894; vLLM >= PR #49343 raises it to max_model_len)",
            expected=served,
            found=mpe,
            fix=f"set max_position_embeddings: {served}",
        )
    if "head_dim" in expect and expect["head_dim"] and e["head_dim"] != expect["head_dim"]:
        rep.add(
            "expect.head_dim",
            "error",
            "head_dim",
            "the draft's head_dim is not the one the build asked for",
            expected=expect["head_dim"],
            found=e["head_dim"],
            fix=f"rebuild the draft with head_dim {expect['head_dim']}",
        )
    if (
        "draft_vocab_size" in expect
        and expect["draft_vocab_size"]
        and e["draft_vocab_size"] != expect["draft_vocab_size"]
    ):
        rep.add(
            "expect.draft_vocab_size",
            "error",
            "draft_vocab_size",
            "not the draft vocabulary the build asked for",
            expected=expect["draft_vocab_size"],
            found=e["draft_vocab_size"],
            fix="rebuild the vocab maps and the draft",
        )


def _aux_missing(rep: Report, N: int | None) -> None:
    """No aux layer ids: vLLM falls back to its defaults (an error where they repeat on a shallow verifier)."""
    default = vllm_default_aux_layer_ids(N) if N else None
    sev = "error" if default and len(set(default)) != 3 else "warning"
    rep.add(
        "aux.missing",
        sev,
        "eagle_aux_hidden_state_layer_ids",
        "no aux layer ids: vLLM falls back to "
        f"(2, N//2, N-3) = {default}, which silently lowers acceptance if the draft was trained on other "
        "layers (vLLM PR #50170)",
        expected="the ids used in training",
        found=None,
        fix="write eagle_aux_hidden_state_layer_ids at the top level and in eagle_config",
    )


def _check_aux_values(rep: Report, e: dict, ids: list[int]) -> None:
    """The ids in vLLM's range for the verifier, distinct, and as many as ``fc`` is built for."""
    N, A = e["verifier_num_layers"], e["num_aux_hidden_states"]
    if N is not None:
        bad = [i for i in ids if not 0 <= i <= N]
        if bad:
            rep.add(
                "aux.range",
                "error",
                "eagle_aux_hidden_state_layer_ids",
                f"ids outside [0, {N}] for a {N}-layer verifier (vLLM convention: id k = state entering layer k)",
                expected=f"[0, {N}]",
                found=bad,
                fix="use vLLM's convention; SpecForge/SGLang ids need +1",
            )
    if len(set(ids)) != len(ids):
        rep.add(
            "aux.duplicate",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            "vLLM deduplicates the ids, so fewer states reach fc than it expects",
            expected="distinct ids",
            found=ids,
            fix="list each layer once",
        )
    if len(set(ids)) != A:
        rep.add(
            "aux.count",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            f"{len(set(ids))} ids but fc is built for "
            f"{A} aux states ({'eagle_config ids or 3' if e['architecture'] not in QWEN3_EAGLE3 else 'top-level ids'}; "
            "vLLM #54526)",
            expected=A,
            found=len(set(ids)),
            fix="write the ids in eagle_config.eagle_aux_hidden_state_layer_ids too (or num_aux_hidden_states)",
        )


def _check_aux_places(rep: Report, fmt: str, top: list[int] | None, inner: list[int] | None) -> None:
    """The ids where each vLLM runner reads them: one list at the top level and in ``eagle_config``."""
    if top and inner and list(top) != list(inner):
        rep.add(
            "aux.disagree",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            "top-level and eagle_config ids differ: the V1/V2 runners capture one list, fc is sized by the other",
            expected=top,
            found=inner,
            fix="write one list in both",
        )
    if not top:
        rep.add(
            "aux.v2_runner",
            "warning",
            "eagle_aux_hidden_state_layer_ids",
            "ids only in eagle_config: the V2 "
            "model runner (default on GPUs with Triton) does not read them and captures the defaults",
            expected="top-level ids",
            found=None,
            fix="write the ids at the top level too",
        )
    if fmt == "eagle" and top is None and inner:
        rep.add(
            "aux.convention",
            "info",
            "eagle_config.eagle_aux_hidden_state_layer_ids",
            "EAGLE-style checkpoint: "
            "if it was trained with SpecForge/SGLang ids (output of layer k), add 1 for vLLM (sglang PR #25454)",
        )


def _check_aux(rep: Report, e: dict, fmt: str, config: dict, expect: dict) -> None:
    """The aux layer ids: present, in range, distinct, as many as ``fc`` takes, where each vLLM runner reads them,
    the ids the build asked for; and the norm flag vLLM's speculators path assumes."""
    top, inner = e["aux_layer_ids_top_level"], e["aux_layer_ids_eagle_config"]
    ids = top or inner
    if not e["use_aux_hidden_state"]:
        rep.add("aux.unused", "info", "eagle_config.use_aux_hidden_state", "draft does not read aux hidden states")
        return
    if not ids:
        _aux_missing(rep, e["verifier_num_layers"])
        return
    _check_aux_values(rep, e, ids)
    _check_aux_places(rep, fmt, top, inner)
    if expect.get("aux_layer_ids") and sorted(set(ids)) != sorted(expect["aux_layer_ids"]):
        rep.add(
            "expect.aux_layer_ids",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            "not the ids the hidden states were captured at",
            expected=sorted(expect["aux_layer_ids"]),
            found=ids,
            fix="rewrite the ids",
        )
    if fmt == "speculators" and "norm_before_residual" not in config:
        rep.add(
            "norm.before_residual_default",
            "warning",
            "norm_before_residual",
            "missing: vLLM's speculators path assumes True, speculators' own default is False (ref §7 c)",
            expected="an explicit value",
            found=None,
            fix="write the value used in training",
        )

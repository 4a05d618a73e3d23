"""The check of a DFlash draft (``speculators_model_type: dflash``) against vLLM 0.32's DFlash loader and the
verifier (:func:`check_dflash`).

vLLM turns a speculators DFlash config into its own in ``update_dflash``
(``vllm/transformers_utils/configs/speculators/algos.py``) and builds ``DFlashQwen3ForCausalLM``
(``vllm/model_executor/models/qwen3_dflash.py``). The rules below are read from those two files and from what
speculators trains (``speculators/models/dflash/``):

- ``mask_token_id`` and ``aux_hidden_state_layer_ids`` are required (``update_dflash`` indexes them: a KeyError);
  the mask token is embedded with the verifier's embedding, so it must be one of its tokens;
- the runner captures the states entering the layers of ``aux_hidden_state_layer_ids`` (copied to
  ``eagle_aux_hidden_state_layer_ids``), and ``fc`` must be ``[hidden_size, ids x (target_hidden_size or
  hidden_size)]`` (``_get_dflash_fc_input_size``, checked when the weights load);
- ``dflash_config.causal = not sliding_window_non_causal`` (a missing flag reads as non-causal) applies to every
  layer (``_dflash_layer_causal``), while speculators trains full-attention layers without a causal mask within
  the block and sliding ones with it unless ``sliding_window_non_causal`` (``create_anchor_block_mask_mod``): a
  full-attention draft must set the flag, or vLLM serves the block causal and drafts something else than was
  trained; layers of both kinds need the V2 model runner (``_resolve_layer_attention`` raises otherwise);
- ``sample_from_anchor`` is refused by the V2 model runner's DFlash speculator;
- the draft proposes ``block_size - 1`` tokens (``block_size`` with ``sample_from_anchor``): the speculators
  config's ``speculative_tokens``, which ``vllm serve <draft>`` takes as ``num_speculative_tokens``.
"""

from __future__ import annotations

from typing import Any

from draftpipe.checks.compat.report import Report

SLIDING = "sliding_attention"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model_type(rep: Report, config: dict) -> None:
    """A speculators config (EAGLE-3 or DFlash) must not have a top-level ``model_type``: vLLM detects the
    speculators format only when it is absent."""
    if "model_type" in config:
        rep.add(
            "format.model_type_top_level",
            "error",
            "model_type",
            "a top-level model_type hides the speculators config from vLLM (it detects the format only when "
            "model_type is absent)",
            found=config["model_type"],
            fix="remove the top-level model_type",
        )


def check_dflash(rep: Report, config: dict, tensors: dict, vcfg: dict, expect: dict) -> None:
    """Add the findings of a DFlash draft: the fields ``update_dflash`` requires, the aux layer ids and the width
    of ``fc``, the causality vLLM serves against the one speculators trained, the block's proposed tokens, the
    tensors vLLM would not load, and the values the build asked for (``expect``: ``aux_layer_ids``,
    ``draft_vocab_size``, ``head_dim``).

    Args:
        rep: the report to add to.
        config: the draft's ``config.json`` (typed by :func:`draftpipe.checks.compat.fields.typed_config`).
        tensors: the draft's safetensors header entries (``shape``, ``dtype``), by name.
        vcfg: the verifier's text config (``hidden_size``, ``vocab_size``, ``num_hidden_layers``).
        expect: values the build asked for.
    """
    rep.add("format.detected", "info", "config.json", "speculators format, DFlash draft", found="dflash")
    check_model_type(rep, config)
    _check_mask(rep, config, vcfg.get("vocab_size"))
    _check_aux(rep, config, tensors, vcfg, expect)
    _check_causality(rep, config)
    _check_block(rep, config)
    _check_tensors(rep, config, tensors, vcfg, expect)


def _check_mask(rep: Report, config: dict, vocab: int | None) -> None:
    mask = config.get("mask_token_id")
    if not _is_int(mask):
        rep.add(
            "dflash.mask_token_id",
            "error",
            "mask_token_id",
            "vLLM's update_dflash requires the mask token of the slots still to predict (a KeyError without it)",
            expected="a token id of the verifier",
            found=mask,
            fix="train with a mask token (draft.dflash.mask_token_id, or speculators' choice)",
        )
    elif vocab and not 0 <= mask < vocab:
        rep.add(
            "dflash.mask_token_range",
            "error",
            "mask_token_id",
            f"the mask token is embedded with the verifier's embedding of {vocab} tokens",
            expected=f"[0, {vocab})",
            found=mask,
            fix="choose a token of the verifier's vocabulary",
        )


def _check_aux(rep: Report, config: dict, tensors: dict, vcfg: dict, expect: dict) -> None:
    ids = config.get("aux_hidden_state_layer_ids")
    field = "aux_hidden_state_layer_ids"
    if not (isinstance(ids, list) and ids and all(_is_int(i) for i in ids)):
        rep.add(
            "dflash.aux_missing",
            "error",
            field,
            "vLLM's update_dflash requires the verifier layers whose states the draft reads (a KeyError without)",
            expected="the ids used in training",
            found=ids,
            fix="write the aux layer ids the hidden states were extracted at",
        )
        return
    n = vcfg.get("num_hidden_layers")
    if _is_int(n) and any(not 0 <= i <= n for i in ids):
        rep.add(
            "aux.range",
            "error",
            field,
            f"ids outside [0, {n}] for a {n}-layer verifier (vLLM convention: id k = state entering layer k)",
            expected=f"[0, {n}]",
            found=[i for i in ids if not 0 <= i <= n],
            fix="use vLLM's convention",
        )
    if len(set(ids)) != len(ids):
        rep.add("aux.duplicate", "error", field, "each layer once", expected="distinct ids", found=ids,
                fix="list each layer once")  # fmt: skip
    if expect.get("aux_layer_ids") and sorted(set(ids)) != sorted(expect["aux_layer_ids"]):
        rep.add(
            "expect.aux_layer_ids",
            "error",
            field,
            "not the ids the hidden states were captured at",
            expected=sorted(expect["aux_layer_ids"]),
            found=ids,
            fix="rewrite the ids",
        )
    layer = config.get("transformer_layer_config") or {}
    width = config.get("target_hidden_size") or vcfg.get("hidden_size")
    fc = (tensors.get("fc.weight") or {}).get("shape")
    hidden = layer.get("hidden_size")
    if fc is not None and _is_int(width) and _is_int(hidden) and list(fc) != [hidden, len(ids) * width]:
        rep.add(
            "dflash.fc_width",
            "error",
            "fc.weight",
            f"vLLM builds fc for {len(ids)} aux states of {width} (aux ids x target_hidden_size or the verifier's "
            "hidden size) and refuses other weights when they load",
            expected=[hidden, len(ids) * width],
            found=list(fc),
            fix="train the draft on the states of these aux layer ids",
        )


def _check_causality(rep: Report, config: dict) -> None:
    layer = config.get("transformer_layer_config") or {}
    types = layer.get("layer_types") or []
    sliding = [t == SLIDING for t in types] if isinstance(types, list) else []
    if any(sliding) and not all(sliding):
        rep.add(
            "dflash.mixed_layers",
            "error",
            "transformer_layer_config.layer_types",
            "vLLM serves a DFlash draft with sliding and full attention layers only with its V2 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=1; the default runner raises NotImplementedError)",
            expected="one attention kind for every layer",
            found=types,
            fix="train every layer with full attention",
        )
        return
    non_causal = config.get("sliding_window_non_causal", True)
    if not (sliding and all(sliding)) and non_causal is not True:
        rep.add(
            "dflash.causal",
            "error",
            "sliding_window_non_causal",
            "speculators trains full-attention DFlash layers without a causal mask within the block, but vLLM "
            "serves every layer causal when this is false (dflash_config.causal = not sliding_window_non_causal): "
            "the served draft is not the trained one",
            expected=True,
            found=non_causal,
            fix="set sliding_window_non_causal: true",
        )


def _check_block(rep: Report, config: dict) -> None:
    block = config.get("block_size")
    if not (_is_int(block) and block >= 2):
        rep.add("dflash.block_size", "error", "block_size", "a DFlash block holds the anchor and the proposed "
                "tokens", expected="an integer >= 2", found=block, fix="write the block size used in training")  # fmt: skip
        return
    anchor = config.get("sample_from_anchor") is True
    if anchor:
        rep.add(
            "dflash.sample_from_anchor",
            "warning",
            "sample_from_anchor",
            "vLLM's V2 model runner (the default on GPUs with Triton) refuses a DFlash draft that samples from the "
            "anchor",
            expected=False,
            found=True,
            fix="train without sample_from_anchor, or serve with the V1 runner",
        )
    methods = (config.get("speculators_config") or {}).get("proposal_methods")
    first = methods[0] if isinstance(methods, list) and methods and isinstance(methods[0], dict) else {}
    want = block if anchor else block - 1
    if first.get("speculative_tokens") != want:
        rep.add(
            "dflash.speculative_tokens",
            "warning",
            "speculators_config.proposal_methods[0].speculative_tokens",
            f"a block of {block} proposes {want} token(s); `vllm serve <draft dir>` drafts this many per step",
            expected=want,
            found=first.get("speculative_tokens"),
            fix=f"set speculative_tokens: {want}",
        )


def _check_tensors(rep: Report, config: dict, tensors: dict, vcfg: dict, expect: dict) -> None:
    for name in tensors:
        if name.startswith("verifier_") or name.startswith("model."):
            rep.add(
                "names.verifier_tensor" if name.startswith("verifier_") else "names.model_prefix",
                "error",
                name,
                "vLLM's DFlash loader does not map this name, and an unknown name fails to load",
                found=name,
                fix="save the draft with speculators (it leaves the verifier's tensors out)",
            )
    vocab, vd = vcfg.get("vocab_size"), config.get("draft_vocab_size")
    if _is_int(vd) and _is_int(vocab) and vd < vocab:
        shape = (tensors.get("d2t") or {}).get("shape")
        if shape != [vd]:
            rep.add(
                "vocab.d2t",
                "error",
                "d2t",
                f"a draft vocabulary of {vd} of the verifier's {vocab} tokens needs d2t, the offset of each draft "
                "token to its verifier token (vLLM's draft_id_to_target_id)",
                expected=[vd],
                found=shape,
                fix="train the draft with the vocab maps",
            )
    if expect.get("draft_vocab_size") and vd != expect["draft_vocab_size"]:
        rep.add("expect.draft_vocab_size", "error", "draft_vocab_size", "not the draft vocabulary the build asked "
                "for", expected=expect["draft_vocab_size"], found=vd, fix="rebuild the vocab maps and the draft")  # fmt: skip
    head = (config.get("transformer_layer_config") or {}).get("head_dim")
    if expect.get("head_dim") and head != expect["head_dim"]:
        rep.add("expect.head_dim", "error", "transformer_layer_config.head_dim", "the draft's head_dim is not the "
                "one the build asked for", expected=expect["head_dim"], found=head,
                fix=f"rebuild the draft with head_dim {expect['head_dim']}")  # fmt: skip

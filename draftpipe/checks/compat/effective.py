"""The draft's effective config as vLLM builds it (speculators' ``update_eagle3``, EAGLE-style configs), and the
tensor shapes vLLM's EAGLE-3 model expects from it."""

from __future__ import annotations

# vllm/model_executor/models/registry.py (0.33): architectures that map to an EAGLE-3 draft class.
REGISTERED_EAGLE3 = {
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3",
    "PeagleLlamaForCausalLM",
    "PEagleDraftModel",
    "Eagle3MiniMaxM2ForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
    "Eagle3Qwen3ForCausalLM",
    "PeagleQwen3ForCausalLM",
}


QWEN3_EAGLE3 = {"Eagle3Qwen3ForCausalLM", "PeagleQwen3ForCausalLM"}


def detect_format(config: dict) -> str | None:
    """``"speculators"`` (``speculators_config`` and no top-level ``model_type``, vLLM ``get_config``),
    ``"eagle"`` (a plain HF config with ``architectures``), or ``None``."""
    if "speculators_config" in config or "speculators_model_type" in config:
        return "speculators"
    if config.get("architectures") or config.get("model_type"):
        return "eagle"
    return None


def model_config(config: dict, fmt: str) -> dict:
    """The config vLLM's EAGLE-3 model class sees.

    speculators: ``transformer_layer_config`` updated by ``update_eagle3`` (algos.py): ``draft_vocab_size`` copied
    (None -> V), ``target_hidden_size`` only if not None, ``norm_before_residual`` default **True**,
    ``norm_before_fc``/``fc_norm``/``norm_output`` default False, architecture from the layer ``model_type``, and
    the top-level aux ids if truthy. EAGLE: the config itself, architecture rewritten by ``EAGLEConfig``
    (kept if it starts or ends with ``Eagle3``, else prefixed with ``Eagle3``).
    """
    if fmt == "speculators":
        mc = dict(config.get("transformer_layer_config") or {})
        mc["draft_vocab_size"] = config.get("draft_vocab_size")
        if config.get("target_hidden_size") is not None:
            mc["target_hidden_size"] = config["target_hidden_size"]
        mc["norm_before_residual"] = config.get("norm_before_residual", True)
        for k in ("norm_before_fc", "fc_norm", "norm_output"):
            mc[k] = config.get(k, False)
        mt = mc.get("model_type", "llama")
        mc["architectures"] = [
            {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"}.get(mt, f"<{mt}>")
        ]
        if config.get("eagle_aux_hidden_state_layer_ids"):
            mc["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
        return mc
    mc = dict(config)
    archs = []
    for a in mc.get("architectures") or ["LlamaForCausalLM"]:
        archs.append(a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}")
    mc["architectures"] = archs
    mc.setdefault("norm_before_residual", False)
    eagle = mc.get("eagle_config") or {}
    if "norm_before_fc" in eagle:
        mc["norm_before_fc"] = eagle["norm_before_fc"]
    return mc


def effective(mc: dict, verifier: dict) -> dict:
    """Shape numbers and flags of the draft as vLLM builds it (ref §3.3, §4 and §8.2)."""
    H = mc.get("hidden_size")
    nh = mc.get("num_attention_heads")
    arch = (mc.get("architectures") or ["?"])[0]
    eagle = mc.get("eagle_config") or {}
    hd_explicit = mc.get("head_dim")
    hd = hd_explicit or (H // nh if H and nh else None)
    V = mc.get("vocab_size")
    Vd = mc.get("draft_vocab_size") or V
    T = mc["target_hidden_size"] if "target_hidden_size" in mc else H
    top_ids = mc.get("eagle_aux_hidden_state_layer_ids")
    eagle_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if arch in QWEN3_EAGLE3:  # qwen3_eagle3.py reads the top level first
        A = mc.get("num_aux_hidden_states") or len(top_ids or eagle_ids or [0, 0, 0])
    else:  # llama_eagle3.py: num_aux_hidden_states, else eagle_config ids, else 3 (vLLM #54526)
        A = mc.get("num_aux_hidden_states") or (len(eagle_ids) if eagle_ids else 3)
    return {
        "architecture": arch,
        "hidden_size": H,
        "num_attention_heads": nh,
        "num_key_value_heads": mc.get("num_key_value_heads") or nh,
        "head_dim": hd,
        "head_dim_explicit": hd_explicit is not None,
        "intermediate_size": mc.get("intermediate_size"),
        "num_hidden_layers": mc.get("num_hidden_layers", 1),
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "target_hidden_size": T,
        "num_aux_hidden_states": A,
        "aux_layer_ids_top_level": top_ids,
        "aux_layer_ids_eagle_config": eagle_ids,
        "use_aux_hidden_state": eagle.get("use_aux_hidden_state", True),
        "norm_before_fc": bool(mc.get("norm_before_fc", False)),
        "fc_norm": bool(mc.get("fc_norm", False)),
        "norm_output": bool(mc.get("norm_output", False)),
        "norm_before_residual": bool(mc.get("norm_before_residual", False)),
        "attention_bias": bool(mc.get("attention_bias") or mc.get("bias") or mc.get("qkv_bias")),
        "mlp_bias": bool(mc.get("mlp_bias", False)),
        "hidden_act": mc.get("hidden_act", "silu"),
        "max_position_embeddings": mc.get("max_position_embeddings"),
        "verifier_hidden_size": verifier.get("hidden_size"),
        "verifier_vocab_size": verifier.get("vocab_size"),
        "verifier_num_layers": verifier.get("num_hidden_layers"),
        "verifier_max_position_embeddings": verifier.get("max_position_embeddings"),
    }


def expected_shapes(e: dict) -> tuple[dict[str, list[int]], set[str]]:
    """``({tensor name: shape}, required names)`` for the effective config (ref §1.2-1.3)."""
    H, nh, nkv, hd, I = (
        e["hidden_size"],
        e["num_attention_heads"],
        e["num_key_value_heads"],
        e["head_dim"],
        e["intermediate_size"],
    )
    A, T, V, Vd = e["num_aux_hidden_states"], e["target_hidden_size"], e["vocab_size"], e["draft_vocab_size"]
    T = H if T is None else T  # an explicit null (config.target_hidden_size_null): vLLM fails; check the rest
    shapes: dict[str, list[int]] = {"norm.weight": [H], "embed_tokens.weight": [V, H], "lm_head.weight": [Vd, H]}
    required = {"norm.weight"}
    if e["use_aux_hidden_state"]:
        shapes["fc.weight"] = [H, A * T]
        required.add("fc.weight")
        if e["norm_before_fc"]:
            shapes["input_norm.weight"] = [A * T]
            required.add("input_norm.weight")
        if e["fc_norm"]:
            for i in range(A):
                shapes[f"fc_norm.{i}.weight"] = [T]
                required.add(f"fc_norm.{i}.weight")
    for layer in range(e["num_hidden_layers"]):
        inp = 2 * H if layer == 0 else H
        p = f"layers.{layer}."
        layer_shapes = {
            "self_attn.q_proj.weight": [nh * hd, inp],
            "self_attn.k_proj.weight": [nkv * hd, inp],
            "self_attn.v_proj.weight": [nkv * hd, inp],
            "self_attn.o_proj.weight": [H, nh * hd],
            "mlp.gate_proj.weight": [I, H],
            "mlp.up_proj.weight": [I, H],
            "mlp.down_proj.weight": [H, I],
            "input_layernorm.weight": [H],
            "post_attention_layernorm.weight": [H],
        }
        if layer == 0:
            layer_shapes["hidden_norm.weight"] = [H]
        if e["architecture"] in QWEN3_EAGLE3:
            layer_shapes["self_attn.q_norm.weight"] = [hd]
            layer_shapes["self_attn.k_norm.weight"] = [hd]
        if e["attention_bias"]:
            layer_shapes.update(
                {
                    "self_attn.q_proj.bias": [nh * hd],
                    "self_attn.k_proj.bias": [nkv * hd],
                    "self_attn.v_proj.bias": [nkv * hd],
                    "self_attn.o_proj.bias": [H],
                }
            )
        if e["mlp_bias"]:
            layer_shapes.update({"mlp.gate_proj.bias": [I], "mlp.up_proj.bias": [I], "mlp.down_proj.bias": [H]})
        for k, v in layer_shapes.items():
            shapes[p + k] = v
            required.add(p + k)
    if Vd != e["verifier_vocab_size"]:
        shapes["d2t"] = [Vd]
        shapes["t2d"] = [V]
        required |= {"d2t", "lm_head.weight"}
    if e["verifier_hidden_size"] and H != e["verifier_hidden_size"]:
        required |= {"embed_tokens.weight", "lm_head.weight"}
    return shapes, required

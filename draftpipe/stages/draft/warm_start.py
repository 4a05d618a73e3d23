"""``draft.init: verifier``: the draft starts from the verifier's own weights instead of random ones.

EAGLE-3's draft layer reads ``fc(cat(aux hidden states))`` beside the next token's embedding and is trained from a
random start (speculators, SpecForge). On a small data budget most of its steps go to learning what a layer of the
verifier already knows. With ``init: verifier`` the draft's first decoder layer starts as a copy of the verifier's
layer ``L`` = the last aux layer id (vLLM captures the residual stream entering layer ``L``):

- ``fc`` starts as the identity on the aux slot of layer ``L`` (zeros on the other slots), so the draft layer first
  sees what the verifier's layer ``L`` sees;
- the layer's ``q_proj``/``k_proj``/``v_proj`` take the verifier's on their hidden-state half (input columns
  ``[H, 2H)``; the embedding half keeps its random start), ``o_proj``, the MLP and both norms of the layer
  (``hidden_norm`` <- ``input_layernorm``, ``post_attention_layernorm``) are the verifier's;
- the output ``norm`` is the verifier's final norm (the draft's ``lm_head`` already starts as the verifier's).

Nothing else changes (the random draws of the default start are made as before). Training then moves every one of
these weights. Measured on the SmolLM2 preset (README): validation accuracy per position 0.450 / 0.227 / 0.120 after
3 epochs against 0.415 / 0.193 / 0.091 from the random start, on the same samples and steps.
"""

from __future__ import annotations

#: (draft parameter, the verifier's tensor of layer ``L`` it starts from, copied onto the hidden-state half of a
#: ``[out, 2H]`` input projection); Llama naming, as speculators' draft
_COPIES = (
    ("layers.0.self_attn.q_proj.weight", "self_attn.q_proj.weight", True),
    ("layers.0.self_attn.k_proj.weight", "self_attn.k_proj.weight", True),
    ("layers.0.self_attn.v_proj.weight", "self_attn.v_proj.weight", True),
    ("layers.0.self_attn.o_proj.weight", "self_attn.o_proj.weight", False),
    ("layers.0.mlp.gate_proj.weight", "mlp.gate_proj.weight", False),
    ("layers.0.mlp.up_proj.weight", "mlp.up_proj.weight", False),
    ("layers.0.mlp.down_proj.weight", "mlp.down_proj.weight", False),
    ("layers.0.hidden_norm.weight", "input_layernorm.weight", False),
    ("layers.0.post_attention_layernorm.weight", "post_attention_layernorm.weight", False),
)


def source_layer(aux_ids: list[int]) -> int:
    """The verifier layer ``L`` the draft starts from: the last aux layer id (the deepest captured input)."""
    return max(aux_ids)


def init_from_verifier(model, verifier_dir: str, aux_ids: list[int]) -> None:
    """Start ``model`` (an untrained speculators ``Eagle3DraftModel``) from the verifier's weights, in place (see
    the module docstring), from layer :func:`source_layer`.

    Args:
        model: the draft; its first layer reads ``[1, T, 2H]`` (embedding, hidden state) and ``fc`` maps
            ``len(aux_ids) * H`` to ``H``.
        verifier_dir: the verifier's Hugging Face directory (one ``model.safetensors`` or a sharded index), read
            with speculators' ``load_model_layers`` (only the tensors copied are read).
        aux_ids: the aux layer ids in the order ``fc`` concatenates them (the shards' order).

    Raises:
        ValueError: naming ``draft.init`` and the tensor, when the verifier's layer ``L`` lacks a tensor the copy
            needs (e.g. a mixture-of-experts MLP) or its shape differs from the draft's (e.g. ``draft.head_dim``
            set to another head size than the verifier's).
    """
    import torch
    from speculators.utils.loading import load_model_layers

    layer_id = source_layer(aux_ids)
    copies = [(name, f"model.layers.{layer_id}.{key}", half) for name, key, half in _COPIES]
    copies.append(("norm.weight", "model.norm.weight", False))
    loaded = load_model_layers([key for _, key, _ in copies], verifier_dir)
    params = dict(model.named_parameters())
    hidden = model.hidden_size
    with torch.no_grad():
        for name, key, half in copies:
            target = params[name][:, hidden:] if half else params[name]
            if key not in loaded:
                raise ValueError(
                    f"draft.init: verifier copies the verifier's layer {layer_id} (the last aux layer id), but "
                    f"{verifier_dir} has no tensor {key}: use draft.init: random for this verifier"
                )
            if tuple(loaded[key].shape) != tuple(target.shape):
                raise ValueError(
                    f"draft.init: verifier: the verifier's {key} is {list(loaded[key].shape)}, the draft's needs "
                    f"{list(target.shape)} (draft.head_dim and the draft's heads must be the verifier's): use "
                    "draft.init: random"
                )
            target.copy_(loaded[key].to(target.dtype))
        fc = model.fc.weight  # [H, len(aux_ids) * H]
        slot = list(aux_ids).index(layer_id)
        fc.zero_()
        fc[:, slot * hidden : (slot + 1) * hidden].copy_(torch.eye(hidden, dtype=fc.dtype))

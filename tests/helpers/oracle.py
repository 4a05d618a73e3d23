"""The oracle of the hidden-state tests: the verifier run in transformers with forward hooks, one sequence at a time."""

from __future__ import annotations

from typing import Any

import torch

from draftpipe.formats.hidden_states import sequence_and_mask


def capture_layers(model: Any, input_ids: torch.Tensor, layer_ids: list[int]) -> dict[int, torch.Tensor]:
    """The oracle: run the verifier in transformers on one sequence and return the hidden states at the given
    vLLM layer ids (forward hooks on the embedding and the decoder layers).

    Args:
        model: a Hugging Face decoder (``*ForCausalLM`` with ``.model.embed_tokens`` and ``.model.layers``).
        input_ids: int64 ``[T]``.
        layer_ids: ids in ``[0, N]`` (vLLM convention, see module docstring).

    Returns:
        ``{id: float tensor [T, H]}`` in the model's dtype; id ``N`` is the pre-norm output of the last layer.
    """
    import torch

    inner = model.model
    captured: dict[int, torch.Tensor] = {}
    hooks = []

    def keep(idx):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[idx] = out.detach()[0]

        return hook

    wanted = set(layer_ids)
    if 0 in wanted:
        hooks.append(inner.embed_tokens.register_forward_hook(keep(0)))
    for k in wanted - {0}:
        hooks.append(inner.layers[k - 1].register_forward_hook(keep(k)))
    try:
        with torch.no_grad():
            model(input_ids=input_ids.unsqueeze(0), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: captured[k] for k in layer_ids}


def build_sample(model: Any, row: dict, aux_ids: list[int], num_layers: int, max_len: int, dtype: torch.dtype) -> dict:
    """The oracle's training sample of one completion row (see the module docstring for names and shapes); the
    pipeline's come from :func:`draftpipe.stages.extract.build_samples`.

    The sequence is ``prompt_token_ids + completion_token_ids`` truncated to ``max_len`` tokens.
    """
    import torch

    ids, mask = sequence_and_mask(row, max_len)
    input_ids = torch.tensor(ids, dtype=torch.long)
    states = capture_layers(model, input_ids, sorted(set(aux_ids) | {num_layers}))
    return {
        "input_ids": input_ids,
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "hidden_states": torch.cat([states[k] for k in aux_ids], dim=-1).to(dtype).contiguous(),
        "verifier_last_hidden_states": states[num_layers].to(dtype).contiguous(),
    }


def load_verifier_model(path: str, dtype: str = "float32") -> Any:
    """Load the verifier with transformers (``AutoModelForCausalLM``, eager attention, eval mode) for the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    return model.eval()

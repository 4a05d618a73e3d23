"""The verifier's states as vLLM's extraction engine captures them, and the training sample they make.

vLLM's ``extract_hidden_states`` method captures, per prompt token, the states at the layer ids it was asked for,
sorted and de-duplicated (``vllm/model_executor/models/extract_hidden_states.py``): a request file holds
``hidden_states [T, n_ids, H]``. A sample (:mod:`draftpipe.formats.hidden_states`) keeps the aux ids' columns
concatenated, ascending, and id ``N`` (the last pre-norm state) apart. Used by the ``hidden_states`` stage
(:mod:`draftpipe.stages.extract`) and by the streamed draft (:mod:`draftpipe.stages.draft.stream`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from draftpipe.formats.hidden_states import quantize_sample

if TYPE_CHECKING:
    import torch


def engine_layer_ids(aux_ids: Iterable[int], num_layers: int) -> list[int]:
    """The layer ids the engine captures: the aux ids and ``N`` (the last pre-norm state), sorted and distinct,
    which is vLLM's own order.

    Raises:
        ValueError: an id is outside ``[0, N]``.
    """
    ids = sorted(set(aux_ids) | {num_layers})
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} are outside [0, {num_layers}] for a verifier with {num_layers} layers")
    return ids


def sample_of(
    ids: list[int], mask: list[int], states: torch.Tensor, aux_ids: list[int], num_layers: int, dtype
) -> dict:
    """One training sample from the engine's states of its sequence (the format of
    :mod:`draftpipe.formats.hidden_states`, states in the stored dtype ``dtype``).

    Args:
        ids, mask: the sequence and its loss mask, ``T`` tokens each.
        states: float ``[T, n_ids, H]`` from the engine, columns in :func:`engine_layer_ids` order.
        aux_ids: aux layer ids (stored ascending); num_layers: ``N``.
        dtype: the stored dtype (a torch dtype or its name), see :func:`build_samples`.

    Raises:
        ValueError: ``aux_ids`` repeat an id, or ``dtype`` is not a float dtype.
    """
    import torch

    if len(set(aux_ids)) != len(list(aux_ids)):
        raise ValueError(f"aux layer ids {list(aux_ids)} repeat an id")
    column = {lid: j for j, lid in enumerate(engine_layer_ids(aux_ids, num_layers))}
    order = [column[k] for k in sorted(aux_ids)]
    stored = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    sample = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "hidden_states": states[:, order].reshape(len(ids), -1),
        "verifier_last_hidden_states": states[:, column[num_layers]],
    }
    return quantize_sample(sample, stored)

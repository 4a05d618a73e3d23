"""The draft's packed TTT attention equals sdpa over speculators' own masks, values and gradients."""

import pytest
import torch
from speculators.models.eagle3.attention import create_combined_mask_mod, extend_dense_mask_for_draft_tokens
from torch.nn.attention.flex_attention import create_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draftpipe.stages.draft import attention
from draftpipe.stages.draft.training import attention_implementation


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def ttt_mask(doc_lengths: list[int], t: int, k: int) -> torch.Tensor:
    """speculators' dense mask for a packed batch of these documents padded to ``t``, after ``k`` TTT steps."""
    ids = torch.full((t,), -1, dtype=torch.long)
    at = 0
    for i, n in enumerate(doc_lengths):
        ids[at : at + n] = i
        at += n
    mask = create_mask(create_combined_mask_mod(ids, t), None, None, t, t, device="cpu")
    for _ in range(k):
        mask = extend_dense_mask_for_draft_tokens(mask, t)
    return mask


def run(fn, mask, t, k, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, t, dim, generator=g, requires_grad=True)
    key = torch.randn(1, kv_heads, t * (k + 1), dim, generator=g, requires_grad=True)
    value = torch.randn(1, kv_heads, t * (k + 1), dim, generator=g, requires_grad=True)
    out, _ = fn(_Module(heads // kv_heads), q, key, value, mask, scaling=dim**-0.5)
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    return out.detach(), q.grad, key.grad, value.grad


@pytest.mark.parametrize(
    "docs, t, k",
    [
        ([300, 500, 700, 400], 2048, 2),  # documents longer than a chunk, padding at the end
        ([37, 5, 90, 200], 333, 3),  # T not a multiple of the chunk, tiny documents
        ([64, 64], 128, 0),  # the first TTT step: no diagonal block yet
        ([1000], 1000, 1),  # one document filling the batch (looks back over many chunks)
    ],
)
def test_packed_ttt_attention_equals_sdpa(docs, t, k):
    mask = ttt_mask(docs, t, k)
    assert attention.ttt_mask_blocks(mask, t) == k
    ours = run(attention.packed_ttt_attention, mask, t, k)
    ref = run(sdpa_attention_forward, mask, t, k)
    for a, b, name in zip(ours, ref, ["output", "query grad", "key grad", "value grad"]):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)


def test_a_mask_of_another_shape_falls_back_to_sdpa():
    t, k = 256, 1
    mask = ttt_mask([256], t, k)
    assert attention.ttt_mask_blocks(mask, t) == k
    bidirectional = mask.clone()
    bidirectional[0, 0, :, :t] = True  # a query attends to later tokens: outside every chunk's window
    assert attention._windows(bidirectional[0, 0, :, :t], t, k) is None
    torch.testing.assert_close(
        run(attention.packed_ttt_attention, bidirectional, t, k)[0], run(sdpa_attention_forward, bidirectional, t, k)[0]
    )
    not_diagonal = mask.clone()
    not_diagonal[0, 0, 3, t + 5] = True
    assert attention.ttt_mask_blocks(not_diagonal, t) is None
    assert attention.ttt_mask_blocks(mask.float(), t) is None


def test_dropout_is_refused_and_the_cpu_draft_uses_the_packed_attention():
    mask = ttt_mask([8], 8, 0)
    with pytest.raises(ValueError, match="dropout"):
        attention.packed_ttt_attention(_Module(1), *[torch.zeros(1, 1, 8, 4)] * 3, mask, dropout=0.1)
    assert attention_implementation(on_gpu=True) == "simple_flex_attention"
    name = attention_implementation(on_gpu=False)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS[name] is attention.packed_ttt_attention

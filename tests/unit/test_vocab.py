"""Vocab maps: counts over loss-masked tokens, d2t offsets and t2d mask in vLLM's semantics."""

from __future__ import annotations

import pytest
import torch

from draftpipe.formats.vocab import build_maps, check_maps, count_tokens, frequency_table, read_maps, write_maps


def sample(ids, mask):
    return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask)}


def test_counts_only_loss_masked_tokens():
    counts = count_tokens([sample([1, 5, 5, 7], [0, 1, 1, 1]), sample([5, 9], [1, 0])], vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 3, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="outside the verifier vocabulary"):
        count_tokens([sample([12], [1])], vocab_size=10)


def test_d2t_offsets_and_t2d_mask():
    counts = torch.tensor([0, 9, 0, 4, 7, 0, 1, 0, 0, 8])
    d2t, t2d = build_maps(counts, 4)
    # top-4 by count: 1 (9), 9 (8), 4 (7), 3 (4) -> sorted ids [1, 3, 4, 9]
    assert d2t.dtype == torch.long and d2t.tolist() == [1, 2, 2, 6]
    assert (torch.arange(4) + d2t).tolist() == [1, 3, 4, 9]
    assert t2d.dtype == torch.bool and torch.nonzero(t2d).flatten().tolist() == [1, 3, 4, 9]
    check_maps(d2t, t2d, 10)


def test_too_few_seen_tokens_fill_with_lowest_unseen_ids():
    d2t, t2d = build_maps(torch.tensor([0, 0, 5, 0, 0, 0]), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2]


def test_no_mapping_when_draft_vocab_equals_verifier_vocab(tmp_path):
    d2t, t2d = build_maps(torch.tensor([1, 2, 3]), 3)
    assert d2t is None and t2d is None
    write_maps(tmp_path / "m.safetensors", None, None, 3, 3)
    assert read_maps(str(tmp_path / "m.safetensors")) == (None, None, 3)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_maps(torch.tensor([1, 2, 3]), 4)


def test_check_maps_rejects_broken_mappings():
    d2t, t2d = build_maps(torch.tensor([5, 4, 3, 2, 1, 0]), 3)
    with pytest.raises(ValueError, match="int64"):
        check_maps(d2t.to(torch.int32), t2d, 6)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_maps(torch.tensor([0, 0, -1]), t2d, 6)
    with pytest.raises(ValueError, match="outside"):
        check_maps(torch.tensor([0, 1, 9]), t2d, 6)
    wrong = t2d.clone()
    wrong[5] = True
    wrong[0] = False
    with pytest.raises(ValueError, match="disagree"):
        check_maps(d2t, wrong, 6)


def test_roundtrip_and_frequency_table(tmp_path):
    counts = torch.tensor([0, 9, 0, 4, 7, 0])
    d2t, t2d = build_maps(counts, 2)
    write_maps(tmp_path / "m.safetensors", d2t, t2d, 6, 2)
    d2t2, t2d2, vd = read_maps(str(tmp_path / "m.safetensors"))
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2) and vd == 2
    table = frequency_table(counts, t2d)
    assert table["token_id"].tolist()[:3] == [1, 4, 3]
    assert table["in_draft"].tolist()[:3] == [True, True, False]
    assert table["frequency"].sum() == pytest.approx(1.0)

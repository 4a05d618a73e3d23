"""The draft's training data: hidden-state shards as a speculators dataset (:class:`ShardDataset`), and where the
training tokens go when samples are packed into batches."""

from __future__ import annotations

from speculators.models.eagle3.data import shift_batch
from speculators.train.data import BaseDataset, CollateFn
from torch.utils.data import DataLoader

from draftpipe.formats.hidden_states import SCALE_KEYS, dequantize_sample, iter_shard
from draftpipe.stages.draft.ranks import StepBatchSampler


def window_accounting(lengths: list[int], trained: list[int], trained_in_window: list[int], max_len: int) -> dict:
    """Where the training tokens go when samples are packed into batches of ``max_len`` (``draft.total_seq_len``)
    tokens: a longer sample is cut to its first ``max_len`` tokens (speculators' ``CollateFn``), and one with no
    token to learn there is left out (it would make a step of loss 0).

    Args:
        lengths: tokens per sample.
        trained: loss-mask tokens per sample.
        trained_in_window: loss-mask tokens within each sample's first ``max_len`` tokens.
        max_len: the packed batch's length.

    Returns:
        ``samples``, ``tokens``, ``trained_tokens`` (as stored); ``long_samples`` (longer than ``max_len``),
        ``cut_trained_tokens`` (trained tokens past the window, lost), ``dropped_samples`` (long ones with nothing to
        learn in the window), ``used_tokens`` and ``used_trained_tokens`` (what the draft trains on per epoch), and
        ``kept_indices``.
    """
    kept = [i for i, (n, w) in enumerate(zip(lengths, trained_in_window)) if n <= max_len or w > 0]
    return {
        "samples": len(lengths),
        "tokens": sum(lengths),
        "trained_tokens": sum(trained),
        "long_samples": sum(n > max_len for n in lengths),
        "cut_trained_tokens": sum(t - w for t, w in zip(trained, trained_in_window)),
        "dropped_samples": len(lengths) - len(kept),
        "used_tokens": sum(min(lengths[i], max_len) for i in kept),
        "used_trained_tokens": sum(trained_in_window[i] for i in kept),
        "kept_indices": kept,
    }


def accounting_line(split: str, a: dict, max_len: int) -> str:
    """One log line for :func:`window_accounting`'s figures of a split (a warning when samples were cut)."""
    line = (
        f"draft {split} data: {a['samples'] - a['dropped_samples']} samples, {a['used_tokens']:,} tokens, "
        f"{a['used_trained_tokens']:,} trained on per epoch"
    )
    if a["long_samples"]:
        line += (
            f"; WARNING: {a['long_samples']} sample(s) longer than draft.total_seq_len={max_len} are cut to their first "
            f"{max_len} tokens ({a['cut_trained_tokens']:,} of {a['trained_tokens']:,} trained tokens lost), "
            f"{a['dropped_samples']} of them left out with no token to learn there; raise draft.total_seq_len to keep "
            "them"
        )
    return line


#: DataLoader worker processes of one training rank on an accelerator, at most
MAX_LOADER_WORKERS = 4


def loader_workers(on_gpu: bool, cpus: int, streamed: bool = False, asked: int | None = None) -> int:
    """DataLoader worker processes that read and pack one training rank's batches ahead of its steps:
    ``asked`` (``resources.draft.loader_workers``) when set, else automatic.

    None for streamed states, whatever was asked (the :class:`draftpipe.stages.draft.stream.Spool` is read by the
    process that owns it). Automatic: none on a machine without an accelerator (the draft trains on the cores the
    workers would take); on an accelerator, the rank's CPUs less its own thread (``cpus``, its ``threads`` share),
    at most :data:`MAX_LOADER_WORKERS`, and none when that leaves fewer than 2. Reading and packing one 8,192-token
    batch of an 8B verifier's states (4 x 4,096 bfloat16 states per token) takes about 0.15 s of one CPU core, more than
    its draft's training step on an H200 (0.115 s): several workers keep ahead of the device, but a worker hands
    each batch to the trainer through shared memory, one more copy, so one worker alone is slower than the trainer's
    own process (``benchmarks/gpu_train.py --parts loader``), which reads the next batch while the device runs the
    step before."""
    if streamed:
        return 0
    if asked is not None:
        return asked
    n = min(MAX_LOADER_WORKERS, cpus - 1)
    return n if on_gpu and n >= 2 else 0


def packed_loader(ds, s, hidden_size: int, aux_layers: int, rank_of: tuple[int, int], *, workers: int = 0,
                  pin_memory: bool = False, shift: bool = True):  # fmt: skip
    """The DataLoader of a training rank: ``[1, s.total_seq_len]`` packed batches of ``ds`` (speculators'
    ``CollateFn``, with EAGLE-3's ``shift_batch`` when ``shift``: DFlash reads the batch unshifted, as speculators'
    CLI gives it; states ``[1, T, aux_layers * hidden_size]`` in ``ds.hidden_states_dtype``),
    the batches of each step from :class:`draftpipe.stages.draft.ranks.StepBatchSampler` (speculators' multipack
    packing, ``s.batches_per_step`` per step shared by the ranks; ``rank_of`` = ``(rank, world size)``). The order
    is the sampler's, drawn in this process: ``workers`` processes (:func:`loader_workers`, kept from epoch to
    epoch) change when a batch is read, never which."""
    sampler = StepBatchSampler(ds.approx_lengths, s.total_seq_len, s.batches_per_step, *rank_of, s.seed)
    collate = CollateFn(
        s.total_seq_len,
        hidden_size,
        num_target_layers=aux_layers,
        dtype=ds.hidden_states_dtype,
        preprocess=shift_batch if shift else None,
    )
    return DataLoader(ds, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0,
                      pin_memory=pin_memory, collate_fn=collate)  # fmt: skip


class SplitDataset(BaseDataset):
    """A speculators dataset over one split of a sample sequence: samples ``k % val_every == val_every-1`` form
    the validation split (``split="val"``), the rest the training split; samples with nothing to learn within the
    first ``max_len`` tokens are left out and counted (:func:`window_accounting`). ``global_index[i]`` is the
    position of dataset sample ``i`` in the whole sequence. Subclasses give ``_get_raw_data``."""

    def __init__(self, samples, max_len: int, split: str, val_every: int, hidden_states_dtype):
        chosen = []
        for k, sample in enumerate(samples):
            is_val = val_every > 1 and k % val_every == val_every - 1
            if is_val == (split == "val"):
                chosen.append((k, sample))
        # a sample longer than the packed batch is cut to its first max_len tokens (speculators' CollateFn); one
        # with no token to learn there would be a step of loss 0: left out, and counted (window_accounting)
        masks = [sample["loss_mask"] for _, sample in chosen]
        self.accounting = window_accounting(
            [int(m.shape[0]) for m in masks],
            [int(m.sum()) for m in masks],
            [int(m[:max_len].sum()) for m in masks],
            max_len,
        )
        keep = set(self.accounting.pop("kept_indices"))
        self.global_index = [k for i, (k, _) in enumerate(chosen) if i in keep]
        self.samples = [sample for i, (_, sample) in enumerate(chosen) if i in keep]
        super().__init__(max_len, hidden_states_dtype)

    def _compute_approx_lengths(self):
        return [min(int(s["input_ids"].shape[0]), self.max_len) for s in self.samples]

    def __len__(self):
        return len(self.samples)


class ShardDataset(SplitDataset):
    """speculators dataset over draftpipe hidden-state shards (:class:`SplitDataset` of their samples in order)."""

    def __init__(self, shards: list[str], max_len: int, split: str, val_every: int, hidden_states_dtype):
        # as stored (a float8 shard's states stay float8 in memory, with their scales)
        samples = (
            {**sample, "input_ids": sample["input_ids"].long(), "loss_mask": sample["loss_mask"].long()}
            for path in shards
            for sample in iter_shard(path)
        )
        super().__init__(samples, max_len, split, val_every, hidden_states_dtype)

    def _get_raw_data(self, index):
        # float8 states times their scales, in the training dtype (hidden_states.dtype float8_e4m3fn)
        sample = {k: v.clone() for k, v in self.samples[index].items()}
        return dequantize_sample(sample, self.hidden_states_dtype) if SCALE_KEYS["hidden_states"] in sample else sample

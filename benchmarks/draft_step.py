"""Benchmark: tokens/s of one draft training step (forward, backward, optimizer) on a CPU, two attentions side by side.

    .venv/bin/python benchmarks/draft_step.py [--steps 8] [--seq-len 2048] [--threads 2] [--fp8]

The same draft (speculators' ``Eagle3DraftModel`` for the embedded stories260K, 1 layer, 3 TTT steps, seed 0) on
the same packed batches of hidden states (TinyStories prompts run through the verifier, as in
``benchmarks/draft_ranks.py``), with

- ``sdpa``: the attention speculators trains with on a CPU (``speculators train --draft-attn-impl sdpa``; its
  default, flex attention, needs a GPU): every query against every key of every TTT step under a dense mask;
- ``packed``: :mod:`draftpipe.stages.draft.attention`, what the ``draft`` rule trains with on a CPU: the same values over only
  the columns that attend.

Each timed step follows two warm-up steps; the figure is the median over ``--steps``. The loss and gradients of
the two are compared on one batch (they must agree to float rounding). ``--fp8`` also times the same steps on
float8 shards (``hidden_states.dtype: float8_e4m3fn``, dequantised when batched) and reports the shard bytes.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def make_model(verifier: str, maps: str, attn: str, seq_len: int):
    import torch

    from draftpipe.formats.vocab import read_maps
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import attention_implementation, build_draft

    d2t, t2d, vd = read_maps(maps)
    s = DraftSettings(num_layers=1, ttt_steps=3, lr=3e-3, total_seq_len=seq_len, seed=0)
    impl = attention_implementation(on_gpu=False) if attn == "packed" else attn
    model = build_draft(verifier, [1, 2, 4], d2t, t2d, vd, s, impl)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def batches(shards: list[str], seq_len: int, n: int) -> list[dict]:
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from torch.utils.data import DataLoader

    from draftpipe.formats.hidden_states import read_shard_metadata
    from draftpipe.stages.draft.data import ShardDataset
    from draftpipe.stages.draft.ranks import StepBatchSampler

    hidden = read_shard_metadata(shards[0])["hidden_size"]
    ds = ShardDataset(shards, seq_len, "train", 0, torch.float32)
    sampler = StepBatchSampler(ds.approx_lengths, seq_len, 1, 0, 1, 0)
    collate = CollateFn(seq_len, hidden, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)
    out = []
    epoch = 0
    while len(out) < n:
        sampler.set_epoch(epoch)
        out += list(DataLoader(ds, batch_sampler=sampler, collate_fn=collate))
        epoch += 1
    return out[:n]


def call_kwargs():
    from speculators.losses import resolve_loss_config

    return {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": resolve_loss_config("kl_div", "eager")}


def time_steps(model, opt, data: list[dict]) -> dict:
    kw = call_kwargs()
    times = []
    for i, batch in enumerate(data):
        t0 = time.perf_counter()
        opt.zero_grad()
        _, loss, _ = model(**batch, **kw)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if i >= 2:  # two warm-up steps
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t0))
    fwd, bwd, step = (statistics.median(x) for x in zip(*times))
    tokens = int(data[0]["input_ids"].numel())
    return {"forward_s": fwd, "backward_s": bwd, "step_s": step, "tokens_per_s": tokens / step}


def agreement(verifier: str, maps: str, batch: dict, seq_len: int) -> dict:
    """Loss and largest gradient difference of the two attentions on one batch, from the same weights."""
    a, _ = make_model(verifier, maps, "packed", seq_len)
    b, _ = make_model(verifier, maps, "sdpa", seq_len)
    b.load_state_dict(a.state_dict())
    kw = call_kwargs()
    losses = []
    for m in (a, b):
        _, loss, _ = m(**batch, **kw)
        loss.backward()
        losses.append(float(loss.detach()))
    grad = max(
        float((p.grad - q.grad).abs().max()) for p, q in zip(a.parameters(), b.parameters()) if p.grad is not None
    )
    return {"loss_packed": losses[0], "loss_sdpa": losses[1], "max_grad_diff": grad}


def fp8_shards(shards: list[str], out: Path) -> tuple[list[str], float]:
    """The shards re-stored as float8 (:func:`draftpipe.formats.hidden_states.quantize_sample`); the bytes ratio."""
    import torch

    from draftpipe.formats.hidden_states import (
        dequantize_sample,
        iter_shard,
        quantize_sample,
        read_shard_metadata,
        write_shard,
    )

    paths, before, after = [], 0, 0
    for src in shards:
        meta = {k: v for k, v in read_shard_metadata(src).items() if k not in ("num_samples", "num_tokens")}
        samples = [quantize_sample(dequantize_sample(s, torch.float32), "float8_e4m3fn") for s in iter_shard(src)]
        dst = out / (Path(src).stem + ".fp8.safetensors")
        write_shard(str(dst), samples, {**meta, "dtype": "float8_e4m3fn"})
        paths.append(str(dst))
        before, after = before + Path(src).stat().st_size, after + dst.stat().st_size
    return paths, after / before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per packed batch (draft.total_seq_len)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp8", action="store_true", help="also time float8 shards and report their bytes")
    args = ap.parse_args()
    import torch
    from draft_ranks import build_data

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        verifier, shards, maps = build_data(Path(tmp))
        data = batches(shards, args.seq_len, args.steps + 2)
        results = {}
        for attn in ("sdpa", "packed"):
            model, opt = make_model(verifier, maps, attn, args.seq_len)
            results[attn] = time_steps(model, opt, data)
            r = results[attn]
            print(
                f"{attn:>7}: {r['tokens_per_s']:8.0f} tokens/s (step {r['step_s']:.3f} s: forward {r['forward_s']:.3f}"
                f", backward {r['backward_s']:.3f})",
                flush=True,
            )
        out = {
            "tokens_per_step": int(data[0]["input_ids"].numel()),
            "tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in results.items()},
            "ratio_packed_to_sdpa": round(results["packed"]["tokens_per_s"] / results["sdpa"]["tokens_per_s"], 2),
            "agreement": agreement(verifier, maps, data[0], args.seq_len),
        }
        if args.fp8:
            paths, ratio = fp8_shards(shards, Path(tmp))
            model, opt = make_model(verifier, maps, "packed", args.seq_len)
            fp8 = time_steps(model, opt, batches(paths, args.seq_len, args.steps + 2))
            out["fp8"] = {"bytes_ratio_to_bf16": round(ratio, 3), "tokens_per_s": round(fp8["tokens_per_s"], 1)}
        print(json.dumps(out))


if __name__ == "__main__":
    main()

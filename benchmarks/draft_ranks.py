"""Draft training time per epoch with 1 rank and with N ranks, as a ratio measured in one run on the same data.

    .venv/bin/python benchmarks/draft_ranks.py [--ranks 2] [--epochs 3] [--threads 2] [--fsdp]

Both runs train the same draft (the embedded stories260K, hidden-state shards of the TinyStories prompts captured
with transformers, ``batches_per_step = ranks`` packed batches of 256 tokens per step), so they do the same
arithmetic: the 1-rank run accumulates the gradients of a step's batches, the N-rank run shares them. The time of
an epoch is the difference between an ``--epochs`` run and a 1-epoch run, divided by ``epochs - 1``, so process
start, imports and the torchrun rendezvous cancel out; the whole wall time is printed too. On a CPU machine the ranks compete for the same cores (``threads // ranks`` threads each): the
ratio says what the extra processes, the gloo all-reduce and the smaller per-rank matmuls cost there, not how
training scales on GPUs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the transformers oracle (tests/helpers/oracle.py)
AUX = [1, 2, 4]

TRAIN = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from draftpipe.stages.draft.settings import DraftSettings
from draftpipe.stages.draft.training import train_draft
verifier, maps, work, epochs, ranks, per_step, threads, fsdp = sys.argv[1:9]
shards = sys.argv[9:]
import torch
torch.set_num_threads(int(threads))
s = DraftSettings(epochs=int(epochs), lr=3e-3, total_seq_len=256, val_every=5, seed=0, batches_per_step=int(per_step))
train_draft(verifier, shards, maps, work, s, ranks=int(ranks), threads=int(threads), fsdp=fsdp == "1")
"""


def build_data(out: Path) -> tuple[str, list[str], str]:
    """The embedded verifier, two hidden-state shards of the TinyStories prompts and their vocab maps."""
    import torch
    from helpers.oracle import build_sample, load_verifier_model
    from transformers import AutoTokenizer

    from draftpipe.core.io import read_jsonl
    from draftpipe.formats.hidden_states import write_shard
    from draftpipe.formats.vocab import build_maps, count_tokens, write_maps
    from draftpipe.stages.verifier import convert_gguf

    verifier = out / "verifier"
    convert_gguf(REPO / "draftpipe/data/stories260K/stories260K.gguf", verifier, max_position_embeddings=512)
    tok = AutoTokenizer.from_pretrained(str(verifier))
    model = load_verifier_model(str(verifier), "float32")
    n = model.config.num_hidden_layers
    rows = []
    for rec in read_jsonl(REPO / "draftpipe/data/prompts/tinystories_evaluation_prompts.jsonl"):
        ids = tok(rec["prompt"])["input_ids"]
        rows.append({"prompt_token_ids": ids[:12], "completion_token_ids": ids[12:]})
    samples = [build_sample(model, row, AUX, n, 512, torch.bfloat16) for row in rows]
    shards = []
    for i, part in enumerate((samples[::2], samples[1::2])):
        path = out / f"train_{i}.safetensors"
        write_shard(str(path), part, {"aux_layer_ids": AUX, "num_layers": n, "hidden_size": model.config.hidden_size})
        shards.append(str(path))
    d2t, t2d = build_maps(count_tokens(samples, model.config.vocab_size), 256)
    maps = out / "maps.safetensors"
    write_maps(str(maps), d2t, t2d, model.config.vocab_size, 256)
    return str(verifier), shards, str(maps)


def run(data, work: Path, epochs: int, ranks: int, per_step: int, threads: int, fsdp: bool) -> float:
    """Train once in a fresh process; return the wall time in seconds."""
    verifier, shards, maps = data
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    t0 = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-c",
            TRAIN,
            verifier,
            maps,
            str(work),
            str(epochs),
            str(ranks),
            str(per_step),
            str(threads),
            "1" if fsdp else "0",
            *shards,
        ],
        env=env,
        check=True,
    )
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads of the job, shared by its ranks")
    ap.add_argument("--fsdp", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = build_data(tmp)
        results = {}
        for ranks in (1, args.ranks):
            # the time of epochs 1.. = training with `epochs` epochs minus training with 1 epoch (same start-up)
            short = run(data, tmp / f"w{ranks}_1", 1, ranks, args.ranks, args.threads, args.fsdp)
            full = run(data, tmp / f"w{ranks}_n", args.epochs, ranks, args.ranks, args.threads, args.fsdp)
            per_epoch = (full - short) / (args.epochs - 1)
            results[ranks] = {"wall_s": full, "epoch_s": per_epoch}
            print(
                f"{ranks} rank(s){' (FSDP)' if args.fsdp and ranks > 1 else ''}: {full:.1f} s for "
                f"{args.epochs} epochs, {per_epoch:.2f} s per epoch after the first "
                f"(1-epoch run: {short:.1f} s)",
                flush=True,
            )
        one, many = results[1]["epoch_s"], results[args.ranks]["epoch_s"]
        print(
            f"time per epoch, {args.ranks} ranks / 1 rank: {many / one:.2f} "
            f"(whole run: {results[args.ranks]['wall_s'] / results[1]['wall_s']:.2f})"
        )


if __name__ == "__main__":
    main()

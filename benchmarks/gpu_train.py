"""Benchmark: draft training on one GPU, at the size of a real verifier, with no network.

    python benchmarks/gpu_train.py [--presets llama-3.1-8b-instruct,kimi-k2.5] [--parts PARTS] [--seq 8192]
    python benchmarks/gpu_train.py --tiny --device cpu        # the same code on a CPU, a tiny Llama (a trial run)

Synthetic data of the verifier's shape is built on the spot: a verifier of the preset's text config
(``configs/verifiers/<preset>.json``; a Llama config of the same widths, with random ``embed_tokens``, ``lm_head``
and final norm, all a draft reads of it) and random bfloat16 hidden-state shards in the project's format, aux ids
of vLLM's default, a draft vocabulary of 32,000 (the draft settings of ``configs/<preset>.yaml``: ``head_dim``).
The parts (``--parts``, comma-separated; all by default):

- ``loss``: the loss the draft job chooses (:func:`draftpipe.stages.draft.loss.training_loss`): the fused Triton
  kernels checked against speculators' eager loss on the device, and the time that check takes (it autotunes);
  then the check's verdict on each of speculators' other fused losses (``ce``, ``jsd``, ``rkl``, ``tv``, ...).
- ``steps``: one training step in a loop (AdamW, bfloat16 autocast, 3 TTT steps, ``--seq`` tokens): tokens/s
  (median of the timed steps), the first step's time (compilation), peak memory, and the model FLOPs per token
  this script counts (:func:`flops_per_token`) as a fraction of the device's peak (``--peak-tflops``, else the
  table :data:`PEAK_BF16_TFLOPS`). Each attention of ``--attention`` with the fused loss, and flex attention with
  the eager loss (the ratio the fused loss buys).
- ``loader``: seconds per packed batch of reading and packing the shards in bfloat16 (the draft job's
  :func:`draftpipe.stages.draft.data.packed_loader`, the second pass over them, so from the page cache): in the
  trainer's own process, with one worker process, and with the workers the draft job starts on a GPU
  (:func:`draftpipe.stages.draft.data.loader_workers` of this process's threads), each against the ``steps``
  part's step time when it ran (below 1: the loader keeps up with the device).
- ``trainers``: the product's trainer (:class:`draftpipe.stages.draft.trainer.ResumableTrainer`) against
  speculators' own loop (``speculators.train.trainer.Trainer`` with its defaults: it logs every step, as the
  product does) on the same draft, batches and loss: the wall time of the second epoch (the first compiles) of
  each, as a ratio (above 1: the product's is faster), and each one's tokens/s (against ``steps``' loop: what the
  trainer's data loading, logging and per-step checks cost).
- ``product``: :func:`draftpipe.stages.draft.training.train_draft` as the draft job calls it (1 rank, the defaults),
  2 epochs, then the export and the compat checker on it.
- ``torchrun``: the same under ``torchrun --nproc_per_node 1`` (NCCL on a GPU), with DDP and with FSDP: each run is
  killed by SIGKILL after its first epoch's checkpoint, rerun to resume, and its final weights compared with the
  1-rank run's; the first step of each later process (from its log, whole seconds) shows what the compile cache
  saves.

Every part prints one JSON line as it ends, also written to ``$OUT/gpu_train.json`` (a part that fails prints its
error and the run goes on); the last line holds everything. The compile caches go to ``<work>/compile-cache`` for
all the runs of one invocation (:mod:`draftpipe.stages.draft.compile_cache`), so the first compile is paid once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: dense bfloat16 peak of a device, TFLOP/s, by the start of its name (NVIDIA's datasheets: sparsity halved)
PEAK_BF16_TFLOPS = {
    "NVIDIA H200 NVL": 835.5,
    "NVIDIA H200": 989.4,
    "NVIDIA H100 NVL": 835.5,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100": 989.4,
    "NVIDIA A100": 312.0,
}
DRAFT_VOCAB = 32000
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
    "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 512, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False,
}  # fmt: skip
RESULTS: dict = {}


def emit(key: str, value, out: Path) -> None:
    """Record one part's result: a JSON line now, and the whole record in ``out/gpu_train.json``."""
    RESULTS[key] = value
    print(json.dumps({key: value}), flush=True)
    (out / "gpu_train.json").write_text(json.dumps(RESULTS, indent=1))


def preset_config(name: str) -> tuple[dict, int | None]:
    """``(Llama config of the preset's text model, the preset's draft.head_dim)``; ``tiny``: :data:`TINY`."""
    import yaml

    if name == "tiny":
        return dict(TINY), None
    from draftpipe.formats.verifier import text_config

    text = text_config(json.loads((REPO / "configs/verifiers" / f"{name}.json").read_text()))
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
            "rms_norm_eps")  # fmt: skip
    cfg = {k: text[k] for k in keys}
    cfg |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "num_key_value_heads": text.get("num_key_value_heads", cfg["num_attention_heads"]),
            "max_position_embeddings": 32768, "tie_word_embeddings": False}  # fmt: skip
    preset = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    return cfg, (preset.get("draft") or {}).get("head_dim")


def build_data(cfg: dict, work: Path, samples: int, lengths: tuple[int, int], device: str) -> dict:
    """A verifier directory (config + random embed/lm_head/norm), two shards, vocab maps; returns their paths."""
    import torch
    from safetensors.torch import save_file

    from draftpipe.formats.hidden_states import default_aux_layer_ids, write_shard
    from draftpipe.formats.vocab import build_maps, write_maps

    verifier = work / "verifier"
    verifier.mkdir(parents=True, exist_ok=True)
    (verifier / "config.json").write_text(json.dumps(cfg))
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16(),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(hidden).bfloat16(),
    }
    save_file(weights, str(verifier / "model.safetensors"))
    aux = default_aux_layer_ids(layers)
    counts = torch.zeros(vocab, dtype=torch.long)
    rows, tokens = [], 0
    for _ in range(samples):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.ones(n, dtype=torch.uint8)
        mask[: n // 5] = 0  # a prompt of a fifth
        counts += torch.bincount(ids[mask.bool()], minlength=vocab)
        states = torch.randn(n, (len(aux) + 1) * hidden, device=device, dtype=torch.bfloat16).cpu()
        rows.append({"input_ids": ids, "loss_mask": mask, "hidden_states": states[:, : len(aux) * hidden].contiguous(),
                     "verifier_last_hidden_states": states[:, len(aux) * hidden :].contiguous()})  # fmt: skip
        tokens += n
    shards = []
    for j in range(2):
        path = work / f"train_{j:05d}.safetensors"
        meta = {"aux_layer_ids": aux, "num_layers": layers, "hidden_size": hidden, "dtype": "bfloat16"}
        write_shard(str(path), rows[j::2], meta)
        shards.append(str(path))
    vd = min(DRAFT_VOCAB, vocab // 2)
    d2t, t2d = build_maps(counts, vd)
    maps = work / "vocab_maps.safetensors"
    write_maps(str(maps), d2t, t2d, vocab, vd)
    return {"verifier": str(verifier), "shards": shards, "maps": str(maps), "aux": aux, "tokens": tokens}


def flops_per_token(cfg: dict, head_dim: int | None, draft_vocab: int, aux: int, ttt: int, layers: int = 1) -> dict:
    """Model FLOPs per trained token of one EAGLE-3 training step, counting the matmuls of the weights:

    - decoder layers, trainable, every TTT step: forward 2, input and weight gradients 4, so 6 per parameter
      (the first layer reads ``2 * hidden``: the token embedding beside the hidden state);
    - ``fc`` (aux states to hidden), trainable, once: forward 2 and weight gradient 2 (its input is data), 4;
    - the draft's ``lm_head`` (frozen, the verifier's rows of the draft vocabulary), every TTT step: forward 2 and
      input gradient 2, 4;
    - the verifier's head on the last hidden state (the targets), once, forward only: 2.

    Attention scores and softmax are left out (they depend on the packing), as are norms and the loss.
    Returns per-part and total FLOPs per token."""
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = head_dim or cfg.get("head_dim") or h // heads

    def layer(inp: int) -> int:
        return inp * heads * hd + 2 * inp * kv * hd + heads * hd * h + 3 * h * inter

    decoder = layer(2 * h) + (layers - 1) * layer(h)
    parts = {
        "decoder": 6 * decoder * ttt,
        "fc": 4 * aux * h * h,
        "draft_lm_head": 4 * h * draft_vocab * ttt,
        "verifier_head": 2 * h * draft_vocab,
    }
    return {**parts, "total": sum(parts.values())}


def peak_tflops(name: str, override: float | None) -> float | None:
    """The device's dense bfloat16 peak (``override`` first, then :data:`PEAK_BF16_TFLOPS` by name prefix)."""
    if override:
        return override
    for prefix in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if name.startswith(prefix):
            return PEAK_BF16_TFLOPS[prefix]
    return None


def shard_loader(data: dict, seq: int, dtype, workers: int | None = None):
    """The draft job's DataLoader of the shards (``packed_loader``: speculators' collation, one packed batch per
    step), its states in ``dtype``; ``workers`` processes (None: as many as the job starts here)."""
    import torch

    from draftpipe.formats.hidden_states import read_shard_metadata
    from draftpipe.stages.draft.data import ShardDataset, loader_workers, packed_loader
    from draftpipe.stages.draft.settings import DraftSettings

    hidden = read_shard_metadata(data["shards"][0])["hidden_size"]
    ds = ShardDataset(data["shards"], seq, "train", 0, dtype)
    on_gpu = torch.cuda.is_available()
    workers = loader_workers(on_gpu, torch.get_num_threads()) if workers is None else workers
    s = DraftSettings(total_seq_len=seq, batches_per_step=1, seed=0)
    return packed_loader(ds, s, hidden, len(data["aux"]), (0, 1), workers=workers, pin_memory=on_gpu)


def loaders(data: dict, seq: int, dtype, epochs_of_batches: int):
    """:func:`shard_loader` and ``epochs_of_batches`` epochs of its packed training batches."""
    loader = shard_loader(data, seq, dtype)
    batches = []
    for epoch in range(epochs_of_batches):
        loader.batch_sampler.set_epoch(epoch)
        batches += list(loader)
    return loader, batches


def make_draft(data: dict, head_dim, seq: int, attn: str, device: str):
    """The draft of the product's defaults (1 layer, 3 TTT steps) on ``device``, ``attn`` its attention."""
    from draftpipe.formats.vocab import read_maps
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import attention_implementation, build_draft

    d2t, t2d, vd = read_maps(data["maps"])
    s = DraftSettings(num_layers=1, head_dim=head_dim, ttt_steps=3, lr=1e-4, total_seq_len=seq, seed=0)
    impl = attention_implementation(on_gpu=False) if attn == "packed" else attn
    return build_draft(data["verifier"], data["aux"], d2t, t2d, vd, s, impl).to(device), vd


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(data, head_dim, seq, attn, loss_prefer, steps, device, flops, peak) -> dict:
    """Train ``steps`` + 1 steps of a fresh draft; the first is the compile, the rest are timed."""
    import torch

    from draftpipe.stages.draft.loss import training_loss

    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model, vd = make_draft(data, head_dim, seq, attn, device)
    loss = training_loss("kl_div", on_gpu, vd, device, prefer=loss_prefer)
    kw = {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": loss.config}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    _, batches = loaders(data, seq, dtype, 3)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for batch in (batches * (steps + 1))[: steps + 1]:
        batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=on_gpu):
            _, value, _ = model(**batch, **kw)
        value.backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])
    tokens = int(batches[0]["input_ids"].numel())
    out = {"attention": attn, "loss": loss.implementation, "tokens_per_step": tokens, "step_s": round(step, 4),
           "tokens_per_s": round(tokens / step, 1), "first_step_s": round(times[0], 1),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None,
           "loss_value": round(float(value), 4)}  # fmt: skip
    if peak:
        out["fraction_of_peak"] = round(flops * tokens / step / (peak * 1e12), 3)
    del model, opt
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def loader_part(data: dict, seq: int, step_s: float | None) -> dict:
    """Seconds per packed batch of the draft job's loader over the shards (bfloat16, as on a GPU) with 0 worker
    processes (read in this process), 1, and as many as the draft job starts on a GPU with this process's threads,
    timed over the second epoch (the first starts the workers and fills the page cache); each over ``step_s``, the
    training step's time, when given."""
    import torch

    from draftpipe.stages.draft.data import loader_workers

    workers = loader_workers(True, torch.get_num_threads())
    result: dict = {"workers": workers, "threads": torch.get_num_threads()}
    for n in sorted({0, 1, workers}):
        loader = shard_loader(data, seq, torch.bfloat16, n)
        times = []
        for epoch in (0, 1):
            loader.batch_sampler.set_epoch(epoch)
            t0 = time.perf_counter()
            batches = sum(1 for _ in loader)
            times.append((time.perf_counter() - t0) / batches)
        result[f"workers_{n}_s_per_batch"] = round(times[1], 4)
        if step_s:
            result[f"workers_{n}_over_step"] = round(times[1] / step_s, 3)
        del loader
    return result


def compare_trainers(data, head_dim, seq, device, work: Path) -> dict:
    """The wall time of the second epoch of the product's trainer and of speculators' ``Trainer``: same initial
    weights, batches (one packed batch per step, the product's loader for both), loss and optimizer settings."""
    import torch
    from speculators.train.trainer import Trainer, TrainerConfig

    from draftpipe.stages.draft.loss import training_loss
    from draftpipe.stages.draft.trainer import ResumableTrainer

    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32

    class OnThisDevice(Trainer):  # speculators' Trainer assumes cuda:<rank>; the CPU trial places it here
        def setup_trainer(self):
            if not on_gpu:
                self.local_rank, self.device_type = torch.device("cpu"), "cpu"
            super().setup_trainer()

    result = {}
    if not on_gpu:  # the CPU trial: speculators' step timer synchronizes an accelerator, which a CPU lacks
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    for name, cls in (("product", ResumableTrainer), ("speculators", OnThisDevice)):
        model, vd = make_draft(data, head_dim, seq, "simple_flex_attention" if on_gpu else "packed", "cpu")
        loss = training_loss("kl_div", on_gpu, vd, device)
        kw = {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": loss.config}
        loader, _ = loaders(data, seq, dtype, 0)
        steps = loader.batch_sampler.steps
        cfg = TrainerConfig(lr=1e-4, num_epochs=2, save_path=str(work / f"trainer_{name}"), train_call_kwargs=kw,
                            val_call_kwargs=kw, scheduler_total_steps=2 * steps, hidden_states_dtype=dtype,
                            resume_from_checkpoint=False)  # fmt: skip
        trainer = cls(model, cfg, loader, None)
        epochs = []
        for epoch in range(2):
            sync(device)
            t0 = time.perf_counter()
            trainer.train_epoch(epoch)
            sync(device)
            epochs.append(time.perf_counter() - t0)
        # tokens of the second epoch per second, padding included as in ``steps`` (whose loop reads no data and
        # syncs once a step): the gap between the two is what the trainer's loading, logging and checks cost
        result[name] = {"steps": steps, "epoch_s": [round(x, 2) for x in epochs],
                        "tokens_per_s": round(steps * seq / epochs[1], 1)}  # fmt: skip
        del trainer, model
        if on_gpu:
            torch.cuda.empty_cache()
    result["product_over_speculators_speed"] = round(
        result["speculators"]["epoch_s"][1] / result["product"]["epoch_s"][1], 3
    )
    return result


TRAIN = """
import json, sys
from draftpipe.stages.draft.settings import DraftSettings
from draftpipe.stages.draft.training import train_draft
a = json.loads(sys.argv[1])
s = DraftSettings(epochs=a["epochs"], head_dim=a["head_dim"], lr=1e-4, total_seq_len=a["seq"], val_every=8, seed=0)
final, rows = train_draft(a["verifier"], a["shards"], a["maps"], a["work"], s, fsdp=a["fsdp"])
print("FINAL " + json.dumps({"final": str(final), "rows": rows}), flush=True)
"""


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux ``/proc``), children first."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                out += [int(child), *descendants(int(child))]
    return out


def run_train(data, head_dim, seq, work: Path, torchrun: bool, fsdp: bool, kill_after_epoch0: bool) -> dict:
    """:func:`train_draft` for 2 epochs in a new process (under torchrun with 1 rank when asked); with
    ``kill_after_epoch0`` SIGKILL it once the epoch-0 checkpoint is complete. Returns its wall time, exit code,
    the first step's time (from its log) and the final checkpoint."""
    args = {"verifier": data["verifier"], "shards": data["shards"], "maps": data["maps"], "work": str(work),
            "epochs": 2, "head_dim": head_dim, "seq": seq, "fsdp": fsdp}  # fmt: skip
    cmd = [sys.executable, "-c", TRAIN, json.dumps(args)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "--no-python",
               *cmd]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    log = work.parent / f"{work.name}.{'interrupted' if kill_after_epoch0 else 'run'}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed = None
        while proc.poll() is None:
            if kill_after_epoch0 and (work / "0" / "training_state.pt").exists():
                for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's ranks run in their own groups
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                killed = "after epoch 0" if not (work / "1").exists() else "too late: training had ended"
                proc.wait()
                break
            time.sleep(0.2)
    text = log.read_text()
    # the first step's time: the first progress line of an epoch says how long its first step took (whole seconds)
    first = re.search(r"draft epoch \d+/\d+: 1/\d+ steps [^\n\r]*?elapsed (\d+):(\d\d):(\d\d)", text)
    final = next((json.loads(x[6:]) for x in text.splitlines() if x.startswith("FINAL ")), None)
    out = {"rc": proc.returncode, "killed": killed, "wall_s": round(time.perf_counter() - t0, 1)}
    if first:
        out["first_step_s"] = int(first[1]) * 3600 + int(first[2]) * 60 + int(first[3])
    if final:
        out["final"] = final["final"]
        out["val_loss"] = final["rows"][-1].get("val_loss")
        out["loss_impl"] = final["rows"][-1].get("loss_impl")
    elif not killed:
        out["tail"] = text[-2000:]
    return out


def weights_diff(a: str, b: str) -> float:
    """The largest absolute difference between two checkpoints' ``model.safetensors`` (float32)."""
    from safetensors.torch import load_file

    x, y = load_file(str(Path(a) / "model.safetensors")), load_file(str(Path(b) / "model.safetensors"))
    assert x.keys() == y.keys(), "the checkpoints hold different tensors"
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def product_part(data, head_dim, seq, work: Path) -> dict:
    """train_draft in this process as the draft job runs it, then the export and the compat checker."""
    from draftpipe.checks.compat.checker import check
    from draftpipe.stages.draft.export import export_draft
    from draftpipe.stages.draft.settings import DraftSettings
    from draftpipe.stages.draft.training import train_draft

    s = DraftSettings(epochs=2, head_dim=head_dim, lr=1e-4, total_seq_len=seq, val_every=8, seed=0)
    t0 = time.perf_counter()
    final, rows = train_draft(data["verifier"], data["shards"], data["maps"], str(work / "product"), s)
    wall = time.perf_counter() - t0
    out = work / "export"
    out.mkdir(exist_ok=True)
    export_draft(final, str(out / "model.safetensors"), str(out / "config.json"), data["aux"], data["verifier"])
    report = check(out, data["verifier"])
    return {"wall_s": round(wall, 1), "final": str(final), "val_loss": rows[-1].get("val_loss"),
            "loss_impl": rows[-1].get("loss_impl"), "compat_ok": report.ok,
            "compat_errors": [str(f) for f in getattr(report, "errors", [])][:5]}  # fmt: skip


def torchrun_part(data, head_dim, seq, work: Path, reference: str | None) -> dict:
    """train_draft under torchrun (1 rank) with DDP and with FSDP: killed after epoch 0, resumed, compared."""
    out = {}
    for fsdp in (False, True):
        name = "fsdp" if fsdp else "ddp"
        first = run_train(data, head_dim, seq, work / name, True, fsdp, kill_after_epoch0=True)
        resumed = run_train(data, head_dim, seq, work / name, True, fsdp, kill_after_epoch0=False)
        entry = {"interrupted": first, "resumed": resumed}
        if resumed.get("final") and reference:
            entry["max_weight_diff_vs_1_rank"] = weights_diff(resumed["final"], reference)
        out[name] = entry
    return out


def run_part(key: str, out: Path, fn, *args) -> None:
    """``fn(*args)``'s result under ``key``, or the traceback of its failure (the run goes on)."""
    try:
        emit(key, fn(*args), out)
    except Exception:
        emit(key, {"error": traceback.format_exc()[-3000:]}, out)


def loss_part(vocab: int, device: str) -> dict:
    """The loss the draft job would choose here, and how long choosing took (the check and autotuning); then every
    other loss speculators fuses, each through the same check (``None``: the kernel agrees with the eager loss)."""
    from draftpipe.stages.draft.loss import training_loss
    from draftpipe.workflow.config import LOSS_FUNCTIONS  # speculators' losses, each fused and eager

    on_gpu = device.startswith("cuda")
    t0 = time.perf_counter()
    chosen = training_loss("kl_div", on_gpu, vocab, device)
    result = {"implementation": chosen.implementation, "reason": chosen.reason,
              "check_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    result["others"] = {
        name: training_loss(name, on_gpu, vocab, device).reason or None for name in LOSS_FUNCTIONS if name != "kl_div"
    }
    return result


def run_preset(preset: str, a, parts: set, grid: bool, pwork: Path, peak: float | None, out: Path) -> None:
    """Every asked part for one preset (``grid``: every attention and the eager loss in ``steps``)."""
    t0 = time.perf_counter()
    cfg, head_dim = preset_config(preset)
    on_gpu = a.device.startswith("cuda")
    lengths = tuple(int(x) for x in a.lengths.split(","))
    data = build_data(cfg, pwork, a.samples, lengths, a.device if on_gpu else "cpu")
    vocab = min(DRAFT_VOCAB, cfg["vocab_size"] // 2)
    flops = flops_per_token(cfg, head_dim, vocab, len(data["aux"]), 3)
    emit(f"{preset}.data", {"tokens": data["tokens"], "samples": a.samples, "setup_s": round(time.perf_counter() - t0, 1),
                            "flops_per_token": flops}, out)  # fmt: skip
    if "loss" in parts:
        run_part(f"{preset}.loss", out, loss_part, vocab, a.device)
    if "steps" in parts:
        attns = a.attention.split(",") if grid else a.attention.split(",")[:1]
        for attn in attns:
            run_part(f"{preset}.steps.{attn}", out, time_steps, data, head_dim, a.seq, attn, "auto", a.steps,
                     a.device, flops["total"], peak)  # fmt: skip
        if grid:
            run_part(f"{preset}.steps.{attns[0]}.eager_loss", out, time_steps, data, head_dim, a.seq, attns[0],
                     "eager", a.steps, a.device, flops["total"], peak)  # fmt: skip
    if "loader" in parts:
        step = (RESULTS.get(f"{preset}.steps.{a.attention.split(',')[0]}") or {}).get("step_s")
        run_part(f"{preset}.loader", out, loader_part, data, a.seq, step)
    if "trainers" in parts:
        run_part(f"{preset}.trainers", out, compare_trainers, data, head_dim, a.seq, a.device, pwork)
    if "product" in parts:
        run_part(f"{preset}.product", out, product_part, data, head_dim, a.seq, pwork)
    if "torchrun" in parts:
        reference = (RESULTS.get(f"{preset}.product") or {}).get("final")
        run_part(f"{preset}.torchrun", out, torchrun_part, data, head_dim, a.seq, pwork, reference)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama-3.1-8b-instruct,kimi-k2.5")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the presets (a trial run)")
    ap.add_argument("--parts", default="loss,steps,loader,trainers,product,torchrun")
    ap.add_argument("--attention", default=None, help="attentions of the grid (GPU: flex, packed, sdpa)")
    ap.add_argument("--steps-presets", default="", help="presets of the attention/loss grid (default: the first)")
    ap.add_argument("--seq", type=int, default=8192, help="tokens per packed batch (draft.total_seq_len)")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--lengths", default="512,4096", help="sample lengths, min,max tokens")
    ap.add_argument("--steps", type=int, default=6, help="timed steps after the compiling one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="gpu_train."))
    from draftpipe.stages.draft.compile_cache import use_compile_cache

    use_compile_cache(work / "compile-cache")  # before torch: every run of this invocation shares it
    import torch

    on_gpu = a.device.startswith("cuda")
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    peak = peak_tflops(name, a.peak_tflops)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    emit("env", {"device": name, "torch": torch.__version__, "triton": triton_version, "peak_bf16_tflops": peak}, out)
    parts = set(a.parts.split(","))
    a.attention = a.attention or ("simple_flex_attention,packed,sdpa" if on_gpu else "packed,sdpa")
    presets = ["tiny"] if a.tiny else a.presets.split(",")
    grid = set(a.steps_presets.split(",")) if a.steps_presets else {presets[0]}
    for preset in presets:
        run_preset(preset, a, parts, preset in grid or a.tiny, work / preset, peak, out)
    print(json.dumps(RESULTS), flush=True)


if __name__ == "__main__":
    main()

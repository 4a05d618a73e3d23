"""Several training ranks: torchrun launch, process groups, and the batch sampler that keeps the draft independent
of the world size.

A draft trained by N ranks is the draft trained by one (up to floating-point reduction order) because the global
batch is a config knob, not a consequence of N: each optimizer step consumes ``batches_per_step`` packed batches
of ``total_seq_len`` tokens, chosen by speculators' multipack sampler as if ``batches_per_step`` replicas were
training (:class:`StepBatchSampler`), and rank ``r`` of ``N`` trains the packed batches ``r, r + N, ...`` of each
step, accumulating gradients. With DDP averaging the gradients over the ranks, every step applies the mean
gradient of the ``batches_per_step`` packed batches whatever N is; ``N`` must divide ``batches_per_step``.
speculators' own loop instead packs one batch per rank per step (``MultipackDistributedBatchSamplerV2`` with
``num_replicas = world size``), so its global batch, its steps per epoch and its learning-rate schedule change
with the number of GPUs.

Launch: ``torchrun --standalone --nproc-per-node N -m draftpipe.stages.draft.ranks <spec.json>`` on one node (local jobs and
single-node SLURM jobs); each rank reads the spec, joins the process group (NCCL on GPUs, gloo on a machine
without an accelerator, where speculators' own setup refuses to start) and trains; rank 0 writes every artifact.
A rank dies with its launcher (``PR_SET_PDEATHSIG``), so a killed job never leaves a rank training on.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from draftpipe.core.io import write_json
from draftpipe.core.layout import SOURCE_ROOT
from draftpipe.runtime.job import die_with_parent

log = logging.getLogger(__name__)


def world() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` of this process from torchrun's environment; ``(0, 0, 1)`` outside it."""
    if "LOCAL_RANK" not in os.environ:
        return 0, 0, 1
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def init_ranks() -> bool:
    """Join the process group when launched by torchrun and tell speculators' training code (its
    ``speculators.train.distributed`` topology) the rank, the local rank and the data-parallel group.

    Backend: the default for the accelerator (NCCL on NVIDIA GPUs, device = ``LOCAL_RANK`` of the devices the job
    holds), gloo where there is none. Returns True when distributed, False in a single process.

    Raises:
        RuntimeError: from ``torch.distributed`` when the rendezvous fails.
    """
    rank, local_rank, size = world()
    if size == 1 and "LOCAL_RANK" not in os.environ:
        return False
    import torch
    import torch.distributed as dist
    from speculators.train import distributed as sd

    acc = torch.accelerator.current_accelerator()
    if acc is not None:
        torch.accelerator.set_device_index(local_rank)
        dist.init_process_group(dist.get_default_backend_for_device(acc), device_id=local_rank)
    else:
        dist.init_process_group("gloo")
    sd._local_rank, sd._rank, sd._world_size, sd._is_distributed = (
        local_rank,
        dist.get_rank(),
        dist.get_world_size(),
        True,
    )
    sd._init_sp_process_groups(sd._rank, sd._world_size, 1)
    log.info("%d ranks joined (%s)", sd._world_size, dist.get_backend())
    return True


def check_batches_per_step(per_step: int, world: int) -> None:
    """Raise ValueError unless ``world`` ranks can share each step's ``per_step`` packed batches evenly."""
    if per_step < 1 or per_step % world:
        raise ValueError(
            f"draft.batches_per_step ({per_step}) must be a multiple of the number of training ranks ({world})"
        )


class StepBatchSampler:
    """The packed batches one rank trains, step by step (a ``batch_sampler`` for a DataLoader).

    Step ``s`` of epoch ``e`` is made of ``per_step`` packed batches: batch ``j`` is what speculators'
    ``MultipackDistributedBatchSamplerV2(total_seq_len, lengths, num_replicas=per_step, rank=j, seed=seed)``
    gives for step ``s`` of epoch ``e`` (a shuffle by ``seed + e``, then LPT packing of ``per_step`` bins of at most
    ``total_seq_len`` tokens). This rank yields batches ``rank, rank + world, ...`` of each step in turn, so it yields
    ``per_step // world`` batches per step. With ``per_step == 1`` and one rank it is speculators' single-process
    sampler, batch for batch.

    Args:
        lengths: tokens per sample (``BaseDataset.approx_lengths``).
        total_seq_len: tokens per packed batch.
        per_step: packed batches per optimizer step (the global batch).
        rank, world: this rank and the number of ranks; ``world`` must divide ``per_step``.
        seed: shuffle seed (the same on every rank).

    Raises:
        ValueError: ``world`` does not divide ``per_step``.
    """

    def __init__(self, lengths, total_seq_len: int, per_step: int, rank: int, world: int, seed: int):
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

        check_batches_per_step(per_step, world)
        self.per_rank = per_step // world
        self.samplers = [
            MultipackDistributedBatchSamplerV2(total_seq_len, lengths, num_replicas=per_step, rank=j, seed=seed)
            for j in range(rank, per_step, world)
        ]
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` from the next iteration on."""
        self.epoch = epoch
        for s in self.samplers:
            s.set_epoch(epoch)

    @property
    def steps(self) -> int:
        """Optimizer steps in the epoch (the same for every rank and every world size)."""
        return len(self.samplers[0]._generate_batches(self.epoch))  # noqa: SLF001

    def __iter__(self):
        lists = [s._generate_batches(self.epoch) for s in self.samplers]  # noqa: SLF001
        for step in range(self.skip, len(lists[0])):
            for batches in lists:
                yield batches[step]

    def __len__(self) -> int:
        return (self.steps - self.skip) * self.per_rank


def torchrun_command(
    nproc: int, spec: str | os.PathLike, nnodes: int = 1, env: dict | None = None, hosts: list[str] | None = None
) -> list[str]:
    """The command that trains with ``nproc`` ranks on each of ``nnodes`` nodes, each rank running
    ``python -m draftpipe.stages.draft.ranks <spec>``.

    One node: ``python -m torch.distributed.run --standalone`` (a free port on localhost, so concurrent jobs never
    collide). Several nodes (inside a SLURM job of ``nnodes`` nodes and as many tasks, :func:`draftpipe.core.gpus.slurm_resources`):
    ``srun --nodes M --ntasks M --ntasks-per-node 1`` starts one torchrun per node, which meet at a c10d rendezvous
    on the job's first node (``hosts[0]``, default from ``scontrol show hostnames $SLURM_JOB_NODELIST``) on port
    ``29500 + SLURM_JOB_ID % 10000``, rendezvous id ``SLURM_JOB_ID`` (the pattern of torchrun's SLURM examples).

    Raises:
        RuntimeError: several nodes outside a SLURM job.
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    ranks = ["-m", "draftpipe.stages.draft.ranks", str(spec)]
    if nnodes == 1:
        return [*torchrun, "--standalone", f"--nproc-per-node={nproc}", *ranks]
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise RuntimeError(
            f"resources.draft.nodes: {nnodes} needs a SLURM job (profiles/slurm); this job runs outside SLURM"
        )
    if hosts is None:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True, text=True, check=True
        ).stdout.split()
    port = 29500 + int(job) % 10000
    return [
        "srun",
        f"--nodes={nnodes}",
        f"--ntasks={nnodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        *torchrun,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts[0]}:{port}",
        f"--rdzv-id={job}",
        *ranks,
    ]


def launch(nproc: int, spec: dict, spec_path: str | os.PathLike, threads: int | None = None, nnodes: int = 1) -> None:
    """Write ``spec`` to ``spec_path`` and train with
    ``nproc`` ranks on each of ``nnodes`` nodes under torchrun (:func:`torchrun_command`); each rank uses
    ``threads // nproc`` intra-op threads (at least 1). The ranks' output goes to this process's stdout and stderr
    (the job's log).

    ``spec["entry"]`` names the function each rank runs, ``"module:function"`` (it is called with the whole spec),
    so this launcher knows nothing of what is trained (:func:`draftpipe.stages.draft.training.train_rank`).

    Raises:
        RuntimeError: a rank failed (torchrun's exit status and the last lines of its output are in the log).
        ValueError: ``spec`` has no ``entry``.
    """
    if ":" not in str(spec.get("entry", "")):
        raise ValueError(
            f"a launch spec names the rank's function as entry 'module:function', got {spec.get('entry')!r}"
        )
    write_json(spec_path, spec)
    per_rank = str(max(1, (threads or os.cpu_count() or 1) // nproc))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": per_rank,
        "DRAFTPIPE_RANK_THREADS": per_rank,
        "PYTHONPATH": os.pathsep.join(
            [str(SOURCE_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    }
    cmd = torchrun_command(nproc, spec_path, nnodes)
    log.info("training with %d ranks: %s", nproc * nnodes, " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.run(cmd, env=env, preexec_fn=die_with_parent)
    if proc.returncode != 0:
        raise RuntimeError(
            f"draft training with {nproc * nnodes} ranks failed (exit status {proc.returncode}); "
            "each rank's error is above in the log"
        )


def main(argv: list[str] | None = None) -> None:
    """A rank's entry point: ``python -m draftpipe.stages.draft.ranks <spec.json>`` under torchrun; runs the spec's ``entry``
    function (see :func:`launch`) with the spec."""
    die_with_parent()
    spec_path = (argv or sys.argv[1:])[0]
    rank, _, size = world()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format=f"[rank {rank}/{size}] %(name)s %(levelname)s %(message)s"
    )
    if rank != 0:  # the other ranks log warnings and errors only (their metrics are rank 0's)
        logging.getLogger().handlers[0].setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(int(os.environ.get("DRAFTPIPE_RANK_THREADS", "1")))
    spec = json.loads(Path(spec_path).read_text())
    module, _, function = spec.pop("entry").partition(":")
    getattr(importlib.import_module(module), function)(spec)


if __name__ == "__main__":
    main()

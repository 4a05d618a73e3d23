"""EAGLE-3 draft training with speculators 0.9 (its model, data collation, trainer and checkpointer): the driver.

Data: the hidden-state shards of :mod:`draftpipe.formats.hidden_states` are read by
:class:`draftpipe.stages.draft.data.ShardDataset`, a
speculators ``BaseDataset``; speculators' ``CollateFn`` packs samples into ``[1, total_seq_len]`` batches and its
``shift_batch`` aligns inputs and targets. Model: ``Eagle3DraftModel.from_training_args`` with the decoder config
that speculators' training CLI builds (``create_transformer_layer_config``), optionally with another ``head_dim``.
Trainer: :class:`draftpipe.stages.draft.trainer.ResumableTrainer` (speculators' ``Trainer``); on machines without an accelerator the draft uses
:mod:`draftpipe.stages.draft.attention` (``sdpa`` over only the attending columns) and the eager loss (the defaults, flex
attention and a Triton loss, need a GPU; tiny-verifier §10). On a GPU the fused Triton loss runs outside the compiled
forward, checked against the eager one before training (:mod:`draftpipe.stages.draft.loss`).

Resumable training: after each epoch (training, then validation) the trainer writes a checkpoint directory
``<work_dir>/<epoch>/`` holding the speculators-format ``model.safetensors`` and ``config.json`` (bfloat16, what
is exported) and ``training_state.pt``: the model state in full precision (less the frozen parameters taken from
the verifier, which the draft is built with again), the optimizer and scheduler states, the epoch and global
step, the torch, numpy and Python random states, and the metrics logged so far. It is written into a hidden
temporary directory that is renamed into place, so a process killed during a save never leaves a checkpoint that
looks complete; the previous checkpoint is removed once the new one is in place. A rerun with the same work
directory restores all of it from the last complete checkpoint and continues with the next epoch. The batch order
is a pure function of (seed, epoch) (speculators' multipack sampler), so the result is bit-identical to an
uninterrupted run. With ``checkpoints_per_epoch`` > 1 the same state is also saved part-way through an epoch
(``<work_dir>/<epoch>-step<k>/``), and a resume skips the batches of the epoch already trained (speculators'
sampler slice). A SIGTERM or SIGINT ends training at once (speculators' save-on-interrupt is not used): the steps
since the last checkpoint are trained again on resume.

The exported directory holds ``model.safetensors`` and ``config.json`` in the speculators format (what
``speculators`` saves; vLLM reads it as ``SpeculatorsConfig``), with the aux layer ids written both at the top
level (read by vLLM's V1 and V2 model runners) and in ``transformer_layer_config.eagle_config`` (read by vLLM's
Llama EAGLE-3 model for the width of ``fc``, vLLM issue #54526).
"""

from __future__ import annotations

import os
from pathlib import Path

from draftpipe.formats.chat import common_template
from draftpipe.formats.hidden_states import read_shard_metadata, shards_aux_layer_ids
from draftpipe.formats.vocab import read_maps
from draftpipe.stages.draft import attention, data
from draftpipe.stages.draft.checkpoint import TRAINING_STATE, selected_checkpoint
from draftpipe.stages.draft.data import ShardDataset, accounting_line, packed_loader
from draftpipe.stages.draft.loggers import close_loggers, open_loggers
from draftpipe.stages.draft.loss import training_loss
from draftpipe.stages.draft.metrics import epoch_metrics, mark_exported
from draftpipe.stages.draft.ranks import check_batches_per_step, init_ranks, launch
from draftpipe.stages.draft.settings import DraftSettings
from draftpipe.stages.draft.stream import Spool, StreamDataset, StreamSettings, plan_units, split_devices
from draftpipe.stages.draft.trainer import ResumableTrainer, current_rank, world_size
from draftpipe.stages.draft.warm_start import init_from_verifier, source_layer


def build_draft(
    verifier_dir: str, aux_ids: list[int], d2t, t2d, draft_vocab_size: int, s: DraftSettings, attn_impl: str
):
    """Build an untrained draft of ``s.method`` for the verifier with the decoder config that speculators' training
    CLI builds (``create_transformer_layer_config``), optionally with another ``head_dim``:

    - ``eagle3``: ``Eagle3DraftModel.from_training_args`` (Llama decoder layers), started from the verifier's
      weights when ``s.init`` is ``verifier`` (:func:`draftpipe.stages.draft.warm_start.init_from_verifier`);
    - ``dflash``: ``DFlashDraftModel.from_training_args`` (speculators' Qwen3 DFlash layers, the CLI's
      ``draft_arch`` for DFlash), ``s.dflash.block_size``, the mask token ``s.dflash.mask_token_id`` or speculators'
      choice (``resolve_mask_token_id``), full attention with ``sliding_window_non_causal`` set, so that vLLM serves
      the layers without a causal mask within the block, as speculators trains full-attention layers
      (``create_anchor_block_mask_mod``: "Always use non_causal for full attn"; vLLM's ``update_dflash`` sets
      ``dflash_config.causal = not sliding_window_non_causal``).

    Raises:
        ValueError: from speculators when the aux ids, head_dim or vocab maps do not fit the verifier; naming
        ``draft.init`` when the verifier's layer cannot start the draft.
    """
    import torch
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(s.seed)
    dflash = s.method == "dflash"
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=verifier_dir,
        num_layers=s.num_layers,
        draft_arch="qwen3" if dflash else "llama",
        hidden_act=None,
        sliding_window=s.sliding_window or 0,
        full_attention_indices=[] if s.sliding_window else list(range(s.num_layers)),
    )
    if s.head_dim:
        layer_cfg.head_dim = s.head_dim
    common = {"verifier_config": layer_cfg, "t2d": t2d, "d2t": d2t, "target_layer_ids": list(aux_ids),
              "verifier_name_or_path": verifier_dir, "draft_attn_impl": attn_impl,
              "draft_vocab_size": draft_vocab_size}  # fmt: skip
    if dflash:
        from speculators.models.dflash import DFlashDraftModel
        from speculators.train.utils import resolve_mask_token_id

        mask = resolve_mask_token_id(verifier_dir, layer_cfg.vocab_size, s.dflash.mask_token_id)
        return DFlashDraftModel.from_training_args(
            **common, block_size=s.dflash.block_size, mask_token_id=mask, sliding_window_non_causal=True
        )
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_training_args(
        **common,
        norm_before_residual=s.norm_before_residual,
        norm_before_fc=s.norm_before_fc,
        norm_output=s.norm_output,
        ttt_steps=s.ttt_steps,
    )
    if s.init == "verifier":
        init_from_verifier(model, verifier_dir, aux_ids)
    return model


def call_kwargs(s: DraftSettings, loss_config) -> dict:
    """The keyword arguments of the draft's ``forward`` in training and validation: EAGLE-3's TTT steps and their
    loss decay, or DFlash's anchors per batch (``s.dflash.max_anchors``) with speculators' defaults for the rest
    (``DFlashDraftModel.get_trainer_kwargs``: loss decay over the block ``gamma`` 4, ``fixed-exp-decay``); the
    loss (``loss_config``: :func:`draftpipe.stages.draft.loss.training_loss`) for both."""
    if s.method == "dflash":
        return {"loss_config": loss_config, "gamma": 4.0, "max_anchors": s.dflash.max_anchors,
                "per_position_loss_weight": "fixed-exp-decay", "dpace_alpha": 0.5}  # fmt: skip
    return {"ttt_steps": s.ttt_steps, "ttt_step_loss_decay": s.ttt_step_loss_decay, "loss_config": loss_config}


def attention_implementation(on_gpu: bool, method: str = "eagle3") -> str:
    """The draft's ``attn_implementation`` in training: speculators' ``simple_flex_attention`` on an accelerator
    (its block mask skips the masked blocks); on a CPU, for EAGLE-3, :mod:`draftpipe.stages.draft.attention`'s
    packed TTT attention (the same values as ``sdpa`` over only the columns that attend: a training step on 2 CPU
    cores about 3x faster, see ``benchmarks/draft_step.py``), for DFlash ``sdpa`` (speculators' dense mask of the
    anchor blocks)."""
    if on_gpu:
        return "simple_flex_attention"
    return attention.register() if method == "eagle3" else "sdpa"


def train_draft(
    verifier_dir: str,
    shards: list[str],
    vocab_maps: str,
    work_dir: str,
    s: DraftSettings,
    checkpoints_per_epoch: int = 1,
    ranks: int = 1,
    threads: int | None = None,
    fsdp: bool = False,
    nodes: int = 1,
    stream: StreamSettings | None = None,
    loss_implementation: str = "auto",
    loader_workers: int | None = None,
    loggers: tuple[str, ...] = (),
    log_dir: str | None = None,
) -> tuple[Path, list[dict]]:
    """Train the draft; return the directory of the checkpoint to export and the per-epoch metrics, the exported
    epoch's row marked with why it was chosen (``exported``: :func:`draftpipe.stages.draft.metrics.mark_exported`).

    ``s.select`` (``draft.select``) chooses the exported epoch: ``last``, or ``best_val``, the epoch with the lowest
    validation loss (speculators' rule; its weights are kept in ``<work_dir>/best/`` while later epochs train,
    resumes included: :meth:`draftpipe.stages.draft.trainer.ResumableTrainer.keep_best_epoch`); the last epoch
    when there is no validation sample.

    Training state lives in ``work_dir``: one exact checkpoint, ``<epoch>/`` at the end of an epoch or
    ``<epoch>-step<k>/`` after ``k`` steps of it (see the module docstring). ``checkpoints_per_epoch`` > 1 also saves
    every ``1/checkpoints_per_epoch`` of an epoch (speculators' ``checkpoint_freq``), for long epochs; it does not
    change the result. A rerun with the same ``work_dir`` resumes there (the batches of an epoch are a function of
    the seed and the epoch, so the data position is the step), logging ``resuming from epoch N [step K] checkpoint
    <dir>``, and ends with the same weights as an uninterrupted run.

    ``ranks`` > 1 trains with that many ranks under torchrun on this node, ``nodes`` > 1 with ``ranks`` on each
    node of a SLURM job (``srun`` + a torchrun rendezvous) (DDP; NCCL on GPUs, gloo on CPUs; each rank
    ``threads // ranks`` threads); the ranks share each step's ``s.batches_per_step`` packed batches, so the
    draft is the one-rank draft up to floating-point reduction order (:mod:`draftpipe.stages.draft.ranks`). Only rank 0 writes.
    Called under torchrun (``LOCAL_RANK`` set), it trains as one of the ranks. ``fsdp`` shards the draft, its
    gradients and optimizer states over the ranks (speculators' ``fully_shard`` of each decoder layer and of the
    model) instead of replicating it (DDP), for drafts that do not fit one device; checkpoints still hold the full
    states, gathered on rank 0.

    ``loss_implementation`` (``auto``, ``fused`` or ``eager``: :func:`draftpipe.stages.draft.loss.training_loss`)
    changes the draft, like ``fsdp``, only by floating-point rounding. ``loader_workers`` (None: automatic,
    :func:`draftpipe.stages.draft.data.loader_workers`) changes when batches are read, never which.

    ``loggers`` (``draft.loggers``: :mod:`draftpipe.stages.draft.loggers`) write what rank 0 logs to ``log_dir`` as
    well; they change nothing the draft is.

    ``stream`` (``hidden_states.storage: stream``): ``shards`` are the completions shards, and the hidden states
    come from a vLLM producer as training reads them, within ``stream.budget`` bytes of disk
    (:mod:`draftpipe.stages.draft.stream`); one rank only.

    Raises:
        ShardError: a shard is truncated or corrupt. ValueError: inconsistent shards (aux ids, hidden size), or
        ``ranks`` does not divide ``s.batches_per_step``, or ``stream`` with several ranks. RuntimeError: a rank
        failed, or the fused loss asked for failed its check. draftpipe.stages.draft.stream.StreamError: the
        producer failed.
    """
    world = max(1, ranks) * max(1, nodes)
    check_batches_per_step(s.batches_per_step, world)  # before any rank starts
    job = {"verifier_dir": verifier_dir, "shards": shards, "vocab_maps": vocab_maps, "work_dir": work_dir, "s": s,
           "checkpoints_per_epoch": checkpoints_per_epoch, "loss_implementation": loss_implementation,
           "loader_workers": loader_workers, "loggers": list(loggers), "log_dir": log_dir}  # fmt: skip
    if stream is not None:
        if world > 1:
            raise ValueError(f"hidden_states.storage: stream trains with one rank, not {world}")
        return _train_streamed(job, threads, stream)
    if world > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_ranks(job, fsdp, ranks, threads, nodes)
    distributed = init_ranks()
    try:
        return _train_here(**job, fsdp=fsdp and distributed)
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def _launch_ranks(job: dict, fsdp: bool, ranks: int, threads: int | None, nodes: int) -> tuple[Path, list[dict]]:
    """:func:`train_draft`'s ``job`` on ``ranks`` x ``nodes`` torchrun ranks (:func:`train_rank` each); the final
    checkpoint and its metrics, read back from the work directory."""
    from dataclasses import asdict

    import torch

    work_dir, s = Path(job["work_dir"]), job["s"]
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = {**job, "verifier_dir": str(job["verifier_dir"]), "shards": [str(p) for p in job["shards"]],
            "vocab_maps": str(job["vocab_maps"]), "work_dir": str(work_dir), "s": asdict(s), "fsdp": fsdp}  # fmt: skip
    launch(ranks, {"entry": f"{__name__}:train_rank", **spec}, Path(str(work_dir) + ".launch.json"), threads, nodes)
    state = torch.load(work_dir / str(s.epochs - 1) / TRAINING_STATE, map_location="cpu", weights_only=True)
    return exported(work_dir, s, epoch_metrics(state["metrics"]))


def exported(work_dir, s: DraftSettings, rows: list[dict]) -> tuple[Path, list[dict]]:
    """The checkpoint ``s.select`` exports (:func:`draftpipe.stages.draft.checkpoint.selected_checkpoint`) and
    ``rows`` with its epoch marked."""
    checkpoint, epoch, why = selected_checkpoint(work_dir, s.epochs, rows, s.select)
    return checkpoint, mark_exported(rows, epoch, why)


def _train_streamed(job: dict, threads: int | None, stream: StreamSettings):
    """:func:`train_draft`'s ``job`` with the hidden states streamed through a :class:`Spool` beside its work
    directory (its ``shards`` are the completions shards)."""
    _, trainer_devices = split_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), stream.gpus)
    if trainer_devices:  # before torch initialises CUDA here
        os.environ["CUDA_VISIBLE_DEVICES"] = trainer_devices
    s = job["s"]
    spool = Spool(str(job["work_dir"]) + ".spool", job["shards"], stream, s.total_seq_len, threads or 1)
    try:
        return _train_here(**job, spool=spool)
    finally:
        figures = spool.close()
        if figures:
            print(stream_line(figures), flush=True)


def train_rank(spec: dict) -> None:
    """One torchrun rank of :func:`train_draft` (the ``entry`` of its launch spec, :func:`draftpipe.stages.draft.ranks.main`):
    ``spec`` holds train_draft's arguments, the settings ``s`` as a dict."""
    train_draft(**{**spec, "s": DraftSettings(**spec["s"])})


def stream_line(figures: dict) -> str:
    """The log line of a streamed training: units and tokens extracted, the spool's peak against the budget."""
    return (
        f"draft stream: {figures.get('units', 0)} step(s), {figures.get('tokens', 0):,} tokens extracted by vLLM; "
        f"spool peak {figures.get('peak_bytes', 0):,} bytes of a {figures.get('budget', 0):,}-byte budget"
    )


def _datasets(shards, s: DraftSettings, hs_dtype, spool: Spool | None):
    """``(aux_ids, train_ds, val_ds)`` from hidden-state shards, or from the completions through ``spool``."""
    if spool is not None:
        aux_ids = sorted(spool.settings.aux_layer_ids)
        return tuple(
            [aux_ids]
            + [StreamDataset(spool, s.total_seq_len, split, s.val_every, hs_dtype) for split in ("train", "val")]
        )
    metas = [read_shard_metadata(p) for p in shards]
    aux_ids = shards_aux_layer_ids(list(zip(shards, metas)))
    common_template([(p, m.get("chat_template_sha256")) for p, m in zip(shards, metas)])
    return tuple(
        [aux_ids] + [ShardDataset(shards, s.total_seq_len, split, s.val_every, hs_dtype) for split in ("train", "val")]
    )


def _train_here(verifier_dir, shards, vocab_maps, work_dir, s: DraftSettings, checkpoints_per_epoch: int,
                fsdp: bool = False, spool: Spool | None = None, loss_implementation: str = "auto",
                loader_workers: int | None = None, loggers: list[str] | tuple[str, ...] = (),
                log_dir: str | None = None):  # fmt: skip
    """:func:`train_draft` in this process (one rank, or one of several under torchrun)."""
    import torch
    from speculators.train.trainer import TrainerConfig

    on_gpu = torch.accelerator.current_accelerator() is not None
    # speculators trains under bfloat16 autocast (right on GPUs). On a CPU, bfloat16 matmuls without native support
    # (AVX2-only x86, e.g. AMD EPYC before Zen 4) run about 70x slower than float32 (0.58 against 43 GFLOPS on one
    # core of a 2-core AMD EPYC with AVX2), so the CPU trains in float32 (autocast off: CPU autocast supports only
    # bfloat16 and float16). Like the attention and loss kernels below, the device shapes the draft.
    hs_dtype = torch.bfloat16 if on_gpu else torch.float32
    aux_ids, train_ds, val_ds = _datasets(shards, s, hs_dtype, spool)
    if spool is not None:
        spool.start()  # the engine loads while the draft is built
    d2t, t2d, vd = read_maps(vocab_maps)
    attn = attention_implementation(on_gpu, s.method)
    model = build_draft(verifier_dir, aux_ids, d2t, t2d, vd, s, attn)
    hidden_size = model.config.transformer_layer_config.hidden_size
    rank, size = current_rank(), world_size()
    loss = training_loss(s.loss_fn, on_gpu, vd, prefer=loss_implementation)
    workers = data.loader_workers(on_gpu, torch.get_num_threads(), streamed=spool is not None, asked=loader_workers)
    if rank == 0:
        for split, ds in (("train", train_ds), ("validation", val_ds)):
            print(accounting_line(split, ds.accounting, s.total_seq_len), flush=True)
        print(loss.log_line(), flush=True)
        if s.init == "verifier":
            layer = source_layer(aux_ids)
            print(f"draft init: decoder layer, fc and norm start from the verifier's layer {layer}", flush=True)
        if workers:
            print(f"draft data: {workers} loader worker process(es) per rank read the batches ahead", flush=True)

    kw = {"workers": workers, "pin_memory": on_gpu, "shift": s.method == "eagle3"}
    train_loader = packed_loader(train_ds, s, hidden_size, len(aux_ids), (rank, size), **kw)
    val_loader = packed_loader(val_ds, s, hidden_size, len(aux_ids), (rank, size), **kw) if len(val_ds) else None
    call_kw = call_kwargs(s, loss.config)
    cfg = TrainerConfig(
        lr=s.lr,
        num_epochs=s.epochs,
        save_path=str(work_dir),
        resume_from_checkpoint=True,
        train_call_kwargs=call_kw,
        val_call_kwargs=call_kw,
        scheduler_type=s.scheduler_type,
        # the schedule counts optimizer steps, not this rank's packed batches
        scheduler_total_steps=s.epochs * train_loader.batch_sampler.steps,
        hidden_states_dtype=hs_dtype,
        fsdp_shard=fsdp,
        checkpoint_freq=1 if checkpoints_per_epoch <= 1 else 1 / checkpoints_per_epoch,
    )
    trainer = ResumableTrainer(model, cfg, train_loader, val_loader)
    trainer.loss_impl = loss.implementation  # logged with every step: metrics.csv's loss_impl column
    trainer.keep_best = s.select == "best_val" and val_loader is not None
    if spool is not None:  # the steps still to train, from the resume point the trainer found
        samplers = [ld.batch_sampler if ld is not None else None for ld in (train_loader, val_loader)]
        spool.publish(
            plan_units(*samplers, train_ds.global_index, val_ds.global_index, s.epochs, *trainer.resume_point)
        )
    handlers = open_loggers(loggers, log_dir or str(work_dir) + ".logs") if rank == 0 else []
    try:
        trainer.run_training()
    finally:
        close_loggers(handlers)
    rows = epoch_metrics(trainer.metric_records)
    if rank != 0:  # rank 0 keeps the best epoch and exports; the others' result is not used
        return Path(work_dir) / str(s.epochs - 1), rows
    return exported(work_dir, s, rows)

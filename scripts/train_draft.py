"""Rule `draft`: train the EAGLE-3 draft with speculators and export it in the format vLLM loads."""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.core.layout import COMPILE_CACHE  # noqa: E402
    from draftpipe.stages.draft.compile_cache import use_compile_cache  # noqa: E402

    use_compile_cache(COMPILE_CACHE)  # before torch compiles anything: compiled kernels survive a rerun
    from draftpipe.core.gates import check_empty_masks, check_train_samples  # noqa: E402
    from draftpipe.core.io import atomic_path  # noqa: E402
    from draftpipe.core.layout import (  # noqa: E402
        DIGEST_CACHE,
        SHARD_STATES_CACHE,
        SHARD_VALUE_CACHE,
        SOURCE_ROOT,
        results_dir_of,
        store_dir,
    )
    from draftpipe.core.progress import console  # noqa: E402
    from draftpipe.formats.hidden_states import loss_mask_sums, read_shard_metadata, shards_aux_layer_ids  # noqa: E402
    from draftpipe.runtime.integrity import require_sound_shards  # noqa: E402
    from draftpipe.runtime.store import code_digest, content_key, run_stored, stage_settings  # noqa: E402
    from draftpipe.stages.draft.export import export_draft  # noqa: E402
    from draftpipe.stages.draft.metrics import metrics_frame, training_summary  # noqa: E402
    from draftpipe.stages.draft.settings import settings_from_params  # noqa: E402
    from draftpipe.stages.draft.state_gate import StateGate, check_hidden_states  # noqa: E402
    from draftpipe.stages.draft.stream import StreamSettings, read_sequences  # noqa: E402
    from draftpipe.stages.draft.training import train_draft  # noqa: E402
    from draftpipe.workflow.settings import DraftJob, read_job_settings  # noqa: E402

    p = snakemake.params
    settings = settings_from_params(dict(p.draft))
    job_s = read_job_settings(DraftJob, p.untracked)
    if "completions" in snakemake.input.keys():  # hidden_states.storage: stream
        data = list(snakemake.input.completions)
        stream = StreamSettings(
            p.verifier, budget=job_s.disk_budget, gpus=job_s.stream_gpus, gpu_memory=job_s.stream_gpu_memory, **p.stream
        )
        masks = [sum(mask) for _, mask in read_sequences(data, stream.max_len)]
        aux_ids = sorted(stream.aux_layer_ids)
        # the hidden_states stage's gate, on the samples the shards would hold
        check_empty_masks(masks, job_s.max_empty_mask_fraction, ", ".join(data))
    else:
        data, stream = list(snakemake.input.shards), None
        # never train on a damaged shard: it is quarantined (with its store entry) and the job fails naming it
        require_sound_shards(data, results_dir_of(snakemake.output.model), SHARD_VALUE_CACHE)
        # and never on states that are all zero, constant, or not the ones the verifier generated its answers from
        check_hidden_states(data, p.verifier, StateGate(**job_s.state_gate), SHARD_STATES_CACHE)
        masks = [n for shard in data for n in loss_mask_sums(shard)]
        # the ids the shards were extracted at, which the draft was trained on (hidden_states.aux_layer_ids
        # planned them: the shards' metadata and the export agree by construction)
        aux_ids = shards_aux_layer_ids([(s, read_shard_metadata(s)) for s in data])
    # an empty training set (no usable prompt, every answer dropped) stops here, not after exporting random weights
    check_train_samples(masks, job_s.min_train_samples, data)
    # What the job tracks (inputs by content, params, script) and draftpipe's own code key both the finished draft in
    # the stage store and the training state, so a rerun after a crash resumes, a changed knob or input starts afresh,
    # a forced rerun after draftpipe changed trains afresh, and a rebuild that fails (Snakemake has removed the
    # outputs) loses nothing: the config that built the draft copies it back.
    stored = content_key(
        [str(f) for f in snakemake.input],
        stage_settings(snakemake),
        code_digest([Path(snakemake.scriptdir) / "train_draft.py"], package=SOURCE_ROOT / "draftpipe"),
        DIGEST_CACHE,
    )
    work = Path(snakemake.output.model).parent / ".train" / stored[:16]
    outputs = [snakemake.output.model, snakemake.output.config, snakemake.output.metrics]

    def build(paths):
        model, config, metrics = paths
        checkpoint, rows = train_draft(
            p.verifier,
            data,
            snakemake.input.vocab,
            str(work),
            settings,
            checkpoints_per_epoch=job_s.checkpoints_per_epoch,
            ranks=job_s.ranks,
            threads=snakemake.threads,
            fsdp=job_s.fsdp,
            nodes=job_s.nodes,
            stream=stream,
            loss_implementation=job_s.loss_implementation,
            loader_workers=job_s.loader_workers,
            loggers=job_s.loggers,
            log_dir=str(Path(snakemake.output.model).parent / "logs"),
        )
        with atomic_path(metrics) as tmp:
            metrics_frame(rows).to_csv(tmp, index=False)
        export_draft(
            checkpoint,
            model,
            config,
            aux_ids,
            p.verifier_name,
        )
        print(metrics_frame(rows).to_string())

    run_stored(store_dir(snakemake.output.model, "draft"), stored, outputs, build, what="draft")
    console(f"draft: {training_summary(snakemake.output.metrics)}")
    # The draft is exported and stored: its training state goes (a full-precision copy of the draft and its optimizer,
    # tens of GB for a large verifier).
    shutil.rmtree(work, ignore_errors=True)
    Path(str(work) + ".launch.json").unlink(missing_ok=True)

"""Rule `draft`: train the EAGLE-3 draft with speculators and export it in the format vLLM loads."""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.core.gates import check_train_samples  # noqa: E402
    from draftpipe.core.gpus import draft_ranks  # noqa: E402
    from draftpipe.core.io import atomic_path  # noqa: E402
    from draftpipe.core.layout import DIGEST_CACHE, SHARD_VALUE_CACHE, SOURCE_ROOT, results_dir_of, store_dir  # noqa: E402
    from draftpipe.core.progress import console  # noqa: E402
    from draftpipe.formats.hidden_states import loss_mask_sums  # noqa: E402
    from draftpipe.runtime.integrity import require_sound_shards  # noqa: E402
    from draftpipe.runtime.store import code_digest, content_key, run_stored, stage_settings  # noqa: E402
    from draftpipe.stages.draft.export import export_draft  # noqa: E402
    from draftpipe.stages.draft.metrics import metrics_frame, training_summary  # noqa: E402
    from draftpipe.stages.draft.settings import settings_from_params  # noqa: E402
    from draftpipe.stages.draft.training import train_draft  # noqa: E402

    p = snakemake.params
    # never train on a damaged shard: it is quarantined (with its store entry) and the job fails naming it
    require_sound_shards(list(snakemake.input.shards), results_dir_of(snakemake.output.model), SHARD_VALUE_CACHE)
    settings = settings_from_params(dict(p.draft))
    # an empty training set (no usable prompt, every answer dropped) stops here, not after exporting random weights
    check_train_samples(
        [n for shard in snakemake.input.shards for n in loss_mask_sums(shard)],
        snakemake.config["draft"]["min_train_samples"],
        list(snakemake.input.shards),
    )
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
    res = snakemake.config["resources"]["draft"]  # not params: they shape nothing
    outputs = [snakemake.output.model, snakemake.output.config, snakemake.output.metrics]

    def build(paths):
        model, config, metrics = paths
        checkpoint, rows = train_draft(
            p.verifier,
            list(snakemake.input.shards),
            snakemake.input.vocab,
            str(work),
            settings,
            checkpoints_per_epoch=res["checkpoints_per_epoch"],
            ranks=draft_ranks(res),
            threads=snakemake.threads,
            fsdp=res["fsdp"],
            nodes=res["nodes"],
        )
        with atomic_path(metrics) as tmp:
            metrics_frame(rows).to_csv(tmp, index=False)
        export_draft(
            checkpoint,
            model,
            config,
            list(p.aux_layer_ids),
            str(Path(p.verifier).resolve()) if Path(p.verifier).exists() else p.verifier,
        )
        print(metrics_frame(rows).to_string())

    run_stored(store_dir(snakemake.output.model, "draft"), stored, outputs, build, what="draft")
    console(f"draft: {training_summary(snakemake.output.metrics)}")
    # The draft is exported and stored: its training state goes (a full-precision copy of the draft and its optimizer,
    # tens of GB for a large verifier).
    shutil.rmtree(work, ignore_errors=True)
    Path(str(work) + ".launch.json").unlink(missing_ok=True)

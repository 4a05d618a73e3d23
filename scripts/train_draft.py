"""Rule `draft`: train the EAGLE-3 draft with speculators and export it in the format vLLM loads."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.draft import export_draft, metrics_frame, settings_from_params, train_draft  # noqa: E402
    from draftpipe.integrity import require_sound_shards  # noqa: E402
    from draftpipe.io import atomic_path  # noqa: E402
    from draftpipe.layout import SHARD_VALUE_CACHE, results_dir_of  # noqa: E402
    from draftpipe.ranks import draft_ranks  # noqa: E402

    p = snakemake.params
    # never train on a damaged shard: it is quarantined (with its store entry) and the job fails naming it
    require_sound_shards(list(snakemake.input.shards), results_dir_of(snakemake.output.model), SHARD_VALUE_CACHE)
    settings = settings_from_params(dict(p.draft))
    # Training state is keyed by everything that shapes it, so a rerun after a crash resumes, and a changed
    # knob or input starts afresh.
    key = json.dumps(
        {
            "params": dict(p.draft),
            "aux": list(p.aux_layer_ids),
            "verifier": p.verifier_id,
            "inputs": [(f, Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in snakemake.input.shards]
            + [(snakemake.input.vocab, Path(snakemake.input.vocab).stat().st_mtime_ns)],
        },
        sort_keys=True,
    )
    work = Path(snakemake.output.model).parent / ".train" / hashlib.sha256(key.encode()).hexdigest()[:16]
    job = snakemake.config["resources"]["draft"]  # not params: they shape nothing
    checkpoint, rows = train_draft(
        p.verifier,
        list(snakemake.input.shards),
        snakemake.input.vocab,
        str(work),
        settings,
        checkpoints_per_epoch=job["checkpoints_per_epoch"],
        ranks=draft_ranks(job),
        threads=snakemake.threads,
        fsdp=job["fsdp"],
        nodes=job["nodes"],
    )
    with atomic_path(snakemake.output.metrics) as tmp:
        metrics_frame(rows).to_csv(tmp, index=False)
    export_draft(
        checkpoint,
        snakemake.output.model,
        snakemake.output.config,
        list(p.aux_layer_ids),
        str(Path(p.verifier).resolve()) if Path(p.verifier).exists() else p.verifier,
    )
    print(metrics_frame(rows).to_string())
    # The draft is exported: its training state goes (a full-precision copy of the draft and its optimizer, tens of GB for
    # a large verifier), so a forced rerun, or one after draftpipe's code changed, trains afresh instead of exporting it.
    shutil.rmtree(work, ignore_errors=True)
    Path(str(work) + ".launch.json").unlink(missing_ok=True)

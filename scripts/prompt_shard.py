"""Rule `prompt_shard`: one part of the prompt set (a training shard or the eval split), from the sources."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.core.io import write_jsonl
    from draftpipe.workflow.fingerprint import prompt_part
    from draftpipe.workflow.settings import PromptShardJob, read_job_settings

    p = snakemake.params
    # The source paths are untracked: what the part holds is tracked by its fingerprint, so moving or touching a
    # source reruns nothing. prompt_part checks that the records still match the fingerprint the job was planned with.
    job_s = read_job_settings(PromptShardJob, p.untracked)
    records = prompt_part(
        job_s.sources,
        p.eval_fraction,
        p.num_shards,
        p.split_seed,
        snakemake.wildcards.part,
        p.fingerprint,
        job_s.system_prompt,
    )
    write_jsonl(snakemake.output[0], records)
    print(f"{snakemake.wildcards.part}: {len(records)} prompts, fingerprint {p.fingerprint[:16]}")

"""Rule `completion_stats`: counts of the completions stage (rows, turns, truncated rows, thinking spans)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.core.io import iter_jsonl, write_json
    from draftpipe.stages.completions.stats import completion_stats

    # streamed: one row in memory at a time, whatever the size of the completions
    stats = completion_stats({str(path): (row for _, row in iter_jsonl(path)) for path in snakemake.input.completions})
    write_json(snakemake.output.stats, stats)
    print({k: v for k, v in stats.items() if k != "per_shard"})

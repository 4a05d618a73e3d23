"""Rule `prompt_set`: counts of what the prompt sources held (read, empty, duplicates, kept, per part)."""

import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.core.io import read_jsonl, write_json
    from draftpipe.core.progress import console
    from draftpipe.formats.prompts import load_prompts

    records, stats = load_prompts(snakemake.params.sources, snakemake.params.system_prompt)
    parts = {Path(path).stem: len(read_jsonl(path)) for path in snakemake.input.parts}
    train = {k: v for k, v in parts.items() if k.startswith("train_")}
    summary = {
        **asdict(stats),
        "train": sum(train.values()),
        "eval": parts["eval"],
        "train_per_shard": [train[k] for k in sorted(train)],
    }
    write_json(snakemake.output.stats, summary)
    print(summary)
    console(
        f"prompt_set: {stats.read} records read, {stats.kept} prompts kept ({summary['train']} train, "
        f"{summary['eval']} eval), {stats.empty} without a prompt, {stats.duplicates} duplicate(s)"
        + (f", {len(stats.warnings)} warning(s) in stats.json" if stats.warnings else "")
    )

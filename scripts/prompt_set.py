"""Rule `prompt_set`: sources -> deduplicated chat records, train shards by id, one eval file."""
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime import start_job

start_job(snakemake)  # ML environment, log, this job's GPUs and threads

from draftpipe.io import write_json, write_jsonl
from draftpipe.prompts import load_prompts, split_and_shard

p = snakemake.params
records, stats = load_prompts(p.sources)
shards, evals = split_and_shard(records, p.eval_fraction, p.num_shards, p.split_seed)
for path, shard in zip(snakemake.output.train, shards):
    write_jsonl(path, shard)
write_jsonl(snakemake.output.eval, evals)
summary = {**asdict(stats), "train": sum(len(s) for s in shards), "eval": len(evals),
           "train_per_shard": [len(s) for s in shards]}
write_json(snakemake.output.stats, summary)
print(summary)

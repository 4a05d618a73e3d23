"""Rule `bench_run`: measure acceptance and speed of the draft in vLLM against the verifier alone."""

if __name__ == "__main__":  # vLLM's CPU engine spawns workers that re-run this file as __mp_main__
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.runtime.job import engine_parallelism, job

    with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
        import pandas as pd

        from draftpipe.bench.benchmark import benchmark, summary_line
        from draftpipe.bench.prompts import job_prompt_sets
        from draftpipe.core.io import atomic_path, write_json
        from draftpipe.core.progress import console
        from draftpipe.inference.engine import speculative_dtype
        from draftpipe.workflow.settings import BenchRunJob, read_job_settings

        p = snakemake.params
        s = p.settings
        job_s = read_job_settings(BenchRunJob, p.untracked)
        _, prompt_sets = job_prompt_sets(
            p,
            snakemake.input.eval,
            job_s.chat_template_file,
            max_prompts=s["max_prompts"],
            stage="the benchmark",
            engine=engine_parallelism(snakemake.resources.gpu),
        )
        summary, table = benchmark(
            p.verifier,
            str(Path(snakemake.input.model).parent),
            prompt_sets,
            num_speculative_tokens=s["num_speculative_tokens"],
            temperatures=s["temperatures"],
            batch_sizes=s["batch_sizes"],
            max_tokens=s["max_tokens"],
            max_model_len=p.max_model_len,
            dtype=speculative_dtype(p.dtype),
            metrics_csv=snakemake.input.metrics,
            engine=engine_parallelism(snakemake.resources.gpu),
        )
        with atomic_path(snakemake.output.per_prompt) as tmp:
            pd.DataFrame(table).to_csv(tmp, index=False)
        write_json(snakemake.output.summary, summary)
        console(f"bench_run: {summary_line(summary)}")
        mismatches = [r for r in summary["results"] if r.get("identical") is False]
        for r in mismatches:
            print(
                f"MISMATCH at temperature 0: {r['prompt_set']} k={r['num_speculative_tokens']}: {r['mismatched_prompts']}"
            )

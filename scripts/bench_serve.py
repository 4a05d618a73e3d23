"""Rule `bench_serve`: `vllm serve` with and without the draft, a concurrency sweep with vLLM's serving benchmark."""

if __name__ == "__main__":  # vLLM's CPU engine spawns workers that re-run this file as __mp_main__
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.runtime.job import engine_parallelism, job

    with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
        from draftpipe.bench.benchmark import environment
        from draftpipe.bench.prompts import job_prompt_sets
        from draftpipe.bench.serve import serve_sweep
        from draftpipe.core.io import write_json
        from draftpipe.core.progress import console
        from draftpipe.inference.engine import speculative_dtype
        from draftpipe.workflow.settings import BenchServeJob, read_job_settings

        p = snakemake.params
        s = p.settings
        job_s = read_job_settings(BenchServeJob, p.untracked)
        tok, prompt_sets = job_prompt_sets(
            p,
            snakemake.input.eval,
            job_s.chat_template_file,
            max_prompts=s["num_prompts"],
            stage="the served benchmark",
            engine=engine_parallelism(snakemake.resources.gpu),
        )
        summary = serve_sweep(
            p.verifier,
            str(Path(snakemake.input.model).parent),
            prompt_sets,
            concurrency=s["concurrency"],
            num_speculative_tokens=s["num_speculative_tokens"],
            max_tokens=s["max_tokens"],
            max_model_len=p.max_model_len,
            dtype=speculative_dtype(p.dtype),
            tokenizer=tok,
            server_logs=(snakemake.log.verifier_server, snakemake.log.draft_server),
            engine=engine_parallelism(snakemake.resources.gpu),
            startup_timeout=job_s.startup_timeout,
        )
        summary = {"environment": environment(), "verifier": p.verifier, **summary}
        write_json(snakemake.output.summary, summary)
        for r in summary["results"]:
            console(
                f"bench_serve: {r['prompt_set']} concurrency {r['concurrency']}: acceptance length "
                f"{r['draft']['acceptance_length']:.2f} (k={r['num_speculative_tokens']}), output tokens/s "
                f"{r['draft']['output_tokens_per_s']:.1f} with the draft, {r['baseline']['output_tokens_per_s']:.1f} "
                f"alone, speedup {r['speedup'] or 0:.2f}x"
            )

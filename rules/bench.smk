# vLLM benchmark: the verifier alone and with the draft, same prompts and sampling, counters from vLLM itself.
# Measurement (bench_run) and presentation (bench_report) are separate rules, so a formatting option never
# reruns the measurement.
rule bench_run:
    input:
        model=rules.draft.output.model,
        config=rules.draft.output.config,
        metrics=rules.draft.output.metrics,
        compat=rules.compat_report.output.json,
        eval="results/prompts/eval.jsonl",
        sets=[s["path"] for s in config["bench"]["prompt_sets"]],
        verifier=verifier_files,
    output:
        summary="results/bench/summary.json",
        per_prompt="results/bench/per_prompt.csv",
    params:
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        settings=canon(
            {
                k: config["bench"][k]
                for k in (
                    "num_speculative_tokens",
                    "temperatures",
                    "batch_sizes",
                    "max_tokens",
                    "max_prompts",
                    "prompt_sets",
                )
            }
        ),
        max_model_len=config["verifier"]["max_model_len"],
        dtype=config["verifier"]["dtype"],
        rendering=RENDERING,
        too_long=config["completions"]["too_long"],  # the length policy of every stage that prompts the verifier
        answer_tokens=config["completions"]["max_tokens"],  # the verifier's answers before a later benchmark turn
        untracked=job_settings("bench_run", config),  # shapes nothing: draftpipe/workflow/settings.py
    log:
        "results/logs/bench_run.log",
    benchmark:
        "results/benchmarks/bench_run.tsv"
    threads: res("bench_run", "threads")
    resources:
        **stage_resources("bench_run"),
    conda:
        ML_ENV
    script:
        "../scripts/bench_run.py"


# The served benchmark (bench.serve set): vLLM's API server for the verifier alone and with the draft, vLLM's
# serving benchmark at each concurrency, on the offline benchmark's prompts; the resources of bench_run.
rule bench_serve:
    input:
        model=rules.draft.output.model,
        config=rules.draft.output.config,
        compat=rules.compat_report.output.json,
        eval="results/prompts/eval.jsonl",
        sets=[s["path"] for s in config["bench"]["prompt_sets"]],
        verifier=verifier_files,
    output:
        summary="results/bench/serve.json",
    params:
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        settings=canon(serve_settings(config["bench"])),
        max_model_len=config["verifier"]["max_model_len"],
        dtype=config["verifier"]["dtype"],
        rendering=RENDERING,
        too_long=config["completions"]["too_long"],
        answer_tokens=config["completions"]["max_tokens"],
        untracked=job_settings("bench_serve", config),  # shapes nothing: draftpipe/workflow/settings.py
    log:
        job="results/logs/bench_serve.log",
        verifier_server="results/logs/bench_serve.verifier.server.log",
        draft_server="results/logs/bench_serve.draft.server.log",
    benchmark:
        "results/benchmarks/bench_serve.tsv"
    threads: res("bench_run", "threads")
    resources:
        **stage_resources("bench_run"),
    conda:
        ML_ENV
    script:
        "../scripts/bench_serve.py"


rule bench_report:
    input:
        unpack(served_summary),
        summary=rules.bench_run.output.summary,
        metrics=rules.draft.output.metrics,
    output:
        # report(): what `snakemake --report report.html` shows (with the prompt and completion stats, the
        # training metrics and the compatibility report)
        report=report("results/bench/report.md", category="Benchmark"),
        per_position=report("results/bench/per_position_acceptance.png", category="Benchmark"),
        vs_k=report("results/bench/acceptance_speedup_vs_k.png", category="Benchmark"),
        training=report("results/bench/training_curves.png", category="Training"),
        # with bench.serve: speedup against concurrency, and output tokens/s against per-user tokens/s
        **(
            {"serve": report("results/bench/serve_sweep.png", category="Benchmark")}
            if config["bench"]["serve"]
            else {}
        ),
    params:
        style=canon({**config["bench"]["report"], "title": report_title(config, VERIFIER)}),
        serve_tolerance=(config["bench"]["serve"] or {}).get("acceptance_tolerance"),
        untracked=job_settings("bench_report", config),  # the acceptance gate shapes nothing
    log:
        "results/logs/bench_report.log",
    threads: 1
    conda:
        ML_ENV
    script:
        "../scripts/bench_report.py"

# Compatibility report: prove the draft fits vLLM's EAGLE-3 loader before anyone serves or benchmarks it.
rule compat_report:
    input:
        model=rules.draft.output.model,
        config=rules.draft.output.config,
        prompts="results/prompts/eval.jsonl",
        verifier=verifier_files,
    output:
        json="results/report/compat.json",
        md=report("results/report/compat.md", category="Compatibility"),
    params:
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        expect=canon(
            {
                "head_dim": config["draft"].get("head_dim"),
                "draft_vocab_size": DERIVED["draft_vocab_size"],
                "aux_layer_ids": DERIVED["aux_layer_ids"],
                "max_model_len": config["verifier"]["max_model_len"],
            }
        ),
        live=LIVE_CHECK,
        rendering=RENDERING,
        live_prompts=config["report"]["live_prompts"],
        live_max_tokens=config["report"]["live_max_tokens"],
        too_long=config["completions"]["too_long"],  # the length policy of every stage that prompts the verifier
        max_model_len=config["verifier"]["max_model_len"],
        dtype=config["verifier"]["dtype"],
        untracked=job_settings("compat_report", config),  # shapes nothing: draftpipe/workflow/settings.py
    log:
        "results/logs/compat_report.log",
    benchmark:
        "results/benchmarks/compat_report.tsv"
    threads: res("compat_report", "threads")
    resources:
        **stage_resources("compat_report"),
    conda:
        ML_ENV
    script:
        "../scripts/compat_report.py"


# The draft's model card: what the Hub shows, in the draft folder that draftpipe-publish pushes.
rule model_card:
    input:
        config=rules.draft.output.config,
        metrics=rules.draft.output.metrics,
        prompts=rules.prompt_set.output.stats,
        completions=rules.completion_stats.output.stats,
        compat=rules.compat_report.output.json,
        **({"bench": "results/bench/summary.json"} if config["card"]["benchmark"] else {}),
    output:
        card="results/draft/README.md",
    params:
        verifier=published_verifier(VERIFIER, config),
        base_model=verifier_hub_id(VERIFIER, config),
        license=verifier_license(VERIFIER, config),
        datasets=hub_dataset_ids(config["prompts"]["sources"]),
        tags=config["card"]["tags"],
        title=report_title(config, VERIFIER),
        sampling=canon({k: config["completions"][k] for k in ("samples_per_prompt", "temperature", "top_p", "max_tokens")}),
    log:
        "results/logs/model_card.log",
    threads: 1
    conda:
        ML_ENV
    script:
        "../scripts/model_card.py"

# Stage 5: the EAGLE-3 draft, trained with speculators, saved in the speculators format vLLM loads; with
# hidden_states.storage: stream it extracts the hidden states from vLLM as it trains (no shard is written).
rule draft:
    input:
        unpack(draft_data),  # hidden-state shards, or the completions when they are streamed
        vocab=rules.vocab_maps.output.maps,
        verifier=verifier_files,
    output:
        model="results/draft/model.safetensors",
        config="results/draft/config.json",
        metrics=report("results/draft/metrics.csv", category="Training"),
    params:
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        # the quality gate min_train_samples shapes nothing: it is untracked; init at its default (random) is left
        # out, so a draft built before the knob existed is not retrained
        draft=canon(
            {
                k: v
                for k, v in config["draft"].items()
                if k != "min_train_samples" and not (k == "init" and v == "random")
            }
        ),
        **stream_params(),  # hidden_states.storage: stream only
        untracked=job_settings("draft", config),  # shapes nothing: draftpipe/workflow/settings.py
    log:
        "results/logs/draft.log",
    benchmark:
        "results/benchmarks/draft.tsv"
    threads: res("draft", "threads")
    resources:
        **stage_resources("draft"),
    conda:
        ML_ENV
    script:
        "../scripts/train_draft.py"

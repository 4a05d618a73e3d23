# A GGUF verifier becomes a Hugging Face directory that transformers, speculators and vLLM all load.
if VERIFIER["kind"] == "gguf":

    rule verifier:
        input:
            gguf=ancient(VERIFIER["path"]),  # tracked by content: params.verifier_id (SHA-256 of the file)
        output:
            config="results/verifier/config.json",
            weights="results/verifier/model.safetensors",
            tokenizer="results/verifier/tokenizer.json",
            tokenizer_config="results/verifier/tokenizer_config.json",
            generation_config="results/verifier/generation_config.json",
        params:
            verifier_id=VERIFIER_ID,
            # what the settings resolve to for this GGUF (draftpipe.workflow.config.gguf_conversion): null head_dim and
            # context are the model's own, so the param holds the value the conversion writes
            head_dim=DERIVED["gguf"]["head_dim"],
            max_position_embeddings=DERIVED["gguf"]["max_position_embeddings"],
            dtype=DERIVED["gguf"]["dtype"],
        log:
            "results/logs/verifier.log",
        benchmark:
            "results/benchmarks/verifier.tsv"
        threads: 1
        resources:
            mem_mb=4000,
        conda:
            ML_ENV
        script:
            "../scripts/convert_verifier.py"

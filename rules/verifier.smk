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
            head_dim=config["verifier"]["gguf_head_dim"],
            max_position_embeddings=config["verifier"]["gguf_max_position_embeddings"],
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

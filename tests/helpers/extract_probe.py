"""Run vLLM extraction on a verifier three ways with one engine, for tests/e2e/test_extract_vllm.py (a subprocess: vLLM's
CPU engine spawns workers that re-run ``__main__``).

    python tests/helpers/extract_probe.py VERIFIER ROWS.jsonl OUT_DIR AUX_ID [AUX_ID ...]

Writes to OUT_DIR: ``batch.safetensors`` (every row in one engine call), ``single.safetensors`` (one row per call)
and ``cached.safetensors`` (all rows again: their prefixes are now in vLLM's prefix cache), each a float32
hidden-state shard, and ``left.json`` (files left in the request directory).
"""

if __name__ == "__main__":
    import json
    import os
    import sys
    from pathlib import Path

    import torch

    import draftpipe.stages.extract as ex
    from draftpipe.core.io import read_jsonl
    from draftpipe.formats.captured import engine_layer_ids
    from draftpipe.formats.hidden_states import write_shard

    verifier, rows_file, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    aux = [int(a) for a in sys.argv[4:]]
    num_layers = json.loads((Path(verifier) / "config.json").read_text())
    num_layers = num_layers.get("text_config", num_layers)["num_hidden_layers"]
    torch.set_num_threads(1)
    rows = read_jsonl(rows_file)
    requests = out / "requests"
    llm = ex.open_extractor(
        verifier,
        layer_ids=engine_layer_ids(aux, num_layers),
        dtype="float32",
        max_len=max(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows),
        seed=0,
        request_dir=requests,
    )
    for name, budget in (("batch", 1 << 30), ("single", 1), ("cached", 1 << 30)):
        samples = ex.build_samples(
            llm,
            rows,
            aux_ids=aux,
            num_layers=num_layers,
            max_len=1 << 30,
            dtype=torch.float32,
            request_dir=requests,
            batch_tokens=budget,
        )
        write_shard(str(out / f"{name}.safetensors"), samples, {"aux_layer_ids": sorted(aux)})
    (out / "left.json").write_text(json.dumps(sorted(os.listdir(requests))))

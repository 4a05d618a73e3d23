"""Hidden-state extraction speed, as ratios measured in one run on the same tokens.

    .venv/bin/python benchmarks/hidden_states.py [--verifier DIR] [--completions FILE.jsonl] [--rows N]

Three ways over the same sequences (prompt + completion token ids):

- ``extract``: vLLM with ``extract_hidden_states`` and draftpipe's connector (:func:`draftpipe.stages.extract.build_samples`,
  what the ``hidden_states`` rule runs), states written, read back and folded into samples;
- ``prefill``: the same engine settings without the speculative method and the connector, the same batch with
  ``max_tokens=1``: the bare prefill that extraction adds to;
- ``transformers``: the verifier in transformers with forward hooks, one sequence at a time (the old path, now the
  tests' oracle).

Each runs in its own process (one vLLM engine per process); the engine start is timed apart from the timed pass,
which follows one warm-up pass over the same batch. Default verifier: the embedded stories260K, converted into a
temporary directory; default sequences: the first ``--rows`` rows of ``--completions`` or, without it, TinyStories
prompts continued by other TinyStories prompts. Prints tokens/s of each and the ratios extract/prefill and
extract/transformers, and the bytes per token of the request files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCHED_TOKENS = 4096  # the same scheduler budget for both engines (vLLM's default differs with a speculative method)
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the transformers oracle (tests/helpers/oracle.py)


def _rows(verifier: str, completions: str | None, n: int) -> list[dict]:
    from draftpipe.core.io import read_jsonl

    if completions:
        return read_jsonl(completions)[:n]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier)
    lines = (REPO / "draftpipe/data/prompts/tinystories_evaluation_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines]
    rows = []
    for i in range(n):
        prompt = tok(texts[i % len(texts)], add_special_tokens=True)["input_ids"]
        completion = []
        j = i + 1
        while len(completion) < 200:
            completion += tok(texts[j % len(texts)], add_special_tokens=False)["input_ids"]
            j += 7
        rows.append({"prompt_token_ids": prompt, "completion_token_ids": completion[:200]})
    return rows


def _phase(name: str, verifier: str, rows_file: str, aux: list[int]) -> dict:
    import torch

    import draftpipe.stages.extract as ex
    from draftpipe.core.io import read_jsonl
    from draftpipe.formats.captured import engine_layer_ids

    rows = read_jsonl(rows_file)
    # the warm-up pass runs other token sequences (reversed), so the timed pass finds nothing in the prefix cache
    warm = [
        {"prompt_token_ids": r["completion_token_ids"][::-1], "completion_token_ids": r["prompt_token_ids"][::-1]}
        for r in rows[:8]
    ]
    seqs = [r["prompt_token_ids"] + r["completion_token_ids"] for r in rows]
    tokens = sum(map(len, seqs))
    num_layers = json.loads((Path(verifier) / "config.json").read_text())
    num_layers = num_layers.get("text_config", num_layers)["num_hidden_layers"]
    max_len = max(map(len, seqs))
    result = {"tokens": tokens, "sequences": len(seqs)}
    t0 = time.perf_counter()
    if name == "transformers":
        from helpers.oracle import build_sample, load_verifier_model

        model = load_verifier_model(verifier, "float32")
        result["start_s"] = time.perf_counter() - t0
        run = lambda rows: [build_sample(model, r, aux, num_layers, max_len, torch.bfloat16) for r in rows]  # noqa: E731
    elif name == "extract":
        requests = Path(tempfile.mkdtemp(prefix="draftpipe-bench-"))
        llm = ex.open_extractor(
            verifier,
            layer_ids=engine_layer_ids(aux, num_layers),
            dtype="float32",
            max_len=max_len,
            seed=0,
            request_dir=requests,
            engine={"max_num_batched_tokens": BATCHED_TOKENS},
        )
        result["start_s"] = time.perf_counter() - t0
        hidden = json.loads((Path(verifier) / "config.json").read_text())
        hidden = hidden.get("text_config", hidden)["hidden_size"]
        # a request file holds float32 states of every captured id and an int64 token id per token
        result["file_bytes_per_token"] = len(engine_layer_ids(aux, num_layers)) * hidden * 4 + 8
        run = lambda rows: ex.build_samples(
            llm,
            rows,
            aux_ids=aux,
            num_layers=num_layers,
            max_len=max_len,  # noqa: E731
            dtype=torch.bfloat16,
            request_dir=requests,
        )
    else:
        from vllm import LLM, SamplingParams

        from draftpipe.inference.engine import engine_kwargs

        llm = LLM(
            **engine_kwargs(
                verifier,
                dtype="float32",
                max_model_len=max_len + 1,
                seed=0,
                extra={"enable_prefix_caching": True, "max_num_batched_tokens": BATCHED_TOKENS},
            )
        )
        result["start_s"] = time.perf_counter() - t0
        params = SamplingParams(max_tokens=1, temperature=0.0)
        run = lambda rows: llm.generate(  # noqa: E731
            [{"prompt_token_ids": r["prompt_token_ids"] + r["completion_token_ids"]} for r in rows],
            params,
            use_tqdm=False,
        )
    run(warm)
    t0 = time.perf_counter()
    run(rows)
    result["pass_s"] = time.perf_counter() - t0
    result["tokens_per_s"] = tokens / result["pass_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", help="Hugging Face directory (default: the embedded stories260K, converted)")
    ap.add_argument("--completions", help="a completions shard (JSONL) to take the sequences from")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--aux", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--phase", choices=["extract", "prefill", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        Path(args.result).write_text(json.dumps(_phase(args.phase, args.verifier, args.rows_file, args.aux)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        verifier = args.verifier
        if verifier is None:
            from draftpipe.stages.verifier import convert_gguf

            verifier = str(Path(tmp) / "stories260K")
            convert_gguf(REPO / "draftpipe/data/stories260K/stories260K.gguf", verifier, max_position_embeddings=512)
        rows_file = Path(tmp) / "rows.jsonl"
        rows_file.write_text("".join(json.dumps(r) + "\n" for r in _rows(verifier, args.completions, args.rows)))
        results = {}
        for phase in ("extract", "prefill", "transformers"):
            result = Path(tmp) / f"{phase}.json"
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--phase",
                    phase,
                    "--verifier",
                    verifier,
                    "--rows-file",
                    str(rows_file),
                    "--result",
                    str(result),
                    "--aux",
                    *map(str, args.aux),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            results[phase] = json.loads(result.read_text())
    e, p, t = results["extract"], results["prefill"], results["transformers"]
    print(f"{e['sequences']} sequences, {e['tokens']} tokens, aux ids {args.aux}")
    for name, r in results.items():
        print(
            f"  {name:13s} start {r['start_s']:6.1f} s   pass {r['pass_s']:7.3f} s   {r['tokens_per_s']:10.0f} tokens/s"
        )
    print(
        f"extract / bare prefill: {e['tokens_per_s'] / p['tokens_per_s']:.2f}x   "
        f"extract / transformers: {e['tokens_per_s'] / t['tokens_per_s']:.2f}x   "
        f"request file bytes per token: {e['file_bytes_per_token']}"
    )
    summary = {
        "tokens": e["tokens"],
        "tokens_per_s": {name: round(r["tokens_per_s"], 1) for name, r in results.items()},
        "extract_over_prefill": round(e["tokens_per_s"] / p["tokens_per_s"], 2),
        "extract_over_transformers": round(e["tokens_per_s"] / t["tokens_per_s"], 2),
    }
    print(json.dumps(summary))  # the line benchmarks/run.py reads
    return 0


if __name__ == "__main__":
    sys.exit(main())

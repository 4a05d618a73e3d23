"""EAGLE-3 speculative decoding in vLLM: run the verifier with and without the draft, read acceptance counters.

Counters (``vllm/v1/spec_decode/metrics.py``; ``LLM.get_metrics()`` returns them without the ``_total`` suffix):
``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens``
and the vector ``vllm:spec_decode_num_accepted_tokens_per_pos``. Formulas from the same file's docstring:
acceptance length = 1 + accepted / drafts (the bonus token included); acceptance rate = accepted / draft tokens;
per-position rate i = accepted_per_pos[i] / drafts.

Command line (the engine spawns workers, so this must run as a program, not inside pytest's process)::

    python -m draftpipe.checks.spec_decode --verifier DIR --draft DIR --prompts eval.jsonl --out result.json
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from draftpipe.core.io import read_jsonl, write_json
from draftpipe.formats.chat import encode_prompt
from draftpipe.inference.engine import engine_in_process, engine_kwargs, speculative_config


def acceptance_from_counters(
    num_drafts: float, num_draft_tokens: float, accepted: float, accepted_per_pos: list[float]
) -> dict:
    """Acceptance figures from vLLM's spec-decode counters.

    Args:
        num_drafts: number of draft proposals (one per verifier step with speculation).
        num_draft_tokens: drafted tokens in total (``num_drafts * k``).
        accepted: accepted draft tokens in total.
        accepted_per_pos: accepted tokens at each speculative position ``0..k-1``.

    Returns:
        ``acceptance_length`` (tokens per verifier step, >= 1), ``acceptance_rate`` (0..1) and
        ``per_position_acceptance`` (list of k rates in 0..1); zeros-safe when nothing was drafted.
    """
    return {
        "num_drafts": int(num_drafts),
        "num_draft_tokens": int(num_draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_length": 1.0 + (accepted / num_drafts if num_drafts else 0.0),
        "acceptance_rate": accepted / num_draft_tokens if num_draft_tokens else 0.0,
        "per_position_acceptance": [a / num_drafts if num_drafts else 0.0 for a in accepted_per_pos],
    }


def snapshot(metrics: list[Any]) -> dict:
    """Raw spec-decode counters from ``LLM.get_metrics()``, summed over engines: ``drafts``, ``draft_tokens``,
    ``accepted`` and ``per_pos`` (zeros and an empty list when the engine has no draft)."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": []}
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [float(v) for v in m.values]
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"], vals)] if out["per_pos"] else vals
    return out


def read_spec_counters(metrics: list[Any]) -> dict:
    """Acceptance figures of everything an engine ran so far; see :func:`snapshot` and
    :func:`acceptance_from_counters`."""
    c = snapshot(metrics)
    return acceptance_from_counters(c["drafts"], c["draft_tokens"], c["accepted"], c["per_pos"])


def generate(
    verifier: str,
    prompt_token_ids: list[list[int]],
    *,
    max_tokens: int,
    max_model_len: int,
    dtype: str = "float32",
    draft: str | None = None,
    num_speculative_tokens: int = 3,
) -> dict:
    """Greedy (temperature 0) generation with the verifier alone, or with the draft (its method from its config:
    :func:`draftpipe.inference.engine.speculative_config`).

    Returns:
        ``{"token_ids": [[int]], "spec": dict | None}``; ``spec`` holds the acceptance figures when a draft ran.
    """
    from vllm import LLM, SamplingParams

    extra = {}
    if draft:
        extra["speculative_config"] = speculative_config(draft, num_speculative_tokens)
    kwargs = engine_kwargs(verifier, dtype=dtype, max_model_len=max_model_len, seed=0, extra=extra)
    engine_in_process(kwargs)
    llm = LLM(**kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_token_ids],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    result = {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "spec": None}
    if draft:
        result["spec"] = read_spec_counters(llm.get_metrics())
    del llm
    gc.collect()
    return result


def compare(verifier: str, draft: str, prompt_token_ids: list[list[int]], **kw) -> dict:
    """Run the verifier alone and with the draft on the same prompts; report identity and acceptance."""
    base = generate(verifier, prompt_token_ids, **kw)
    spec = generate(verifier, prompt_token_ids, draft=draft, **kw)
    mismatches = [i for i, (a, b) in enumerate(zip(base["token_ids"], spec["token_ids"])) if a != b]
    return {
        "identical": not mismatches,
        "mismatched_prompts": mismatches,
        **spec["spec"],
        "num_prompts": len(prompt_token_ids),
        "output_tokens": sum(len(t) for t in spec["token_ids"]),
    }


def main(argv: list[str] | None = None) -> None:
    """CLI (``draftpipe-spec-decode``): :func:`compare` on prompt records (``--prompts``, encoded with the
    verifier's tokenizer) or on token ids (``--prompt-ids``, a JSON list of lists, as the compatibility report's live
    check sends them); writes the result to ``--out`` as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verifier", required=True)
    parser.add_argument("--draft", required=True)
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompts", help="prompt records (JSONL, as in results/prompts/eval.jsonl)")
    given.add_argument("--prompt-ids", help="prompts as token ids (a JSON list of lists of ints)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    if args.prompt_ids:
        prompts = json.loads(Path(args.prompt_ids).read_text())
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.verifier)
        prompts = [encode_prompt(tok, r["messages"]) for r in read_jsonl(args.prompts)]
    result = compare(
        args.verifier,
        args.draft,
        prompts,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    write_json(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

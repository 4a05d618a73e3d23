"""The benchmarks' prompts: the eval split and ``bench.prompt_sets``, rendered and encoded as every stage that
prompts the verifier does, shared by the offline benchmark (``bench_run``) and the served one (``bench_serve``) so
both send the same token ids."""

from __future__ import annotations

from draftpipe.core.io import read_jsonl
from draftpipe.formats.chat import planned_template, verifier_tokenizer
from draftpipe.formats.prompts import load_prompts
from draftpipe.inference.prompting import encode_and_fit


def benchmark_prompt_sets(
    tokenizer,
    eval_path: str,
    prompt_sets: list[dict],
    rendering: dict,
    *,
    max_model_len: int,
    max_tokens: int,
    max_prompts: int,
    too_long: str,
    stage: str = "the benchmark",
) -> dict[str, list[dict]]:
    """``{name: [{"id": str, "prompt_token_ids": [int]}]}``: the eval split (``eval_path``, named ``eval``) and each
    configured set (``bench.prompt_sets``), each prompt rendered with ``rendering`` (chat template, kwargs, system
    prompt), fitted to ``max_model_len`` with room for ``max_tokens`` under the length policy ``too_long``
    (``completions.too_long``), and the first ``max_prompts`` of each set kept. Sets left empty are dropped.

    Raises:
        draftpipe.inference.prompting errors for a prompt that cannot fit under ``too_long: error`` (naming it),
        and prompt-source errors of :func:`draftpipe.formats.prompts.load_prompts` (naming file and line).
    """

    def encode(records, name):
        fitted, counts = encode_and_fit(
            tokenizer,
            records,
            template_kwargs=rendering["template_kwargs"],
            max_model_len=max_model_len,
            room=max_tokens,
            too_long=too_long,
            stage=stage,
        )
        print(f"prompt set {name}: {counts}")
        return [{"id": r["id"], "prompt_token_ids": ids} for r, ids in fitted][:max_prompts]

    sets = {"eval": encode(read_jsonl(eval_path), "eval")}
    for src in prompt_sets:
        records, _ = load_prompts([src], rendering["system_prompt"])
        sets[src["name"]] = encode(records, src["name"])
    for name, prompts in sets.items():
        print(f"prompt set {name}: {len(prompts)} prompts")
    return {k: v for k, v in sets.items() if v}


def job_prompt_sets(params, eval_path: str, chat_template_file: str | None, *, max_prompts: int, stage: str):
    """The tokenizer and prompt sets of a benchmark job (``bench_run``, ``bench_serve``) from its Snakemake
    ``params`` (``verifier``, ``rendering``, ``max_model_len``, ``too_long``, and ``settings`` with ``prompt_sets``
    and ``max_tokens``): the verifier's tokenizer with the planned chat template
    (:func:`draftpipe.formats.chat.planned_template`; ``chat_template_file`` = ``verifier.chat_template_file``),
    then :func:`benchmark_prompt_sets`, each prompt keeping room for ``max_tokens``.

    Returns:
        ``(tokenizer, {name: [{"id", "prompt_token_ids"}]})``.
    """
    tok = verifier_tokenizer(
        params.verifier, planned_template(chat_template_file, params.rendering["chat_template_sha256"])
    )
    s = params.settings
    sets = benchmark_prompt_sets(
        tok,
        eval_path,
        s["prompt_sets"],
        params.rendering,
        max_model_len=params.max_model_len,
        max_tokens=s["max_tokens"],
        max_prompts=max_prompts,
        too_long=params.too_long,  # completions.too_long, as for the completions
        stage=stage,
    )
    return tok, sets

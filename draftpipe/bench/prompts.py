"""The benchmarks' prompts: the eval split and ``bench.prompt_sets``, rendered and encoded as every stage that
prompts the verifier does, shared by the offline benchmark (``bench_run``) and the served one (``bench_serve``) so
both send the same token ids.

A conversation whose later questions follow unanswered assistant turns (MT-bench,
:func:`draftpipe.formats.prompts.is_unanswered`) is measured turn by turn, as EAGLE's MT-bench evaluation does: its
first question in its set, its second in the set ``<name> turn 2`` (and so on), asked after the verifier's own
greedy answer to the question before (:func:`later_turn_sets`)."""

from __future__ import annotations

import gc
from collections.abc import Callable

from draftpipe.core.io import read_jsonl
from draftpipe.formats.chat import planned_template, verifier_tokenizer
from draftpipe.formats.prompts import answered_prefix, is_unanswered, load_prompts
from draftpipe.inference.engine import engine_kwargs, speculative_dtype
from draftpipe.inference.prompting import encode_and_fit
from draftpipe.stages.completions.conversations import answer_message

#: ``answer(prompts, max_tokens) -> texts``: the verifier's greedy answer to each prompt (token ids)
Answerer = Callable[[list[list[int]], int], list[str]]


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
    answer: Answerer | None = None,
    answer_tokens: int = 0,
) -> dict[str, list[dict]]:
    """``{name: [{"id": str, "prompt_token_ids": [int]}]}``: the eval split (``eval_path``, named ``eval``) and each
    configured set (``bench.prompt_sets``), each prompt rendered with ``rendering`` (chat template, kwargs, system
    prompt), fitted to ``max_model_len`` with room for ``max_tokens`` under the length policy ``too_long``
    (``completions.too_long``), and the first ``max_prompts`` of each set kept. With ``answer`` and a chat template,
    the later turns of those prompts' conversations follow as sets of their own (:func:`later_turn_sets`, answers
    of at most ``answer_tokens``; a verifier without a template is sent first turns only, as its completions are).
    Sets left empty are dropped.

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
        return fitted[:max_prompts]

    firsts = {"eval": encode(read_jsonl(eval_path), "eval")}
    for src in prompt_sets:
        records, _ = load_prompts([src], rendering["system_prompt"])
        firsts[src["name"]] = encode(records, src["name"])
    sets = {}
    for name, fitted in firsts.items():
        sets[name] = [{"id": r["id"], "prompt_token_ids": ids} for r, ids in fitted]
        if answer is not None and getattr(tokenizer, "chat_template", None):  # a base model has no turns
            sets |= later_turn_sets(name, fitted, answer, answer_tokens, encode, tokenizer)
    for name, prompts in sets.items():
        print(f"prompt set {name}: {len(prompts)} prompts")
    return {k: v for k, v in sets.items() if v}


def job_prompt_sets(
    params, eval_path: str, chat_template_file: str | None, *, max_prompts: int, stage: str, engine: dict | None = None
):
    """The tokenizer and prompt sets of a benchmark job (``bench_run``, ``bench_serve``) from its Snakemake
    ``params`` (``verifier``, ``rendering``, ``max_model_len``, ``dtype``, ``too_long``, ``answer_tokens``, and
    ``settings`` with ``prompt_sets`` and ``max_tokens``): the verifier's tokenizer with the planned chat template
    (:func:`draftpipe.formats.chat.planned_template`; ``chat_template_file`` = ``verifier.chat_template_file``),
    then :func:`benchmark_prompt_sets`, each prompt keeping room for ``max_tokens``; the verifier answers earlier
    turns (:class:`GreedyAnswerer`, ``engine`` as the benchmark's engines take it) only when a conversation has a
    later turn.

    Returns:
        ``(tokenizer, {name: [{"id", "prompt_token_ids"}]})``.
    """
    tok = verifier_tokenizer(
        params.verifier, planned_template(chat_template_file, params.rendering["chat_template_sha256"])
    )
    s = params.settings
    answerer = GreedyAnswerer(params.verifier, dtype=params.dtype, max_model_len=params.max_model_len, engine=engine)
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
        answer=answerer,
        answer_tokens=params.answer_tokens,
    )
    answerer.close()
    return tok, sets


class GreedyAnswerer:
    """:data:`Answerer` of the verifier alone in vLLM's offline engine, temperature 0, started on its first call
    (a benchmark without later turns starts none) and shut by :meth:`close`; ``dtype`` as the benchmark's engines
    take it (:func:`draftpipe.inference.engine.speculative_dtype`)."""

    def __init__(self, verifier: str, *, dtype: str, max_model_len: int, engine: dict | None = None) -> None:
        self.verifier, self.dtype, self.max_model_len, self.engine = verifier, dtype, max_model_len, engine
        self.llm = None

    def __call__(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from vllm import LLM, SamplingParams

        if self.llm is None:
            print(f"answering earlier turns of {len(prompts)} conversation(s) with the verifier alone", flush=True)
            dtype = speculative_dtype(self.dtype)
            self.llm = LLM(
                **engine_kwargs(self.verifier, dtype=dtype, max_model_len=self.max_model_len, seed=0, extra=self.engine)
            )
        params = [
            SamplingParams(temperature=0.0, max_tokens=max(1, min(max_tokens, self.max_model_len - len(p))))
            for p in prompts
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def close(self) -> None:
        """Shut the engine (if it was started) and free its memory."""
        self.llm = None
        gc.collect()


def later_turn_sets(
    name: str,
    fitted: list[tuple[dict, list[int]]],
    answer: Answerer,
    answer_tokens: int,
    encode: Callable[[list[dict], str], list[tuple[dict, list[int]]]],
    tokenizer,
) -> dict[str, list[dict]]:
    """The later turns of the conversations of a benchmark set, each a set of its own: ``{"<name> turn 2": [{"id",
    "prompt_token_ids"}], ...}``, turn ``k`` rendered after the verifier's greedy answers to turns ``1 .. k-1``.

    Args:
        name: the set's name.
        fitted: ``(record, prompt ids)`` of the set's first turns as sent (records with unanswered assistant turns,
            :func:`draftpipe.formats.prompts.is_unanswered`, go on; the others have no later turn).
        answer: the verifier's greedy answers (:data:`Answerer`), ``answer_tokens`` new tokens at most each.
        encode: renders and fits records (their ``messages`` up to the next unanswered turn) under the set's name,
            as the first turns were; a conversation whose next prompt does not fit ends there (or raises, as
            ``completions.too_long`` says).
        tokenizer: decodes a prompt, to see whether the template opened a thinking span
            (:func:`draftpipe.stages.completions.conversations.answer_message`).

    Returns:
        The sets in turn order; none when no conversation has a later turn.
    """
    sets: dict[str, list[dict]] = {}
    going = [(rec, ids) for rec, ids in fitted if any(map(is_unanswered, rec["messages"]))]
    turn = 1
    while going:
        texts = answer([ids for _, ids in going], answer_tokens)
        nxt = []
        for (rec, ids), text in zip(going, texts):
            msgs = rec["messages"]
            cut = len(answered_prefix(msgs))
            reply, _ = answer_message(text, tokenizer.decode(ids), "strip")
            nxt.append({**rec, "messages": [*msgs[:cut], reply, *msgs[cut + 1 :]]})
        turn += 1
        label = f"{name} turn {turn}"
        sent = encode(nxt, label)
        sets[label] = [{"id": r["id"], "prompt_token_ids": ids} for r, ids in sent]
        going = [(r, ids) for r, ids in sent if any(map(is_unanswered, r["messages"]))]
    return sets

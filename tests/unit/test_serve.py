"""The served benchmark without vLLM: its settings, the server's command line, the lifecycle of a server process
(real processes: a tiny HTTP server, one that dies, one that never answers, one with children), and the figures
and report of a sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from draftpipe.bench.serve import (
    ServeError,
    Terminated,
    VLLMServer,
    break_even,
    free_port,
    offline_gaps,
    port_listening,
    run_figures,
    serve_settings,
    server_command,
    session_processes,
)
from draftpipe.bench.serve_report import plot_serve, render_serve_section, serve_warnings

# a stand-in for the API server: answers GET /health with 200 after `delay` s, and starts a child in its session
# (as vLLM's engine core is) that ignores SIGTERM
SERVER = textwrap.dedent(
    """
    import http.server, signal, subprocess, sys, time
    port, delay = int(sys.argv[1]), float(sys.argv[2])
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    time.sleep(delay)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
    print("listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def fake_server(tmp_path, port: int, delay: float = 0.0) -> list[str]:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    return [sys.executable, str(script), str(port), str(delay)]


def test_settings_resolve_k_and_prompts_from_the_offline_benchmark():
    bench = {"num_speculative_tokens": [1, 3], "max_prompts": 16, "max_tokens": 64, "prompt_sets": [], "serve": None}
    assert serve_settings(bench) is None
    bench["serve"] = {
        "concurrency": [1, 4],
        "num_speculative_tokens": None,
        "num_prompts": None,
        "acceptance_tolerance": 0.1,
        "startup_timeout": 600,
    }
    assert serve_settings(bench) == {
        "concurrency": [1, 4],
        "num_speculative_tokens": 3,
        "num_prompts": 16,
        "max_tokens": 64,
        "prompt_sets": [],
    }
    bench["serve"].update(num_speculative_tokens=2, num_prompts=4, acceptance_tolerance=0.5, startup_timeout=9)
    s = serve_settings(bench)
    assert (s["num_speculative_tokens"], s["num_prompts"]) == (2, 4) and "startup_timeout" not in s


def test_server_command_carries_the_offline_engine_arguments(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = server_command(
        "/m/verifier", port=8123, dtype="float32", max_model_len=512, draft="/m/draft", num_speculative_tokens=3
    )
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    args = cmd[3:]
    assert args[args.index("--port") + 1] == "8123" and args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--model") + 1] == "/m/verifier" and args[args.index("--max-model-len") + 1] == "512"
    assert args[args.index("--seed") + 1] == "0" and args[args.index("--dtype") + 1] == "float32"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/m/draft", "num_speculative_tokens": 3}
    assert "--disable-log-stats" not in args  # the spec-decode counters need the stats
    alone = server_command(
        "/m/verifier", port=1, dtype="float32", max_model_len=512, engine={"tensor_parallel_size": 2}
    )
    assert "--speculative-config" not in alone and alone[alone.index("--tensor-parallel-size") + 1] == "2"


def test_a_server_is_ready_on_health_and_leaves_no_process_or_port(tmp_path):
    port = free_port()
    assert not port_listening(port)
    with VLLMServer(fake_server(tmp_path, port, delay=0.5), port, tmp_path / "s.log", "test", stop_timeout=1) as s:
        sid = s.process.pid
        assert port_listening(port) and len(session_processes(sid)) == 2  # the server and its child
    assert session_processes(sid) == [] and not port_listening(port)  # the child ignored SIGTERM: killed
    assert "listening" in (tmp_path / "s.log").read_text()


def test_an_exception_in_the_block_stops_the_server(tmp_path):
    port = free_port()
    with pytest.raises(RuntimeError, match="benchmark failed"):
        with VLLMServer(fake_server(tmp_path, port), port, tmp_path / "s.log", "test", stop_timeout=1) as s:
            sid = s.process.pid
            raise RuntimeError("benchmark failed")
    assert session_processes(sid) == [] and not port_listening(port)


def test_a_server_that_dies_or_never_answers_is_an_error_naming_its_log(tmp_path):
    port = free_port()
    dying = [sys.executable, "-c", "import sys; print('no such model: /m/verifier'); sys.exit(3)"]
    with pytest.raises(ServeError, match=r"(?s)exited with status 3 before answering /health.*no such model"):
        with VLLMServer(dying, port, tmp_path / "d.log", "test"):
            pass
    with pytest.raises(ServeError, match=r"did not answer .*/health within 1 s \(bench.serve.startup_timeout\)"):
        with VLLMServer(
            fake_server(tmp_path, port, delay=30), port, tmp_path / "n.log", "test", startup_timeout=1, stop_timeout=1
        ):
            pass
    time.sleep(0.2)
    assert not port_listening(port)
    assert not any(str(tmp_path / "server.py") in open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in _pids())


def _pids():
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                open(f"/proc/{p}/cmdline").read()
                out.append(p)
            except OSError:
                pass
    return out


def test_sigterm_of_the_job_stops_the_server(tmp_path):
    """A job process (here a child Python) that gets SIGTERM while its server runs exits 143 and leaves nothing."""
    port = free_port()
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {str(os.getcwd())!r})
            from draftpipe.bench.serve import VLLMServer
            with VLLMServer({fake_server(tmp_path, port)!r}, {port}, {str(tmp_path / "s.log")!r}, "test", stop_timeout=1):
                print("ready", flush=True)
                time.sleep(600)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(job)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    while line and not line.startswith("ready"):
        line = proc.stdout.readline()
    sid = _server_pid(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert session_processes(sid) == [] and not port_listening(port)


def _server_pid(parent: int) -> int:
    for p in _pids():
        try:
            stat = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == parent:
            return int(p)
    raise AssertionError("no server process")


def test_terminated_exits_like_the_signal():
    assert Terminated().code == 143


def result(tps, tpot, al=None, drafts=100):
    r = {
        "output_throughput": tps,
        "duration": 2.0,
        "completed": 8,
        "total_output_tokens": 512,
        "median_tpot_ms": tpot,
        "p99_tpot_ms": tpot * 1.5,
        "median_itl_ms": tpot * 2,
        "p99_itl_ms": tpot * 3,
        "median_ttft_ms": 20.0,
        "p99_ttft_ms": 30.0,
    }
    if al is not None:
        r.update(
            spec_decode_acceptance_length=al,
            spec_decode_num_drafts=drafts,
            spec_decode_draft_tokens=3 * drafts,
            spec_decode_accepted_tokens=int((al - 1) * drafts),
            spec_decode_per_position_acceptance_rates=[0.6, 0.4, 0.2],
        )
    return r


def sweep(speedups: dict[int, float]) -> dict:
    rows = []
    for c, sp in speedups.items():
        base = run_figures(result(100.0 * c, 10.0), 0)
        draft = run_figures(result(100.0 * c * sp, 10.0 / sp, al=2.2), 3)
        rows.append(
            {
                "prompt_set": "eval",
                "concurrency": c,
                "num_speculative_tokens": 3,
                "num_prompts": 8,
                "baseline": base,
                "draft": draft,
                "speedup": draft["output_tokens_per_s"] / base["output_tokens_per_s"],
                "tpot_ratio": sp,
                "identical_texts": 8,
            }
        )
    return {"settings": {"num_speculative_tokens": 3, "max_tokens": 64, "concurrency": list(speedups)}, "results": rows}


def test_figures_of_a_run_and_where_the_draft_stops_paying():
    f = run_figures(result(300.0, 4.0, al=2.2), 3)
    assert f["output_tokens_per_s"] == 300.0 and f["tpot_median_ms"] == 4.0 and f["itl_p99_ms"] == 12.0
    assert f["acceptance_length"] == 2.2 and f["per_position_acceptance"] == [0.6, 0.4, 0.2]
    assert (f["num_drafts"], f["num_draft_tokens"], f["num_accepted_tokens"]) == (100, 300, 120)
    assert "acceptance_length" not in run_figures(result(300.0, 4.0), 0)
    with pytest.raises(ServeError, match="reported no drafts"):
        run_figures(result(300.0, 4.0, al=1.0, drafts=0), 3)
    assert break_even(sweep({1: 1.5, 4: 1.1, 16: 0.9, 64: 0.7})) == 16
    assert break_even(sweep({1: 1.5, 4: 1.1})) is None


def test_served_against_offline_acceptance_and_the_report(tmp_path):
    serve = sweep({1: 1.4, 4: 0.8})
    offline = {
        "results": [
            {"prompt_set": "eval", "num_speculative_tokens": 3, "temperature": 0.0, "acceptance_length": 2.18},
            {"prompt_set": "eval", "num_speculative_tokens": 1, "temperature": 0.0, "acceptance_length": 1.5},
            {"prompt_set": "eval", "num_speculative_tokens": 3, "temperature": 1.0, "acceptance_length": 1.2},
        ]
    }
    gaps = offline_gaps(serve, offline, 0.1)
    assert [(g["concurrency"], g["offline"], g["within"]) for g in gaps] == [(1, 2.18, True), (4, 2.18, True)]
    assert gaps[0]["gap"] == pytest.approx(0.02)
    tight = offline_gaps(serve, offline, 0.01)
    assert not any(g["within"] for g in tight)
    warnings = serve_warnings(tight, 0.01)
    assert (
        len(warnings) == 2
        and "differs from the offline 2.180 (k=3, temperature 0, same prompts) by +0.020" in warnings[0]
    )
    md = render_serve_section(serve, tight, tolerance=0.01, plot="serve_sweep.png")
    assert "| eval | 1 | 8 | 140.000 / 100.000 | 1.400 |" in md
    assert "eval: the draft stops paying at concurrency 4 (speedup below 1)" in md
    assert md.count("WARNING") == 4 and "![served sweep](serve_sweep.png)" in md
    assert offline_gaps(serve, {"results": []}, 0.1) == []
    assert "No offline measurement" in render_serve_section(serve, [], tolerance=0.1, plot=None)
    plot_serve(serve, str(tmp_path / "s.png"), dpi=50, title="t")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"

"""Progress lines for a person (rate, ETA) and the one-line summaries each job prints on the console."""

from __future__ import annotations

from draftpipe.core.progress import Progress, clock_text, progress_line, vllm_progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_line_rate_and_eta():
    assert clock_text(3725.9) == "1:02:05" and clock_text(None) == "?"
    assert progress_line("completions shard 00000", 30, 120, 10.0, "requests", "output 41 toks/s") == (
        "completions shard 00000: 30/120 requests (25%), 3.00 requests/s, elapsed 0:00:10, ETA 0:00:30, output 41 toks/s"
    )
    assert progress_line("x", 0, 10, 0.0, "steps") == "x: 0/10 steps (0%), 0.00 steps/s, elapsed 0:00:00, ETA ?"
    assert progress_line("x", 5, None, 2.0, "steps") == "x: 5 steps, 2.50 steps/s, elapsed 0:00:02, ETA ?"
    assert progress_line("x", 10, 10, 4.0, "steps").endswith("(100%), 2.50 steps/s, elapsed 0:00:04, ETA 0:00:00")


def test_progress_prints_at_most_every_interval_and_at_the_end():
    clock, lines = Clock(), []
    bar = Progress("draft epoch 1/2", 6, "steps", every=10.0, clock=clock, out=lines.append)
    for dt in (1, 2, 3, 9, 1, 1):  # steps end at t+1, +3, +6, +15, +16, +17
        clock.t += dt
        bar.update(1, extra=f"loss {clock.t - 100:.1f}")
    assert lines == [
        "draft epoch 1/2: 1/6 steps (17%), 1.00 steps/s, elapsed 0:00:01, ETA 0:00:05, loss 1.0",
        "draft epoch 1/2: 4/6 steps (67%), 0.27 steps/s, elapsed 0:00:15, ETA 0:00:07, loss 15.0",
        "draft epoch 1/2: 6/6 steps (100%), 0.35 steps/s, elapsed 0:00:17, ETA 0:00:00, loss 17.0",
    ]


def test_vllm_drives_the_progress_as_it_drives_tqdm(capsys, monkeypatch):
    """The calls of vLLM's `_run_engine` (vllm/entrypoints/common/offline.py) on a `use_tqdm` callable."""
    import draftpipe.core.progress as progress

    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    make = vllm_progress("completions shard 00001", scale=2, every=60.0)
    prompts = [{"prompt_token_ids": [1]}] * 3
    assert make(prompts, total=3, desc="Adding requests") is prompts  # vllm/utils/tqdm_utils.py maybe_tqdm
    pbar = make(  # 3 requests of n=2: the engine counts 6 unfinished
        total=6,
        desc="Processed prompts",
        dynamic_ncols=True,
        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
    )
    for _ in range(3):
        clock.t += 2.0
        pbar.postfix = f"est. speed input: {100 / pbar.format_dict['elapsed']:.2f} toks/s, output: 8.00 toks/s"
        pbar.update(2)  # a finished request with n=2 completions
        if pbar.n == 6:
            pbar.refresh()
    pbar.close()
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "completions shard 00001: 2/6 completions (33%), 1.00 completions/s, elapsed 0:00:02, ETA 0:00:04, "
        "input: 50.00 toks/s, output: 8.00 toks/s",
        "completions shard 00001: 6/6 completions (100%), 1.00 completions/s, elapsed 0:00:06, ETA 0:00:00, "
        "input: 16.67 toks/s, output: 8.00 toks/s",
    ]


def test_console_writes_to_the_terminal_kept_before_the_redirect(tmp_path, monkeypatch, capsys):
    import os

    import draftpipe.core.progress as progress

    term = tmp_path / "terminal"
    fd = os.open(term, os.O_WRONLY | os.O_CREAT)
    monkeypatch.setattr(progress, "CONSOLE_FD", fd)
    progress.console("draft: 8 epoch(s), train loss 0.0100")
    os.close(fd)
    assert term.read_text() == "draft: 8 epoch(s), train loss 0.0100\n"
    assert capsys.readouterr().out == "draft: 8 epoch(s), train loss 0.0100\n"  # and the log


def test_the_summary_lines_of_the_jobs(tmp_path):
    from draftpipe.bench.benchmark import summary_line
    from draftpipe.stages.completions.generate import summary
    from draftpipe.stages.draft.metrics import training_summary

    rows = [
        {"completion_token_ids": [1, 2, 3], "finish_reason": "stop"},
        {"completion_token_ids": [1] * 5, "finish_reason": "length"},
    ]
    stats = {"prompts": 3, "kept": 2, "dropped_too_long": 1, "truncated_too_long": 0}
    assert summary(rows, stats) == (
        "3 prompts -> 2 samples, 8 tokens generated, 1 dropped as too long, 1 cut by completions.max_tokens"
    )
    chat = [{"turns": [{"completion_token_ids": [1, 2]}, {"completion_token_ids": [3]}], "finish_reason": "stop"}]
    assert summary(chat, {"prompts": 1}) == "1 prompts -> 1 samples, 3 tokens generated"
    csv = tmp_path / "metrics.csv"
    csv.write_text("epoch,train_loss,val_loss,train_steps\n0,0.5,0.6,14\n1,0.25,0.375,13\n")
    last = "the last (draft.select: last)"
    assert (
        training_summary(csv)
        == f"2 epoch(s), train loss 0.2500, val loss 0.3750, exported epoch 2 of 2, {last}, 27 steps"
    )
    csv.write_text("epoch,train_loss,train_steps,loss_impl\n0,0.5,14,fused\n")
    assert (
        training_summary(csv) == f"1 epoch(s), train loss 0.5000, exported epoch 1 of 1, {last}, 14 steps, fused loss"
    )
    csv.write_text("epoch,train_loss,train_steps,loss_impl\n0,0.5,14,fused\n1,0.4,14,eager-fallback\n")
    assert training_summary(csv) == (
        f"2 epoch(s), train loss 0.4000, exported epoch 2 of 2, {last}, 28 steps, eager loss: the fused Triton kernels "
        "failed their check (see the log)"
    )
    # draft.select: best_val exported the first epoch: its losses, and the last epoch's validation loss beside them
    csv.write_text("epoch,train_loss,val_loss,train_steps,exported\n0,0.5,0.3,14,best_val\n1,0.25,0.375,13,\n")
    assert training_summary(csv) == (
        "2 epoch(s), train loss 0.5000, val loss 0.3000, exported epoch 1 of 2: the lowest validation loss "
        "(draft.select: best_val); the last epoch's is 0.3750, 27 steps"
    )
    csv.write_text("\n")
    assert training_summary(csv) == "no epoch trained"
    result = {"prompt_set": "eval", "temperature": 0.0, "acceptance_length": 1.575, "speedup": 1.2, "identical": True}
    bench = {
        "results": [{**result, "num_speculative_tokens": 1}, {**result, "num_speculative_tokens": 3, "speedup": None}]
    }
    assert summary_line(bench) == (
        "temperature 0.0: eval k=1: acceptance length 1.57, speedup 1.20x; eval k=3: acceptance length 1.57, "
        "speedup n/ax"
    )
    bench["results"][1]["identical"] = False
    assert summary_line(bench).endswith("; 1 setting(s) NOT token-identical at temperature 0")


def test_the_compatibility_verdict_line():
    from draftpipe.checks.compat.report import Report, verdict_line

    rep = Report(draft="d", verifier="v")
    rep.add("live.unsupported", "warning", "vLLM", "m")
    rep.live = {"identical": True, "acceptance_length": 1.5749}
    assert (
        verdict_line(rep) == "ok, 0 error(s), 1 warning(s); live check in vLLM: token-identical, acceptance length 1.57"
    )
    rep.add("aux.ids", "error", "eagle_aux_hidden_state_layer_ids", "m")
    rep.live = {"skipped": "why"}
    assert verdict_line(rep) == "FAILED, 1 error(s), 1 warning(s) (first: aux.ids); live check skipped"


def test_the_report_title_names_the_configured_verifier():
    from draftpipe.workflow.identity import report_title

    cfg = {"bench": {"report": {"title": None}}}
    assert report_title(cfg, {"kind": "gguf", "path": "draftpipe/data/models/stories260K.gguf"}) == (
        "EAGLE-3 draft for stories260K in vLLM"
    )
    assert report_title(cfg, {"kind": "local", "path": "/models/Qwen3-8B"}) == "EAGLE-3 draft for Qwen3-8B in vLLM"
    assert report_title(cfg, {"kind": "hub", "id": "moonshotai/Kimi-K2.5"}) == (
        "EAGLE-3 draft for moonshotai/Kimi-K2.5 in vLLM"
    )
    dflash = {**cfg, "draft": {"method": "dflash"}}
    assert report_title(dflash, {"kind": "local", "path": "/models/Qwen3-8B"}) == "DFlash draft for Qwen3-8B in vLLM"
    cfg["bench"]["report"]["title"] = "Mine"
    assert report_title(cfg, {"kind": "hub", "id": "x/y"}) == "Mine"

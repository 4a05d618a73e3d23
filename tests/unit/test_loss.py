"""The draft's training loss (draftpipe.stages.draft.loss): the implementation by device, the agreement check that
guards the fused kernels, and the wrapper that keeps a loss out of the compiled draft forward. speculators' Triton
kernels run here through Triton's interpreter (``TRITON_INTERPRET=1``, numpy on the CPU: the kernels' own code, not
their GPU compilation); ``benchmarks/gpu_train.py`` checks them compiled on a GPU against the eager loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from speculators.losses import eager as speculators_eager
from speculators.losses import resolve_loss_config

from draftpipe.stages.draft.loss import (
    EAGER,
    FALLBACK,
    FUSED,
    TrainingLoss,
    check_agreement,
    outside_compile,
    training_loss,
)


def test_a_cpu_trains_with_speculators_eager_loss():
    loss = training_loss('{"kl_div": 0.9, "tv": 0.1}', on_gpu=False, vocab_size=32)
    assert loss.implementation == EAGER
    assert loss.config == resolve_loss_config('{"kl_div": 0.9, "tv": 0.1}', "eager")
    assert loss.log_line() == "draft loss: kl_div x0.9, tv x0.1, eager (no accelerator: Triton kernels need a GPU)"
    with pytest.raises(ValueError, match="Unknown loss function 'kl'"):
        training_loss("kl", on_gpu=False, vocab_size=32)


def test_the_agreement_check_passes_the_same_loss_and_names_a_different_one():
    eager = resolve_loss_config("kl_div", "eager")
    assert check_agreement(eager, eager, vocab_size=100, device="cpu") is None
    # the loss values of a wrong kernel: reverse KL where KL was asked for
    wrong = {"kl_div": (speculators_eager.reverse_kl_div_loss, 1.0)}
    assert check_agreement(wrong, eager, vocab_size=100, device="cpu").startswith("kl_div: losses differ by up to ")
    # equal losses, wrong gradients: the right values with half the gradient
    half = {"kl_div": (lambda x, t: speculators_eager.kl_div_loss(0.5 * x + 0.5 * x.detach(), t), 1.0)}
    assert check_agreement(half, eager, vocab_size=100, device="cpu").startswith("kl_div: gradients differ by up to ")


def test_a_kernel_that_raises_is_reported_not_raised():
    def broken(logits, targets):
        raise RuntimeError("Fused losses require Triton; use --loss-implementation eager\nsecond line")

    eager = resolve_loss_config("kl_div", "eager")
    assert check_agreement({"kl_div": (broken, 1.0)}, eager, vocab_size=16, device="cpu") == (
        "kl_div: RuntimeError: Fused losses require Triton; use --loss-implementation eager"
    )
    with pytest.raises(ValueError, match="the loss configs differ"):
        check_agreement(resolve_loss_config("tv", "eager"), eager, vocab_size=16, device="cpu")
    fallback = TrainingLoss(eager, FALLBACK, "kl_div: RuntimeError: no Triton")
    assert fallback.log_line().startswith("WARNING draft loss: kl_div x1, eager: the fused Triton kernels failed")
    assert TrainingLoss(eager, FUSED).log_line().endswith("fused Triton kernels (run outside the compiled forward)")


def test_a_loss_outside_compile_is_not_traced_and_gives_the_same_values_and_gradients():
    """The wrapper makes Dynamo end the graph at the loss call (the break reason names torch.compiler.disable) and
    run the loss as it is: losses and gradients equal the uncompiled ones."""
    config = resolve_loss_config("kl_div", "eager")
    wrapped = outside_compile(config)
    gen = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(1, 12, 40, generator=gen), torch.randn(1, 12, 40, generator=gen)

    def step(cfg, x):
        fn, weight = cfg["kl_div"]
        hidden = torch.tanh(x) * 2.0  # compiled work before and after the loss
        return (weight * fn(hidden, targets)).mean() + 0.1 * hidden.square().mean()

    torch._dynamo.reset()
    traced = torch._dynamo.explain(lambda x: step(config, x))(logits)
    torch._dynamo.reset()
    kept_out = torch._dynamo.explain(lambda x: step(wrapped, x))(logits)
    assert traced.graph_break_count == 0
    assert kept_out.graph_break_count == 1
    assert "torch.compiler.disable" in str(kept_out.break_reasons[0].reason)

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: step(wrapped, x), backend="aot_eager")
    grads = []
    for fn in (lambda x: step(config, x), compiled):
        x = logits.clone().requires_grad_(True)
        value = fn(x)
        value.backward()
        grads.append((value.detach(), x.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])
    assert float(grads[0][0]) > 0.1  # a real loss, not zero


def test_the_gpu_benchmark_counts_the_flops_of_an_8b_draft_step():
    """benchmarks/gpu_train.py's count for Llama-3.1-8B (hidden 4096, 32 heads of 128, 8 KV heads, MLP 14336; draft
    vocab 32000, 3 aux layers, 3 TTT steps): the decoder layer reads 2 x 4096 and holds 243.3M weights."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_train.py"
    spec = importlib.util.spec_from_file_location("gpu_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg, head_dim = bench.preset_config("llama-3.1-8b-instruct")
    assert (cfg["hidden_size"], cfg["num_key_value_heads"], head_dim) == (4096, 8, None)
    flops = bench.flops_per_token(cfg, head_dim, 32000, 3, 3)
    layer = 8192 * 4096 + 2 * 8192 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
    assert layer == 243_269_632
    assert flops["decoder"] == 6 * 3 * layer
    assert flops["fc"] == 4 * 3 * 4096 * 4096
    assert flops["draft_lm_head"] == 4 * 3 * 4096 * 32000
    assert flops["verifier_head"] == 2 * 4096 * 32000
    assert flops["total"] == 6_415_187_968  # 6.4 GFLOP per token
    kimi, kimi_head_dim = bench.preset_config("kimi-k2.5")  # the text model of the multimodal config, head_dim 128
    assert (kimi["hidden_size"], kimi["vocab_size"], kimi_head_dim) == (7168, 163840, 128)
    assert bench.peak_tflops("NVIDIA H200 NVL", None) == 835.5
    assert bench.peak_tflops("NVIDIA H200", None) == 989.4
    assert bench.peak_tflops("NVIDIA H200", 790.0) == 790.0
    assert bench.peak_tflops("Some GPU", None) is None
    assert json.loads(json.dumps(flops)) == flops


def test_the_check_in_bfloat16_allows_its_rounding_and_no_more():
    """On a GPU the check runs in bfloat16, the dtype of the draft's logits: the same loss computed through another
    float32 path (a different summation) passes; a gradient 2% off does not."""
    eager = resolve_loss_config("kl_div", "eager")

    def reordered(logits, targets):  # KL(t || softmax(x)) by its own formula, float32
        logp = logits.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        t = torch.softmax(targets.float(), dim=-1)
        return (t * (torch.log(t.clamp_min(1e-30)) - logp)).sum(-1)

    def scaled(logits, targets):  # the right loss values, 2% more gradient
        x = 1.02 * logits.float() - 0.02 * logits.float().detach()
        return speculators_eager.kl_div_loss(x, targets)

    kw = {"vocab_size": 512, "device": "cpu", "rows": 32, "dtype": torch.bfloat16}
    assert check_agreement({"kl_div": (reordered, 1.0)}, eager, **kw) is None
    assert check_agreement({"kl_div": (scaled, 1.0)}, eager, **kw).startswith("kl_div: gradients differ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU speculators' Triton kernels run")
def test_fused_kernels_that_cannot_run_fall_back_to_the_eager_loss():
    """Asked for the GPU path on a machine where Triton has no driver, speculators' real fused kernels fail inside
    the check: the draft would train with the eager loss, and the reason is kept for the log."""
    loss = training_loss("kl_div", on_gpu=True, vocab_size=64, device="cpu")
    assert loss.implementation == FALLBACK
    assert loss.config == resolve_loss_config("kl_div", "eager")
    assert loss.reason.startswith("kl_div: RuntimeError: ")
    assert loss.log_line() == (
        f"WARNING draft loss: kl_div x1, eager: the fused Triton kernels failed their check ({loss.reason})"
    )
    # asked for by name (resources.draft.loss_implementation: fused), a failed check stops the job instead
    with pytest.raises(RuntimeError, match=r"^resources.draft.loss_implementation: fused: .*\(kl_div: RuntimeError: "):
        training_loss("kl_div", on_gpu=True, vocab_size=64, device="cpu", prefer=FUSED)


def test_the_loss_implementation_asked_for():
    eager = training_loss("kl_div", on_gpu=True, vocab_size=64, prefer=EAGER)
    assert (eager.implementation, eager.config) == (EAGER, resolve_loss_config("kl_div", "eager"))
    assert eager.log_line() == "draft loss: kl_div x1, eager (asked for: resources.draft.loss_implementation: eager)"
    with pytest.raises(ValueError, match="^resources.draft.loss_implementation must be auto, fused or eager, not 'x'$"):
        training_loss("kl_div", on_gpu=True, vocab_size=64, prefer="x")


#: run in a child process: TRITON_INTERPRET is read when ``triton.jit`` decorates a kernel, which speculators does on
#: its first fused call (perhaps already made in this process). The autotuners time their tiles by a CPU clock there.
INTERPRETED = """
import json, torch
from speculators.losses import resolve_loss_config
from draftpipe.stages.draft.loss import check_agreement, outside_compile, time_tiles_on_the_cpu, training_loss
from draftpipe.workflow.config import LOSS_FUNCTIONS

out = {"clock": time_tiles_on_the_cpu(), "checks": {}}
for name in LOSS_FUNCTIONS:
    candidate = outside_compile(resolve_loss_config(name, "fused"))
    out["checks"][name] = check_agreement(candidate, resolve_loss_config(name, "eager"), 1000, "cpu", 32, torch.bfloat16)
# the kernels' own values, not a copy of the eager loss: their error against a float64 KL is float32's
x, t = torch.randn(1, 8, 1000, dtype=torch.float64) * 4, torch.randn(1, 8, 1000, dtype=torch.float64) * 4
exact = (torch.softmax(t, -1) * (torch.log_softmax(t, -1) - torch.log_softmax(x, -1))).sum(-1)
kl_fused = resolve_loss_config("kl_div", "fused")["kl_div"][0](x.float(), t.float())
out["kl_error"] = float((kl_fused.double() - exact).abs().max())
out["kl_error_eager"] = float((resolve_loss_config("kl_div", "eager")["kl_div"][0](x.float(), t.float()).double() - exact).abs().max())
# the product's choice on the GPU path, and the chosen loss inside a compiled step against the eager one
loss = training_loss("kl_div", on_gpu=True, vocab_size=64, device="cpu")
out["implementation"], out["reason"] = loss.implementation, loss.reason
# resources.draft.loss_implementation: fused on a CPU: the check runs here (the interpreter), and passes
out["fused_on_cpu"] = training_loss("kl_div", on_gpu=False, vocab_size=64, prefer="fused").implementation
logits, targets = torch.randn(1, 16, 300) * 3, torch.randn(1, 16, 300) * 3
results = []
for cfg, compile_it in ((loss.config, True), (resolve_loss_config("kl_div", "eager"), False)):
    step = lambda z, cfg=cfg: cfg["kl_div"][0](torch.tanh(z) * 4, targets).mean() + 0.1 * z.square().mean()
    step = torch.compile(step, backend="aot_eager") if compile_it else step
    z = logits.clone().requires_grad_(True)
    value = step(z)
    value.backward()
    results.append((value.detach(), z.grad))
out["compiled_loss"] = [float(r[0]) for r in results]
out["compiled_grad_diff"] = float((results[0][1] - results[1][1]).abs().max())
print("RESULT " + json.dumps(out))
"""


def test_speculators_fused_kernels_agree_with_its_eager_losses_in_the_triton_interpreter():
    """speculators' fused kernels, interpreted on the CPU: every loss passes the agreement check in bfloat16 (``ce``
    failed it before the reference ran in float32: its eager loss rounded to bfloat16 where the kernel and training
    under autocast keep float32), the check makes ``training_loss`` choose them on the GPU path, and outside the
    compiled region they give the eager values and gradients."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INTERPRETED)], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["clock"] is True
    assert set(out["checks"]) >= {"ce", "jsd", "kl_div", "rkl", "tv"}
    assert out["checks"] == {name: None for name in out["checks"]}
    assert out["kl_error"] < 1e-4 and out["kl_error_eager"] < 1e-4
    assert (out["implementation"], out["reason"]) == (FUSED, "")
    assert out["fused_on_cpu"] == FUSED
    assert out["compiled_loss"][0] == pytest.approx(out["compiled_loss"][1], rel=1e-5)
    assert out["compiled_loss"][1] > 0.5
    assert out["compiled_grad_diff"] < 1e-6

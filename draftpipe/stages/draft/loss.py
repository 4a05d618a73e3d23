"""The draft's training loss: speculators' loss (``draft.loss_fn``) in the implementation the device allows.

On a GPU speculators trains with its fused Triton kernels (``speculators.losses.fused``: forward and backward
stream the vocabulary row by row and never hold a ``[T, V]`` intermediate, the memory win over the eager losses),
called from inside the draft's compiled forward (``Eagle3DraftModel.forward`` is ``torch.compile``d whenever CUDA is
present, ``speculators.models.utils.conditional_torch_compile``). Dynamo then traces the kernels' launch, autotuner
and ``early_config_prune`` callback included. With torch 2.11 that trace fails at the first step
(``AssertionError: ListVariable(length=21) is already tracked for mutation ... loss_backward_kernel.configs``).
The likely cause, read from the sources (reproducing it needs a GPU): the forward and backward kernels are decorated
by one ``triton.autotune`` object, so both autotuners hold one list of 21 tile configs
(``loss_forward_kernel.configs is loss_backward_kernel.configs``), and Dynamo, which traces an ``autograd.Function``'s
forward and backward together, meets that list a second time under another source.

What this module does about it: the fused loss functions run outside the compiled region
(:func:`outside_compile`, ``torch.compiler.disable``). Dynamo ends the graph before the loss call, the kernels run
as they do without compilation, and the graph resumes after them. Nothing of the Triton launch is traced, so the
result does not depend on what a torch version can trace. This is how speculators already treats its flex-attention
mask builder (``speculators.models.eagle3.attention``). The loss values and gradients are the kernels' own.

Before training, :func:`training_loss` checks the fused implementation against the eager one
(:func:`check_agreement`) on a random bfloat16 problem of 1,024 positions of the draft's vocabulary. The check also
autotunes the kernels for that vocabulary (speculators keys the tuning on the vocabulary width and the loss). A
kernel that raises or disagrees is not trained with: the draft trains with the eager loss, the log says why in a
WARNING line, and ``metrics.csv`` says ``eager-fallback`` in its ``loss_impl`` column.
On a CPU (Triton has no CPU backend) the loss is the eager one, as before. ``resources.draft.loss_implementation``
(``auto``, ``fused``, ``eager``) overrides the choice; ``fused`` on a CPU runs the kernels through Triton's
interpreter (``TRITON_INTERPRET=1``, numpy: slow, for tests; :func:`time_tiles_on_the_cpu`), which is how the CPU
tests check them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

#: the loss implementations a draft can be trained with (``loss_impl`` in ``metrics.csv``)
FUSED, EAGER, FALLBACK = "fused", "eager", "eager-fallback"


@dataclass(frozen=True)
class TrainingLoss:
    """The loss a draft trains with.

    Attributes:
        config: speculators' ``LossConfig``, ``{name: (loss_fn, weight)}``; each ``loss_fn(logits, targets)`` maps
            two ``[1, T, V]`` tensors to the per-position loss ``[1, T]`` (float32).
        implementation: :data:`FUSED`, :data:`EAGER` or :data:`FALLBACK` (eager because the fused check failed).
        reason: why the loss is not the fused one (empty for :data:`FUSED`).
    """

    config: dict
    implementation: str
    reason: str = ""

    def log_line(self) -> str:
        """The draft log's line about the loss (a ``WARNING`` line for :data:`FALLBACK`)."""
        names = ", ".join(f"{name} x{weight:g}" for name, (_, weight) in self.config.items())
        if self.implementation == FUSED:
            return f"draft loss: {names}, speculators' fused Triton kernels (run outside the compiled forward)"
        if self.implementation == FALLBACK:
            return f"WARNING draft loss: {names}, eager: the fused Triton kernels failed their check ({self.reason})"
        return f"draft loss: {names}, eager ({self.reason})"


def time_tiles_on_the_cpu() -> bool:
    """Under Triton's interpreter (``TRITON_INTERPRET=1``, which runs kernels with numpy on the CPU), give the
    autotuners of speculators' fused loss kernels a CPU clock: Triton's own benchmarker asks the GPU driver and fails
    without one (``0 active drivers``). The tile it picks changes the speed only. Returns whether it did (False
    outside the interpreter, where nothing changes)."""
    import time

    import triton

    if not triton.knobs.runtime.interpret:
        return False
    from speculators.losses import fused

    def cpu_clock(kernel_call, quantiles):  # the autotuner's do_bench: milliseconds, one run
        start = time.perf_counter()
        kernel_call()
        return [(time.perf_counter() - start) * 1e3 for _ in quantiles]

    for kernel in (fused.loss_forward_kernel, fused.loss_backward_kernel):
        kernel.do_bench = cpu_clock  # an instance attribute before Autotuner's cached do_bench
    return True


def outside_compile(config: dict) -> dict:
    """``config`` (a ``LossConfig``) with every loss function wrapped in ``torch.compiler.disable``: called from a
    compiled region, the function ends the graph and runs uncompiled (see the module docstring)."""
    import torch

    return {name: (torch.compiler.disable(fn), weight) for name, (fn, weight) in config.items()}


def check_agreement(
    candidate: dict,
    reference: dict,
    vocab_size: int,
    device,
    rows: int = 64,
    dtype=None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
) -> str | None:
    """Compare two ``LossConfig`` of the same losses on one random problem: ``None`` when they agree, else why not.

    The candidate gets logits and targets ``[1, rows, vocab_size]`` of ``dtype`` (default float32; standard normal,
    scaled by 4, seed 0) on ``device``; the reference gets the same values in float32. That is how the reference runs
    in training, where autocast computes the eager losses in float32 from the draft's bfloat16 logits; given bfloat16
    itself, an eager loss that keeps its input's dtype (``ce``: ``cross_entropy``) would round its result to bfloat16
    and fail a correct kernel. Their per-position losses ``[1, rows]`` must agree within ``rtol``/``atol``
    (``torch.allclose``, in float32), and so must the gradients of the summed loss with respect to the logits: the
    candidate's come in ``dtype``, so for a dtype coarser than float32 the gradients' ``rtol`` is at least two units
    of its rounding (``2 * torch.finfo(dtype).eps``). An exception of the candidate (a kernel that does not compile or
    launch) is reported, not raised.

    Raises:
        ValueError: the two configs do not name the same losses.
    """
    import torch

    if list(candidate) != list(reference):
        raise ValueError(f"the loss configs differ: {sorted(candidate)} against {sorted(reference)}")
    dtype = dtype or torch.float32
    grad_rtol = max(rtol, 2 * torch.finfo(dtype).eps)
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(1, rows, vocab_size, generator=gen) * 4).to(device=device, dtype=dtype)
    targets = (torch.randn(1, rows, vocab_size, generator=gen) * 4).to(device=device, dtype=dtype)
    for name in reference:
        out = []
        for fns, kind in ((candidate, dtype), (reference, torch.float32)):
            x = logits.to(kind, copy=True).requires_grad_(True)
            try:
                loss = fns[name][0](x, targets.to(kind))
                loss.sum().backward()
            except Exception as err:  # noqa: BLE001 - any failure of the candidate kernel is the answer
                return f"{name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
            out.append((loss.detach().float(), x.grad.float()))
        (loss_c, grad_c), (loss_r, grad_r) = out
        if loss_c.shape != loss_r.shape:
            return f"{name}: loss shape {tuple(loss_c.shape)} against {tuple(loss_r.shape)}"
        if not torch.allclose(loss_c, loss_r, rtol=rtol, atol=atol):
            return f"{name}: losses differ by up to {float((loss_c - loss_r).abs().max()):.3g}"
        if not torch.allclose(grad_c, grad_r, rtol=grad_rtol, atol=atol):
            return f"{name}: gradients differ by up to {float((grad_c - grad_r).abs().max()):.3g}"
    return None


#: the check's problem on a GPU: the draft's logits dtype under autocast, and enough rows (one Triton program
#: each) that the autotuning it triggers, keyed on the vocabulary alone, times tiles as training will run them
GPU_CHECK_ROWS = 1024


def training_loss(spec: str, on_gpu: bool, vocab_size: int, device=None, prefer: str = "auto") -> TrainingLoss:
    """The loss to train a draft with (see the module docstring).

    Args:
        spec: ``draft.loss_fn``: a speculators loss name (``kl_div``) or a JSON mapping of names to weights.
        on_gpu: whether training runs on an accelerator (Triton kernels need one).
        vocab_size: the draft vocabulary (the width of the logits), for the agreement check.
        device: where the check runs (default: this rank's accelerator, which ``init_ranks`` set; the CPU when
            there is none).
        prefer: ``resources.draft.loss_implementation``: ``auto`` (fused on a GPU, checked, else eager with the
            reason; eager on a CPU), ``fused`` (the kernels, checked, wherever training runs: on a CPU only Triton's
            interpreter, ``TRITON_INTERPRET=1``, runs them) or ``eager``.

    Raises:
        ValueError: ``spec`` names no speculators loss (speculators' message), or ``prefer`` is unknown.
        RuntimeError: ``prefer`` is ``fused`` and the kernels failed their check (the message says how).
    """
    import torch
    from speculators.losses import resolve_loss_config

    eager = resolve_loss_config(spec, "eager")
    if prefer not in ("auto", FUSED, EAGER):
        raise ValueError(f"resources.draft.loss_implementation must be auto, fused or eager, not {prefer!r}")
    if prefer == EAGER:
        return TrainingLoss(eager, EAGER, "asked for: resources.draft.loss_implementation: eager")
    if not on_gpu and prefer == "auto":
        return TrainingLoss(eager, EAGER, "no accelerator: Triton kernels need a GPU")
    # speculators imports its Triton kernels at the first call: a missing Triton fails inside the check
    fused = outside_compile(resolve_loss_config(spec, FUSED))
    if not on_gpu:
        with contextlib.suppress(ImportError, AttributeError):  # no Triton, or one without the interpreter's knob
            time_tiles_on_the_cpu()
    if device is None:
        acc = torch.accelerator.current_accelerator()
        device = torch.device(acc.type, torch.accelerator.current_device_index()) if acc else torch.device("cpu")
    problem = check_agreement(fused, eager, vocab_size, device, GPU_CHECK_ROWS, torch.bfloat16)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the check's [1024, vocab] tensors go back to the device before the draft comes
    if problem is not None and prefer == FUSED:
        raise RuntimeError(
            f"resources.draft.loss_implementation: fused: speculators' fused Triton kernels failed their check "
            f"against the eager loss ({problem}); set it to auto (the eager loss, with a warning) or eager"
        )
    if problem is not None:
        return TrainingLoss(eager, FALLBACK, problem)
    return TrainingLoss(fused, FUSED)

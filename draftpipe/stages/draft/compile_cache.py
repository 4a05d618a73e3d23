"""Where the draft job keeps torch.compile's and Triton's caches between runs.

On a GPU the draft's forward is compiled (speculators' ``conditional_torch_compile``) and the fused loss kernels are
autotuned. The first step of a fresh process pays for both: 97 s for a one-layer draft of an 8B verifier on an H200.
Inductor caches compiled graphs on disk (its FX graph and AOTAutograd caches, on by default), but in
``/tmp/torchinductor_<user>``, which a SLURM job's private ``/tmp`` or a reboot loses; Triton keeps compiled
kernels in ``~/.triton/cache`` and forgets autotuning results unless asked. :func:`use_compile_cache` points both
at one directory of the workflow (:data:`draftpipe.core.layout.COMPILE_CACHE`), so a rerun of the draft job (a
resume, a changed epoch count, the next seed) finds its kernels and tunings there. The cache holds no result:
it is not a param and reruns nothing, and deleting it costs one warm-up.
"""

from __future__ import annotations

import os
from pathlib import Path


def compile_cache_env(root: str | os.PathLike) -> dict[str, str]:
    """The environment that puts the compile caches under ``root`` (made absolute): Inductor's
    (``TORCHINDUCTOR_CACHE_DIR``: compiled graphs, their Triton kernels), Triton's (``TRITON_CACHE_DIR``: the
    kernels of speculators' fused loss) and Triton's autotuning results (``TRITON_CACHE_AUTOTUNING``)."""
    root = Path(root).absolute()
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TRITON_CACHE_AUTOTUNING": "1",
    }


def use_compile_cache(root: str | os.PathLike, environ: dict | None = None) -> dict[str, str]:
    """Set :func:`compile_cache_env` in ``environ`` (``os.environ``) where the user has not set the variable;
    return what was set. Call it before torch compiles or speculators' loss kernels are imported (Triton reads
    ``TRITON_CACHE_AUTOTUNING`` when a kernel is decorated); torchrun's ranks inherit it."""
    environ = os.environ if environ is None else environ
    chosen = {k: v for k, v in compile_cache_env(root).items() if k not in environ}
    environ.update(chosen)
    return chosen

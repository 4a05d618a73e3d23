"""Settings of a job that shape no artifact, typed once and built from the validated config in one place.

Quality gates (``max_truncated_fraction``, ``max_empty_mask_fraction``, ``min_train_samples``,
``min_acceptance_length``), how a stage shares its engine and sizes its vLLM calls, how the draft spreads over ranks
and how often it saves, where a chat template file lies (its hash is the tracked param) and the prompt sources of
a shard (the shard's fingerprint is the tracked param): changing any of them must rerun nothing.

They reach the job script as ``params.untracked``, a ``types.SimpleNamespace`` built by :func:`job_settings`:
Snakemake's params rerun trigger records only builtin values (``snakemake/persistence``, ``_serialize_param``: any
other object is left out), so a change of these reruns nothing, and a namespace unpickles in the job script before
draftpipe is importable there. The script reads it back typed with :func:`read_job_settings`. Everything that shapes
an artifact is a builtin param instead, and reruns what it shapes. The stage stores' keys leave ``untracked`` out
(:func:`draftpipe.runtime.store.stage_settings`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, TypeVar

from draftpipe.core.gpus import draft_ranks
from draftpipe.workflow.storage import parse_bytes, stream_gpu_memory


@dataclass(frozen=True)
class PromptShardJob:
    """``prompt_shard``: the sources and system prompt it reads (its records' fingerprint is the tracked param)."""

    sources: list[dict]
    system_prompt: str | None


@dataclass(frozen=True)
class CompletionsJob:
    """``completions``: one engine for the stage's stale shards or one per job, the truncation gate, the template
    file (its SHA-256 is the tracked ``chat_template_sha256``)."""

    share_engine: bool
    max_truncated_fraction: float
    chat_template_file: str | None


@dataclass(frozen=True)
class HiddenStatesJob:
    """``hidden_states``: one engine for the stage or one per job, tokens per vLLM call, the empty-mask gate."""

    share_engine: bool
    batch_tokens: int
    max_empty_mask_fraction: float


@dataclass(frozen=True)
class DraftJob:
    """``draft``: the training-set gate, ranks per node (:func:`draftpipe.core.gpus.draft_ranks`), nodes, FSDP,
    checkpoints per epoch, the loss implementation (:func:`draftpipe.stages.draft.loss.training_loss`), the loader's
    worker processes (:func:`draftpipe.stages.draft.data.loader_workers`); with
    ``hidden_states.storage: stream``, the spool's budget in bytes, the vLLM producer's devices
    (``resources.hidden_states.gpus``) and its share of their memory
    (:func:`draftpipe.workflow.storage.stream_gpu_memory`), and the empty-mask gate of the shards it replaces; the
    hidden-state gate (:class:`draftpipe.stages.draft.state_gate.StateGate`: ``state_gate`` holds its fields)."""

    min_train_samples: int
    ranks: int
    nodes: int
    fsdp: bool
    checkpoints_per_epoch: int
    disk_budget: int
    stream_gpus: int
    max_empty_mask_fraction: float
    stream_gpu_memory: float
    loss_implementation: str = "auto"
    loader_workers: int | None = None
    state_gate: dict | None = None
    loggers: tuple = ()


@dataclass(frozen=True)
class ReportJob:
    """``compat_report``: the template file of the live check, the eval fraction its skip message names."""

    chat_template_file: str | None
    eval_fraction: float


@dataclass(frozen=True)
class BenchRunJob:
    """``bench_run``: the template file of the benchmark's prompts."""

    chat_template_file: str | None


@dataclass(frozen=True)
class BenchServeJob:
    """``bench_serve``: the template file of the benchmark's prompts, and how long a server may take to answer
    ``/health`` (seconds; ``bench.serve.startup_timeout``; None while ``bench.serve`` is null)."""

    chat_template_file: str | None
    startup_timeout: float | None


@dataclass(frozen=True)
class BenchReportJob:
    """``bench_report``: the acceptance gate (None: no gate)."""

    min_acceptance_length: float | None


def _settings(rule: str, config: dict) -> Any:
    res, verifier = config["resources"], config["verifier"]
    if rule == "prompt_shard":
        return PromptShardJob(config["prompts"]["sources"], config["prompts"]["system_prompt"])
    if rule == "completions":
        return CompletionsJob(
            res["completions"]["share_engine"],
            config["completions"]["max_truncated_fraction"],
            verifier["chat_template_file"],
        )
    if rule == "hidden_states":
        hs = res["hidden_states"]
        return HiddenStatesJob(
            hs["share_engine"], hs["batch_tokens"], config["hidden_states"]["max_empty_mask_fraction"]
        )
    if rule == "draft":
        d = res["draft"]
        return DraftJob(
            config["draft"]["min_train_samples"],
            draft_ranks(d),
            d["nodes"],
            d["fsdp"],
            d["checkpoints_per_epoch"],
            parse_bytes(config["hidden_states"]["disk_budget"], "hidden_states.disk_budget"),
            res["hidden_states"]["gpus"],
            config["hidden_states"]["max_empty_mask_fraction"],
            stream_gpu_memory(res),
            d["loss_implementation"],
            d["loader_workers"],
            {
                "min_agreement": config["hidden_states"]["min_teacher_agreement"],
                "tokens": config["hidden_states"]["teacher_check_tokens"],
                "temperature": config["completions"]["temperature"],
                "top_p": config["completions"]["top_p"],
            },
            tuple(config["draft"]["loggers"]),
        )
    if rule == "compat_report":
        return ReportJob(verifier["chat_template_file"], config["prompts"]["eval_fraction"])
    if rule == "bench_run":
        return BenchRunJob(verifier["chat_template_file"])
    if rule == "bench_serve":
        serve = config["bench"]["serve"]
        return BenchServeJob(verifier["chat_template_file"], serve and float(serve["startup_timeout"]))
    if rule == "bench_report":
        return BenchReportJob(config["bench"]["min_acceptance_length"])
    raise KeyError(f"no untracked settings for rule {rule!r}")


def job_settings(rule: str, config: dict) -> SimpleNamespace:
    """The untracked settings of ``rule`` from the validated config (schema defaults filled), as the value of its
    ``params.untracked``.

    Raises:
        KeyError: a rule without untracked settings, or a config without a key the schema fills.
    """
    return SimpleNamespace(**asdict(_settings(rule, config)))


T = TypeVar("T")


def read_job_settings(cls: type[T], untracked: SimpleNamespace) -> T:
    """``params.untracked`` of a job script as the typed settings ``cls`` (one of this module's classes).

    Raises:
        TypeError: the namespace does not hold exactly the fields of ``cls``.
    """
    return cls(**vars(untracked))

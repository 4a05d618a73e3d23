"""Checks of config.yaml that need more than its JSON schema, run when the Snakefile is parsed (before any job).

The schema (``draftpipe/workflow/config.schema.yaml``) catches wrong keys and types; :func:`check_config` catches values
that only make sense against the verifier and the file system: missing prompt sources, a verifier that does not
exist, aux layer ids outside the verifier's depth, a draft vocabulary larger than the verifier's.
:func:`validate_config` runs the schema itself with messages that name the key (``section.key: ...``).
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

from draftpipe.core.gpus import draft_world_size
from draftpipe.core.io import JSONLimitError, load_json
from draftpipe.formats.chat import PACKAGE_TEMPLATES
from draftpipe.formats.hidden_states import resolve_aux_layer_ids
from draftpipe.formats.verifier import (
    VerifierNotFoundError,
    check_gguf,
    gguf_metadata,
    is_mla_config,
    load_verifier_config,
    resolve_gguf_head_dim,
)
from draftpipe.workflow.draft import check_method
from draftpipe.workflow.errors import ConfigError
from draftpipe.workflow.sources import check_sources

SCHEMA = Path(__file__).with_name("config.schema.yaml")


def _field(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "config"


def _schema_message(error) -> str:
    """``field: what is wrong`` for one ``jsonschema`` error; unknown and missing keys are named as fields."""
    where = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = sorted(error.schema.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in known)
        return f"{_field(where + extra[:1])}: unknown key (known keys: {', '.join(known)})"
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        return f"{_field(where + missing[:1])}: missing (a required key)"
    return f"{_field(where)}: {error.message}"


def fill_defaults(instance: Any, schema: dict) -> None:
    """Set every key the config leaves out to its schema ``default`` (a copy), in place: an object's
    ``properties`` first, then each present value's own (objects and the items of arrays), so a section defaulted to
    ``{}`` gets its keys' defaults too. What Snakemake's ``snakemake.utils.validate(..., set_default=True)`` does."""
    if isinstance(instance, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in instance and "default" in sub:
                instance[key] = copy.deepcopy(sub["default"])
            if key in instance and isinstance(sub, dict):
                fill_defaults(instance[key], sub)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            fill_defaults(item, schema["items"])


_SCHEMA_TYPES = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "array": (list,),
    "object": (dict,),
}


def _read_as_schema_type(value: str, types: list[str]) -> tuple[bool, Any]:
    """``(True, value read)`` when ``value`` read as JSON, else YAML, is of one of the schema ``types``."""
    import yaml

    try:
        read = json.loads(value)  # 1e-4 too, which YAML 1.1 reads as a string
    except ValueError:
        try:
            read = yaml.safe_load(value)
        except yaml.YAMLError:
            return False, value
    return any(type(read) in _SCHEMA_TYPES.get(t, ()) for t in types), read


def coerce_strings(instance: Any, schema: dict, path: tuple = ()) -> list[str]:
    """Turn strings into the numbers (booleans, nulls, lists, objects) the schema wants there, in place; returns the
    keys changed.

    ``snakemake --config 'draft={"epochs": 3}'`` hands the workflow ``{"epochs": "3"}``: ``snakemake/cli.py``
    ``parse_config`` reads a ``--config`` value that is no plain number with YAML's ``BaseLoader``, which leaves
    every scalar nested in it a string. A string is read as JSON, else as YAML (``"3"`` -> 3, ``"1e-4"`` -> 0.0001,
    ``"true"`` -> True, ``"null"`` -> None), and kept only where the schema's ``type`` does not take a string and
    does take what it reads as; anything else is left for the schema to name.
    """
    changed: list[str] = []
    if isinstance(instance, dict):
        props = schema.get("properties") or {}
        slots = [(key, props.get(key)) for key in instance]
    elif isinstance(instance, list):
        slots = [(i, schema.get("items")) for i in range(len(instance))]
    else:
        return changed
    for key, sub in slots:
        if not isinstance(sub, dict):
            continue
        types = sub.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if isinstance(instance[key], str) and types and "string" not in types:
            ok, read = _read_as_schema_type(instance[key], types)
            if not ok:
                continue
            instance[key] = read
            changed.append(_field([*path, key]))
        changed += coerce_strings(instance[key], sub, (*path, key))
    return changed


#: speculators' loss functions (``speculators.losses.utils``: the same names in its fused and eager maps;
#: ``tests/unit/test_settings.py`` holds them together): ``draft.loss_fn`` is one of them, or a JSON object of them to
#: weights
LOSS_FUNCTIONS = ("ce", "jsd", "kl_div", "lk_hybrid", "nla", "rkl", "tv")


def check_loss_fn(spec: Any) -> None:
    """``draft.loss_fn`` as speculators' ``resolve_loss_config`` takes it: a loss name of :data:`LOSS_FUNCTIONS`,
    or a non-empty JSON object mapping such names to finite positive numbers (``'{"ce": 0.1, "tv": 0.9}'``); checked
    when the workflow is read, not minutes into the draft job.

    Raises:
        ConfigError: ``draft.loss_fn: 'bogus' is neither a loss of speculators (ce, jsd, ...) nor a JSON object of
            them to weights (e.g. '{"ce": 0.1, "tv": 0.9}')``, or naming the unknown loss or the weight that is no
            number, or is not finite, or not above 0 (``{"ce": -1}`` would train to a loss of -164 on the embedded
            default, ``NaN`` fail minutes into the job).
    """
    known = ", ".join(LOSS_FUNCTIONS)
    if spec in LOSS_FUNCTIONS:
        return
    try:
        weights = load_json(spec)
    except ValueError:
        weights = None
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(
            f"draft.loss_fn: {spec!r} is neither a loss of speculators ({known}) nor a JSON object of them to "
            """weights (e.g. '{"ce": 0.1, "tv": 0.9}')"""
        )
    for name, weight in weights.items():
        if name not in LOSS_FUNCTIONS:
            raise ConfigError(f"draft.loss_fn: {name!r} is not a loss of speculators ({known})")
        if type(weight) not in (int, float):
            raise ConfigError(f"draft.loss_fn: the weight of {name!r} must be a number, not {weight!r}")
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(
                f"draft.loss_fn: the weight of {name!r} is {weight!r}; a weight must be finite and above 0 (a "
                "negative weight rewards the draft for being wrong, a zero one trains nothing: leave that loss out)"
            )


def validate_config(config: dict, schema: str | Path = SCHEMA, *, defaults: bool = True) -> None:
    """Check ``config`` against the JSON schema, naming the key of the first error, then fill in the schema's
    defaults (:func:`fill_defaults`; the one validation the workflow runs).

    The values it rewrites: ``completions.reasoning: off`` unquoted, which YAML reads as ``false``, becomes
    ``"off"``; a string where the schema wants a number, boolean or null is read as one (:func:`coerce_strings`:
    how Snakemake passes the values nested in ``--config 'draft={"epochs": 3}'``); a prompt source's or bench prompt set's ``path`` starting with ``~`` is expanded to the home
    directory (as ``verifier.path`` is). It also checks ``draft.loss_fn`` (:func:`check_loss_fn`).

    Errors are ordered by key path, so the same config always reports the same error.

    Args:
        config: the parsed config.yaml.
        schema: the schema file (default: ``draftpipe/workflow/config.schema.yaml``).
        defaults: fill in the defaults of the keys ``config`` leaves out.

    Raises:
        ConfigError: ``section.key: <what is wrong>``, e.g. ``completions.too_long: 'chop' is not one of ['drop',
            'truncate', 'error']`` or ``completions.temprature: unknown key (known keys: ...)``.
    """
    import jsonschema
    import yaml

    # YAML 1.1 reads an unquoted `off` as false: completions.reasoning means the string
    if (config.get("completions") or {}).get("reasoning") is False:
        config["completions"]["reasoning"] = "off"
    spec = yaml.safe_load(Path(schema).read_text(encoding="utf-8"))
    coerce_strings(config, spec)  # numbers nested in a --config value arrive as strings
    validator = jsonschema.validators.validator_for(spec)(spec)
    errors = sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        raise ConfigError(_schema_message(errors[0]))
    if isinstance(config.get("draft"), dict) and "loss_fn" in config["draft"]:
        check_loss_fn(config["draft"]["loss_fn"])
    # a file path starting with ~ means the home directory, as in verifier.path (draftpipe.formats.verifier.resolve_verifier)
    listed = [
        *((config.get("prompts") or {}).get("sources") or []),
        *((config.get("bench") or {}).get("prompt_sets") or []),
    ]
    for src in listed:
        if isinstance(src, dict) and isinstance(src.get("path"), str) and src["path"].startswith("~"):
            src["path"] = os.path.expanduser(src["path"])
    if defaults:
        fill_defaults(config, spec)


#: why a config file that asks for YTE templating (``__use_yte__: true``) is refused: Snakemake's config reader
#: (``snakemake/common/configfile.py``, ``yte.process_yaml``) evaluates the Python expressions in its values
YTE_REFUSED = (
    "__use_yte__: YTE templating is refused: Snakemake runs the Python expressions of such a file when it reads it "
    "(before the workflow can check anything); write plain values"
)


def load_config_file(path: str | Path) -> dict:
    """Read a config file as Snakemake does (JSON, else YAML, ``snakemake/common/configfile.py``), with errors that
    name the file, line and column, which Snakemake's own ("Config file is not valid JSON or YAML") do not.

    Raises:
        ConfigError: ``config.yaml:3:1: a tab indents this line; YAML indents with spaces only``, ``FILE:L:C: not
            valid YAML (<the parser's problem>)``, ``FILE: does not exist``, ``FILE: a config holds keys at its top
            level, not a list``, or ``FILE: __use_yte__: YTE templating is refused ...`` (:data:`YTE_REFUSED`).
    """
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc})") from None
    try:
        data = load_json(text)
    except JSONLimitError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except ValueError:
        try:
            data = yaml.safe_load(text)
        except RecursionError:
            raise ConfigError(f"{path}: YAML nested too deeply to read") from None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            lines = text.splitlines()
            # the parser stops at the first tab it cannot take; name the first line a tab indents, if any
            tabbed = next(
                (i for i, line in enumerate(lines) if line[: len(line) - len(line.lstrip())].count("\t")), None
            )
            if tabbed is not None and (mark is None or tabbed <= mark.line):
                column = lines[tabbed].index("\t") + 1
                raise ConfigError(
                    f"{path}:{tabbed + 1}:{column}: a tab indents this line; YAML indents with spaces only"
                ) from None
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            raise ConfigError(f"{where}: not valid YAML ({exc.problem or exc.context})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config holds keys at its top level, not {type(data).__name__}")
    if "__use_yte__" in data:
        raise ConfigError(f"{path}: {YTE_REFUSED}")
    return data


def check_config_files(paths: list[str | Path], base: str | Path | None = None) -> dict:
    """The config Snakemake would build from ``base`` (the workflow's ``config.yaml``) extended by ``paths`` (the
    ``--configfile`` files, in order; ``snakemake.utils.update_config``'s deep merge), validated by
    :func:`validate_config` and returned with its defaults filled in.

    Raises:
        ConfigError: from :func:`load_config_file` (file, line, column) or :func:`validate_config` (the key).
    """
    from snakemake.utils import update_config

    merged: dict = load_config_file(base) if base is not None else {}
    for p in paths:
        update_config(merged, load_config_file(p))
    validate_config(merged)
    return merged


def main(argv: list[str] | None = None) -> int:
    """``draftpipe-config [FILE ...]`` (``python -m draftpipe.workflow.config``): check config.yaml of the current directory
    extended by each ``--configfile`` FILE, as the workflow reads them; prints ``ok`` or ``config error: ...`` (the
    file and line of a YAML error, the key of a schema error) and exits 0 or 1."""
    import argparse

    ap = argparse.ArgumentParser(prog="draftpipe-config", description=main.__doc__)
    ap.add_argument("files", nargs="*", help="config files given to snakemake with --configfile, in order")
    ap.add_argument("--base", default="config.yaml", help="the workflow's own config file (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        check_config_files(args.files, args.base)
    except ConfigError as exc:
        print(f"config error: {exc}")
        return 1
    print("ok")
    return 0


def gguf_shape(path: str) -> dict:
    """``num_hidden_layers``, ``hidden_size`` and ``vocab_size`` from a GGUF header (``verifier.gguf_metadata``)."""
    meta = gguf_metadata(path)
    return {k: meta[k] for k in ("num_hidden_layers", "vocab_size", "hidden_size")}


def gguf_conversion(config: dict, resolved: dict) -> dict:
    """How the ``verifier`` rule converts a GGUF verifier, checked when the workflow is read.

    Args:
        config: the validated config (``verifier.gguf_head_dim``, ``verifier.gguf_max_position_embeddings``,
            ``verifier.dtype``, ``verifier.chat_template``, ``verifier.chat_template_file``).
        resolved: a ``{"kind": "gguf", "path": ...}`` verifier (``verifier.resolve_verifier``).

    Returns:
        ``head_dim`` (:func:`draftpipe.formats.verifier.resolve_gguf_head_dim`), ``max_position_embeddings`` (the configured
        one, else the GGUF's ``context_length``), ``dtype`` (``verifier.dtype``; ``auto``: float32), ``original_head_dim``, ``tokenizer_model``,
        ``chat_template`` (whether the GGUF has one) and ``quantized`` (its quantized tensor types, which the
        conversion dequantizes to ``dtype``).

    Raises:
        ConfigError: another architecture or tokenizer model than the conversion takes (naming ``verifier.path``
            and the file), a ``verifier.gguf_head_dim`` that is no multiple of the model's, or
            ``verifier.chat_template: required`` for a GGUF without ``tokenizer.chat_template`` and no
            ``verifier.chat_template_file``.
    """
    v = config.get("verifier") or {}
    try:
        meta = gguf_metadata(resolved["path"])
        check_gguf(meta, resolved["path"], field="verifier.path")
        head_dim = resolve_gguf_head_dim(v.get("gguf_head_dim"), meta["head_dim"])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if v.get("chat_template") == "required" and not meta["chat_template"] and not v.get("chat_template_file"):
        raise ConfigError(
            f"verifier.chat_template: 'required', but the GGUF {resolved['path']} has no chat template "
            "(tokenizer.chat_template) and verifier.chat_template_file is not set"
        )
    return {
        "head_dim": head_dim,
        "max_position_embeddings": v.get("gguf_max_position_embeddings") or meta["context_length"],
        "dtype": "float32" if v.get("dtype") in (None, "auto") else v["dtype"],
        "original_head_dim": meta["head_dim"],
        "tokenizer_model": meta["tokenizer_model"],
        "chat_template": meta["chat_template"] is not None,
        "quantized": meta["quantized"],
    }


def _config_key(resolved: dict) -> str:
    """The config key a resolved verifier's config.json comes from."""
    return "verifier.config_json" if resolved.get("config_path") else "verifier.path"


def read_verifier_config(resolved: dict) -> dict:
    """The (text) ``config.json`` of a resolved local or hub verifier, read with the bounded reader
    (:func:`draftpipe.formats.verifier.load_verifier_config`), for checks made when the workflow is read.

    Raises:
        ConfigError: the file is not valid JSON, nested too deeply, not an object or not UTF-8, naming the config
            key it comes from (``verifier.path``, or ``verifier.config_json``) and the file.
        draftpipe.formats.verifier.VerifierNotFoundError: there is no ``config.json``.
    """
    where = _config_key(resolved)
    try:
        return load_verifier_config(resolved.get("config_path") or resolved["path"], text=True)
    except VerifierNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and the bounded reader's errors are ValueErrors
        raise ConfigError(f"{where}: {exc}") from None


def verifier_shape(resolved: dict) -> dict:
    """``num_hidden_layers``, ``vocab_size`` and ``hidden_size`` of a resolved verifier (see
    ``verifier.resolve_verifier``).

    Raises:
        ConfigError: a config.json that cannot be read (:func:`read_verifier_config`) or that lacks one of the three
            as a positive integer, naming the key, the file and the field.
    """
    if resolved["kind"] == "gguf":
        return gguf_shape(resolved["path"])
    cfg = read_verifier_config(resolved)
    out = {}
    for key in ("num_hidden_layers", "vocab_size", "hidden_size"):
        value = cfg.get(key)
        if type(value) is not int or value < 1:
            path = resolved.get("config_path") or os.path.join(str(resolved["path"]), "config.json")
            raise ConfigError(
                f"{_config_key(resolved)}: {path} does not give {key} as a positive integer (got {value!r}); is it the config.json "
                "of a text model?"
            )
        out[key] = value
    return out


#: Config keys vLLM derives a model's context from, the smallest present one winning
#: (vllm/transformers_utils/model_arch_config_convertor.py, ``derive_max_model_len_and_key``, vLLM 0.32).
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
#: RoPE types whose ``factor`` vLLM does not apply to the context again (``_get_and_verify_max_len``).
_UNSCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def served_context(cfg: dict) -> tuple[int | None, str | None]:
    """The longest ``max_model_len`` vLLM serves a verifier with, from its (text) ``config.json``, and the key it
    comes from: the smallest of :data:`CONTEXT_KEYS`, times the RoPE ``factor`` of a RoPE type vLLM scales by
    (``rope_parameters`` or ``rope_scaling``), or the config's ``model_max_length`` where larger. The rule of
    vLLM 0.32's ``_get_and_verify_max_len`` (vllm/config/model.py), which refuses a longer ``max_model_len``.

    Returns:
        ``(tokens, key)``, or ``(None, None)`` when the config names no context (vLLM then takes any length).
    """
    found = [(cfg[k], k) for k in CONTEXT_KEYS if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)]
    if not found:
        return None, None
    tokens, key = min(found)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(rope, dict):
        params = (
            [rope] if ("rope_type" in rope or "type" in rope) else [v for v in rope.values() if isinstance(v, dict)]
        )
        factor = 1.0
        for rp in params:
            if rp.get("rope_type", rp.get("type", "default")) not in _UNSCALED_ROPE:
                factor = rp.get("factor", factor) or 1.0
        tokens = int(tokens * factor)
    longest = cfg.get("model_max_length")
    if isinstance(longest, int) and longest > tokens:
        return longest, "model_max_length"
    return tokens, key


def check_against_verifier(config: dict, resolved: dict) -> None:
    """Check the values a job of vLLM or of training would refuse minutes in, when the workflow is read.

    - ``verifier.max_model_len`` against the verifier's context (:func:`served_context`; for a GGUF, the
      ``verifier.gguf_max_position_embeddings`` its conversion writes).
    - ``draft.head_dim`` is even: rotary embeddings rotate pairs of dimensions.
    - ``resources.<stage>.gpus`` of the stages that run vLLM with tensor parallelism (completions, hidden_states,
      bench_run) divides the verifier's attention heads (vllm/config/model.py ``verify_with_parallel_config``),
      and its KV heads divide or are divided by it (vLLM's ``QKVParallelLinear``; not for MLA verifiers, which
      have no KV heads to split).

    Raises:
        ConfigError: naming the key, the value and the verifier's field it contradicts.
    """
    head_dim = (config.get("draft") or {}).get("head_dim")
    if head_dim is not None and head_dim % 2:
        raise ConfigError(
            f"draft.head_dim: {head_dim} is odd; rotary position embeddings rotate pairs of dimensions, so the "
            "draft's head_dim must be even (null = the verifier's)"
        )
    v = config.get("verifier") or {}
    if resolved["kind"] == "gguf":
        ctx = gguf_conversion(config, resolved)["max_position_embeddings"]
        cfg = None
        where = (
            "verifier.gguf_max_position_embeddings"
            if v.get("gguf_max_position_embeddings")
            else "the GGUF's context_length; verifier.gguf_max_position_embeddings sets another"
        )
    else:
        cfg = read_verifier_config(resolved)
        ctx, key = served_context(cfg)
        where = f"{key} in its config.json"
    if ctx is not None and (v.get("max_model_len") or 0) > ctx:
        raise ConfigError(
            f"verifier.max_model_len: {v['max_model_len']} exceeds the {ctx} tokens the verifier serves ({where}); "
            f"vLLM refuses a longer one: set verifier.max_model_len to at most {ctx}"
        )
    if cfg is None:
        return
    heads = cfg.get("num_attention_heads")
    kv = None if is_mla_config(cfg) else cfg.get("num_key_value_heads", heads)
    for stage in ("completions", "hidden_states", "bench_run"):
        tp = ((config.get("resources") or {}).get(stage) or {}).get("gpus") or 0
        if tp <= 1 or not isinstance(heads, int):
            continue
        if heads % tp:
            fits = [n for n in range(1, heads + 1) if heads % n == 0 and n <= 64]
            raise ConfigError(
                f"resources.{stage}.gpus: {tp} GPUs (vLLM's tensor parallel size) do not divide the verifier's "
                f"{heads} attention heads (num_attention_heads in its config.json); use one of "
                f"{', '.join(map(str, fits))}"
            )
        if isinstance(kv, int) and kv > 0 and (tp % kv if tp >= kv else kv % tp):
            raise ConfigError(
                f"resources.{stage}.gpus: {tp} GPUs (vLLM's tensor parallel size) and the verifier's {kv} KV heads "
                "(num_key_value_heads in its config.json): one must divide the other"
            )


def check_config(config: dict, resolved: dict) -> dict[str, Any]:
    """Check values against the verifier and the file system; return derived values (aux ids, shape and, for a
    GGUF verifier, ``gguf``: how it is converted, :func:`gguf_conversion`).

    Checked: every ``prompts.sources[i].path``, ``bench.prompt_sets[i].path`` and ``verifier.chat_template_file``
    is a file (the template may also name a template of the package), no source is listed twice with the same field,
    ``hidden_states.aux_layer_ids`` fit the verifier's depth, ``vocab.draft_vocab_size`` does not exceed the
    verifier's vocabulary, the draft's training ranks divide ``draft.batches_per_step`` and are no more per node than
    the job's GPUs, and what :func:`check_against_verifier` checks (context, head_dim, tensor parallel size).

    Raises:
        ConfigError: naming the key of the first wrong value.
    """
    job = (config.get("resources") or {}).get("draft") or {}
    if job.get("gpus") and job.get("ranks") and job["ranks"] > job["gpus"]:
        raise ConfigError(
            f"resources.draft.ranks: {job['ranks']} ranks on a node, but the job holds "
            f"resources.draft.gpus: {job['gpus']} GPU(s) there: one rank per GPU (leave ranks unset)"
        )
    ranks = draft_world_size(job)
    per_step = (config.get("draft") or {}).get("batches_per_step", 1)
    if per_step % ranks:
        raise ConfigError(
            f"draft.batches_per_step: {per_step} is not a multiple of the draft's {ranks} training ranks "
            "(resources.draft.nodes x resources.draft.ranks, or one per GPU of resources.draft.gpus): "
            "each step's packed batches are shared by the ranks"
        )
    check_sources(config["prompts"]["sources"])
    template = (config.get("verifier") or {}).get("chat_template_file")
    if template is not None:
        if template not in PACKAGE_TEMPLATES and not Path(template).is_file():
            raise ConfigError(
                f"verifier.chat_template_file: {template} does not exist (a Jinja chat template file, "
                f"or one of {', '.join(sorted(PACKAGE_TEMPLATES))})"
            )
    for i, src in enumerate((config.get("bench") or {}).get("prompt_sets") or []):
        if Path(src["path"]).is_dir():
            raise ConfigError(
                f"bench.prompt_sets[{i}].path: {src['path']} is a directory, not a file: name one prompt file per "
                "prompt set"
            )
        if not Path(src["path"]).is_file():
            raise ConfigError(f"bench.prompt_sets[{i}].path: {src['path']} does not exist")
    gguf = gguf_conversion(config, resolved) if resolved["kind"] == "gguf" else None
    shape = verifier_shape(resolved)
    field = "hidden_states.aux_layer_ids"
    try:
        aux = resolve_aux_layer_ids(config["hidden_states"].get("aux_layer_ids"), shape["num_hidden_layers"], field)
    except ValueError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(f"{field}: ") else f"{field}: {msg}") from exc
    check_against_verifier(config, resolved)
    vd = config["vocab"].get("draft_vocab_size") or shape["vocab_size"]
    if vd > shape["vocab_size"]:
        raise ConfigError(f"vocab.draft_vocab_size: {vd} exceeds the verifier's vocabulary of {shape['vocab_size']}")
    check_method(config, shape["vocab_size"])
    return {"aux_layer_ids": aux, "draft_vocab_size": vd, **shape, **({"gguf": gguf} if gguf else {})}


if __name__ == "__main__":
    raise SystemExit(main())

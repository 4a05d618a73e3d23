"""Reading a draft checkpoint and a verifier config for the check: tensor entries from safetensors headers (no
tensor data but ``d2t``/``t2d``), ``config.json``, sharded indexes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from draftpipe.checks.compat.report import CompatError
from draftpipe.core.io import SafetensorsHeaderError, load_json
from draftpipe.core.io import read_safetensors_header as io_read_header
from draftpipe.formats.verifier import load_verifier_config as read_verifier_config
from draftpipe.formats.verifier import text_config

SAFETENSORS_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}


INT_DTYPES = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}


def read_tensor_entries(path: str | Path) -> tuple[dict[str, dict], dict]:
    """Tensor dtypes, shapes and byte offsets from a safetensors file's header, without reading tensor data
    (:func:`draftpipe.core.io.read_safetensors_header`), each entry told where its data is.

    Returns:
        ``({name: {"dtype": str, "shape": [int], "data_offsets": [int, int], "_file", "_base"}}, metadata)``.

    Raises:
        CompatError: the file is missing, shorter than its header says, the header is not JSON, or tensor data
            ends past the end of the file.
    """
    path = Path(path)
    try:
        header, meta, base, size = io_read_header(path)
    except FileNotFoundError as exc:
        raise CompatError(f"{path}: file not found", path.name) from exc
    except SafetensorsHeaderError as exc:
        raise CompatError(f"{path}: {exc}", path.name) from exc
    ends = [
        t["data_offsets"][1]
        for t in header.values()
        if isinstance(t, dict)
        and isinstance(t.get("data_offsets"), list)
        and len(t["data_offsets"]) == 2
        and isinstance(t["data_offsets"][1], int)
    ]
    end = max(ends, default=0)
    if base + end > size:
        raise CompatError(f"{path}: truncated: tensor data ends at byte {base + end}, file has {size}", path.name)
    for t in header.values():
        if isinstance(t, dict):
            t["_file"] = str(path)
            t["_base"] = base
    return header, meta


def read_small_tensor(info: dict) -> np.ndarray:
    """Read one tensor's data (used for ``d2t``/``t2d`` only) as a numpy array."""
    dtype = SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise CompatError(f"{info['_file']}: cannot read dtype {info['dtype']}")
    start, end = info["data_offsets"]
    with open(info["_file"], "rb") as fh:
        fh.seek(info["_base"] + start)
        buf = fh.read(end - start)
    try:
        return np.frombuffer(buf, dtype=dtype).reshape(info["shape"])
    except ValueError as exc:
        raise CompatError(f"{info['_file']}: tensor data does not fit its shape {info['shape']} ({exc})") from exc


def load_checkpoint(draft_dir: str | Path) -> tuple[dict, dict[str, dict], list[str]]:
    """``(config, {tensor name: header info}, weight files)`` of a draft directory.

    Reads ``config.json`` and ``model.safetensors`` (or the shards listed in ``model.safetensors.index.json``).

    Raises:
        CompatError: no ``config.json``, or no safetensors weights (``pytorch_model.bin`` cannot be checked without
            loading it; convert it first).
    """
    d = Path(draft_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CompatError(
            f"{cfg_path}: not found (a draft directory holds config.json and model.safetensors)", "config.json"
        )
    try:
        config = load_json(cfg_path.read_text())
    except ValueError as exc:
        raise CompatError(f"{cfg_path}: not valid JSON ({exc})", "config.json") from exc
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({str(d / f) for f in load_json(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CompatError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})", index.name) from exc
    elif (d / "model.safetensors").is_file():
        files = [str(d / "model.safetensors")]
    elif (d / "pytorch_model.bin").is_file():
        raise CompatError(
            f"{d}: only pytorch_model.bin; shapes cannot be read without loading it. Convert it "
            "(speculators convert, or save_file) to model.safetensors first"
        )
    else:
        raise CompatError(f"{d}: no model.safetensors", "model.safetensors")
    tensors: dict[str, dict] = {}
    for f in files:
        header, _ = read_tensor_entries(f)
        tensors.update(header)
    return config, tensors, files


def verifier_text_config(spec: str | Path | dict) -> dict:
    """The verifier's text-model config from a directory, a ``config.json`` path or a dict.

    Raises:
        CompatError: the file is missing or not JSON.
    """
    if isinstance(spec, dict):
        return text_config(spec)
    p = Path(spec)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise CompatError(f"{p}: verifier config not found", "verifier")
    try:
        return read_verifier_config(p, text=True)
    except ValueError as exc:
        raise CompatError(str(exc), "verifier") from exc

"""The compatibility checker never crashes: whatever a draft's ``config.json``, the verifier's config or a
safetensors header holds, :func:`draftpipe.checks.compat.checker.check` answers with findings, and a value of the wrong type in a
field it reads is a finding that names the field.

Hundreds of mutations of the sound checkpoint of ``test_compat``: every field of its config (and of the nested
``transformer_layer_config``, ``eagle_config`` and ``speculators_config``) set to null, a string, a non-positive
number, a float, a boolean, a list, an object, or removed; the config and the verifier's config as non-objects;
tensor entries with the wrong dtype, rank, shape or offsets; the file truncated at every part of its framing.
"""

from __future__ import annotations

import copy
import json
import struct

import pytest
from safetensors.numpy import save_file
from test_compat import VERIFIER, speculators_config, tensors

from draftpipe.checks.compat.checker import check
from draftpipe.checks.compat.fields import CONFIG_FIELDS, VERIFIER_FIELDS

MUTATIONS = {"null": None, "string": "x", "zero": 0, "negative": -1, "float": 1.5, "bool": True, "list": [],
             "list_of_null": [None], "object": {}, "removed": KeyError}  # fmt: skip
#: where the checker reads CONFIG_FIELDS (the verifier's config separately)
TYPED = ("", "transformer_layer_config.", "eagle_config.", "transformer_layer_config.eagle_config.")


def fits(value, kind: type, nullable: bool) -> bool:
    """Whether the checker may take ``value`` for a field of ``kind`` (an independent statement of the rule)."""
    if value is None:
        return nullable
    if kind is int:
        return type(value) is int and value >= 1
    if kind is list:
        return isinstance(value, list) and None not in value
    return isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))


def paths(obj, prefix=""):
    """Dotted paths of every key in nested objects."""
    for key, value in obj.items():
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from paths(value, f"{prefix}{key}.")


def mutated(config: dict, path: str, value) -> dict:
    out = copy.deepcopy(config)
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = copy.deepcopy(value)
    return out


def expected_field(path: str, value) -> bool:
    """A wrong-typed value in a field the checker types must be answered by a finding naming ``path``."""
    prefix, _, key = path.rpartition(".")
    prefix = f"{prefix}." if prefix else ""
    if value is KeyError or prefix not in TYPED or key not in CONFIG_FIELDS:
        return False
    return not fits(value, *CONFIG_FIELDS[key])


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The sound checkpoint's model.safetensors bytes."""
    path = tmp_path_factory.mktemp("w") / "model.safetensors"
    save_file(tensors(), str(path))
    return path.read_bytes()


def run(tmp_path, config, weights: bytes, verifier=VERIFIER):
    d = tmp_path / "draft"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(weights)
    rep = check(d, verifier)  # never raises
    assert "checker.internal" not in rep.ids(), [f.message for f in rep.findings if f.id == "checker.internal"]
    return rep


def test_the_sound_checkpoint_passes(tmp_path, weights):
    assert run(tmp_path, speculators_config(), weights).ok


def test_every_config_field_mutated(tmp_path, weights):
    base = speculators_config()
    cases = named = 0
    unnamed = []
    for path in paths(base):
        for label, value in MUTATIONS.items():
            rep = run(tmp_path, mutated(base, path, value), weights)
            cases += 1
            if expected_field(path, value):
                named += 1
                if not any(f.field == path and f.severity == "error" for f in rep.findings):
                    unnamed.append(f"{path}={label}: {[(f.id, f.field) for f in rep.findings]}")
    assert unnamed == []
    assert cases >= 300 and named >= 150, (cases, named)


@pytest.mark.parametrize("config", [[], "x", 3, None, [speculators_config()]])
def test_a_config_that_is_not_an_object(tmp_path, weights, config):
    rep = run(tmp_path, config, weights)
    assert ("config.not_object", "config.json") in [(f.id, f.field) for f in rep.errors]


def test_every_verifier_field_mutated(tmp_path, weights):
    for key in VERIFIER_FIELDS:
        for label, value in MUTATIONS.items():
            rep = run(tmp_path, speculators_config(), weights, mutated(VERIFIER, key, value))
            if value is not KeyError and not fits(value, *CONFIG_FIELDS[key]):
                assert any(f.field == f"verifier.{key}" for f in rep.errors), (key, label, rep.ids())
    for verifier in ([], "x", 7, None):  # a verifier config.json that is not an object
        (tmp_path / "verifier.json").write_text(json.dumps(verifier))
        rep = run(tmp_path, speculators_config(), weights, tmp_path / "verifier.json")
        assert [(f.id, f.field) for f in rep.errors] == [("files.unreadable", "verifier")], verifier


def rewritten(weights: bytes, edit) -> bytes:
    """``weights`` with its JSON header replaced by ``edit(header)`` (the data section unchanged)."""
    (n,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + n])
    header = edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + weights[8 + n :]


ENTRY_MUTATIONS = {
    "dtype number": ("dtype", 5),
    "dtype null": ("dtype", None),
    "shape string": ("shape", "x"),
    "shape negative": ("shape", [-1]),
    "shape float": ("shape", [1.5]),
    "shape bools": ("shape", [True]),
    "rank 0": ("shape", []),
    "rank 4": ("shape", [2, 2, 2, 2]),
    "offsets short": ("data_offsets", [5]),
    "offsets reversed": ("data_offsets", [10, 2]),
    "offsets strings": ("data_offsets", ["a", 1]),
    "offsets past the end": ("data_offsets", [0, 10**12]),
    "offsets missing": ("data_offsets", KeyError),
}


@pytest.mark.parametrize("tensor", ["d2t", "t2d", "layers.0.self_attn.q_proj.weight", "fc.weight", "norm.weight"])
def test_every_tensor_entry_mutated(tmp_path, weights, tensor):
    for label, (key, value) in ENTRY_MUTATIONS.items():

        def edit(header, key=key, value=value):
            if value is KeyError:
                del header[tensor][key]
            else:
                header[tensor][key] = value
            return header

        rep = run(tmp_path, speculators_config(), rewritten(weights, edit))
        assert any(tensor in f.field or f.field == "model.safetensors" for f in rep.errors), (label, rep.ids())
    for entry in (5, [], "x", None):
        rep = run(tmp_path, speculators_config(), rewritten(weights, lambda h, e=entry: {**h, tensor: e}))
        assert any(f.field == tensor for f in rep.errors), (entry, rep.ids())


def test_headers_that_are_not_objects(tmp_path, weights):
    for header in ([], "x", 5, {"__metadata__": "x"}):
        rep = run(tmp_path, speculators_config(), rewritten(weights, lambda h, header=header: header))
        assert [f.field for f in rep.errors] == ["model.safetensors"], (header, rep.ids())


def test_a_file_cut_anywhere(tmp_path, weights):
    (n,) = struct.unpack("<Q", weights[:8])
    for size in (0, 4, 8, 9, 8 + n // 2, 8 + n, 8 + n + 1, len(weights) // 2, len(weights) - 1):
        rep = run(tmp_path, speculators_config(), weights[:size])
        assert [(f.id, f.field) for f in rep.errors] == [("files.unreadable", "model.safetensors")], size


def test_json_nested_past_any_limit_is_a_finding_naming_the_file(tmp_path, weights):
    """Issue 28: a config.json or a safetensors header nested 100,000 levels deep (Python's JSON reader raises
    RecursionError near 1,000) is a finding on that file, never a crash."""
    deep = "[" * 100_000 + "]" * 100_000
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ' + deep + "}")
    (d / "model.safetensors").write_bytes(weights)
    rep = check(d, VERIFIER)
    assert [(f.field, f.message) for f in rep.errors] == [
        ("config.json", f"{d / 'config.json'}: not valid JSON (JSON nested more than 64 levels deep)")
    ]
    header = ('{"x": ' + deep + "}").encode()
    rep = run(tmp_path, speculators_config(), struct.pack("<Q", len(header)) + header)
    assert [f.field for f in rep.errors] == ["model.safetensors"], rep.ids()
    assert "header refused (JSON nested more than 64 levels deep)" in rep.errors[0].message

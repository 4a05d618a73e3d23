"""The package in layers: every import of a draftpipe module points down, sits at the top of its file, and each
module imports alone; what the workflow imports when it is parsed pulls in no ML library.

Layers (a module may import only modules of lower layers):

0. base, standard library only: atomic I/O and caches (``io``), the results layout (``layout``), quality gates,
   the tokenizer gate, GPU locks, progress lines.
1. formats: chat templates and their rendering, hidden-state shards, provenance manifests, prompt sources, rank
   arithmetic and the torchrun launcher, a verifier's config and GGUF conversion, vocab maps.
2. set-up and integrity: config checks, the vLLM engine's settings, prompt fingerprints, the plan, shard
   integrity and quarantine, the stage store, the vLLM hidden-state connector.
3. stages: completions, draft training, hidden-state extraction, the job runtime.
4. checks: the compatibility checker, speculative decoding, ``python -m draftpipe.verify``.
5. the benchmark.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "draftpipe"

LAYERS = {
    "io": 0, "layout": 0, "gates": 0, "gpus": 0, "progress": 0, "attention": 0, "tokenizer_check": 0,
    "chat": 1, "hidden_states": 1, "provenance": 1, "prompts": 1, "ranks": 1, "verifier": 1, "vocab": 1,
    "config": 2, "engine": 2, "fingerprint": 2, "integrity": 2, "plan": 2, "stage": 2, "vllm_connector": 2,
    "completions": 3, "draft": 3, "extract": 3, "runtime": 3,
    "compat": 4, "spec_decode": 4, "verify": 4,
    "bench": 5,
}  # fmt: skip

HEAVY = ("torch", "vllm", "transformers", "speculators", "safetensors", "numpy", "pandas")


def modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def package_imports(module: str) -> list[tuple[int, str, bool]]:
    """``(line, imported draftpipe module, at the top of the file)`` of every draftpipe import in ``module``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "draftpipe":
            names = [node.module.split(".")[1]] if "." in node.module else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("draftpipe.")]
        found += [(node.lineno, name, id(node) in top) for name in names]
    return found


def test_every_module_has_a_layer():
    assert sorted(LAYERS) == modules()


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_imports_point_down_from_the_top_of_the_file(module):
    wrong = [
        f"draftpipe/{module}.py:{line} imports {target} (layer {LAYERS[target]}, not below {LAYERS[module]})"
        for line, target, _ in package_imports(module)
        if LAYERS[target] >= LAYERS[module]
    ]
    buried = [
        f"draftpipe/{module}.py:{line} imports {target} inside a block"
        for line, target, at_top in package_imports(module)
        if not at_top
    ]
    assert wrong + buried == []


def test_the_layer_test_sees_upward_and_buried_imports(tmp_path, monkeypatch):
    """The check above can fail: an upward import inside a function is reported twice."""
    fake = tmp_path / "draftpipe"
    fake.mkdir()
    (fake / "io.py").write_text("import json\n\n\ndef f():\n    from draftpipe.bench import plot\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert package_imports("io") == [(5, "bench", False)]


def test_each_module_imports_alone():
    procs = {
        m: subprocess.Popen(
            [sys.executable, "-c", f"import draftpipe.{m}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for m in modules()
    }
    failed = {}
    for m, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed[m] = out[-2000:]
    assert failed == {}


def parse_time_modules() -> list[str]:
    """The draftpipe modules the Snakefile and ``rules/*.smk`` import (every parse: dry runs, cluster jobs)."""
    files = [PACKAGE.parent / "Snakefile", *sorted((PACKAGE.parent / "rules").glob("*.smk"))]
    found = set(re.findall(r"^\s*(?:from|import) draftpipe\.(\w+)", "\n".join(f.read_text() for f in files), re.M))
    return sorted(found)


def test_parsing_the_workflow_imports_no_ml_library():
    parse_time = parse_time_modules()
    assert {"config", "plan", "fingerprint"} <= set(parse_time)
    code = (
        f"import sys\nfor m in {parse_time!r}: __import__('draftpipe.' + m)\n"
        f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_command_lines_are_installed_and_answer_help():
    """`[project.scripts]` (pyproject.toml): each entry point names a function of the package, and its installed
    command (beside this interpreter, where envs/setup.sh installs the package) runs."""
    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    installed = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name.startswith("draftpipe")}
    names = [
        "draftpipe-check",
        "draftpipe-config",
        "draftpipe-convert-gguf",
        "draftpipe-spec-decode",
        "draftpipe-verify",
    ]
    assert sorted(installed) == sorted(declared) == names
    for name, target in declared.items():
        assert installed[name].value == target and callable(installed[name].load())
        proc = subprocess.run(
            [str(Path(sys.executable).parent / name), "--help"], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and proc.stdout.startswith("usage: "), (name, proc.stderr[-2000:])

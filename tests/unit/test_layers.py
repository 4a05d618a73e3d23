"""The package in layers: its folders are the layers, every import of a draftpipe module points to a folder
below its own (or stays in its folder, without a cycle), sits at the top of its file, and each module imports
alone; what the workflow imports when it is parsed pulls in no ML library.

Folders, by layer (a module may import from the folders of lower layers and from its own folder):

0. ``core``: standard library only: atomic I/O and caches, the results layout, progress lines, GPU locks and rank
   counts, quality gates, the tokenizer gate.
1. ``formats``: prompt sources, chat templates and their rendering, hidden-state shards, vocab maps, provenance
   manifests, a verifier's config and GGUF metadata.
2. ``workflow`` (config checks, prompt fingerprints, the plan), ``runtime`` (the job context, the stage store,
   the integrity of a results tree) and ``inference`` (vLLM's engine settings, the hidden-state connector); none
   of the three imports another.
3. ``stages``: the verifier's conversion, completions, hidden-state extraction, the draft (``stages/draft``).
4. ``checks``: the compatibility report, speculative decoding, ``draftpipe-verify``.
5. ``bench``: the benchmark.
6. ``publish``: the draft's model card and ``draftpipe-publish``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "draftpipe"

FOLDERS = {
    "core": 0, "formats": 1, "workflow": 2, "runtime": 2, "inference": 2, "stages": 3, "checks": 4, "bench": 5,
    "publish": 6,
}  # fmt: skip

HEAVY = ("torch", "vllm", "transformers", "speculators", "safetensors", "numpy", "pandas")


def modules() -> list[str]:
    """Every module of the package as a dotted name below ``draftpipe`` (``core.io``, ``stages.draft.ranks``); a
    package's ``__main__`` (what ``python -m`` runs) is not a module to import."""
    return sorted(
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and "data" not in p.relative_to(PACKAGE).parts
    )


def _target(dotted: str, names: list[str]) -> list[str]:
    """The modules an import names: ``draftpipe.core.io`` -> ``core.io``; ``from draftpipe.core import progress``
    -> ``core.progress`` (a name that is a module of the package) or ``core`` (a name from its ``__init__``)."""
    base = dotted.split(".", 1)[1] if "." in dotted else ""
    found = []
    for name in names:
        sub = f"{base}.{name}" if base else name
        found.append(sub if (PACKAGE / (sub.replace(".", "/") + ".py")).is_file() else base)
    return found


def package_imports(module: str) -> list[tuple[int, str, bool]]:
    """``(line, imported draftpipe module, at the top of the file)`` of every draftpipe import in ``module``."""
    tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "draftpipe":
            names = _target(node.module, [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            names = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("draftpipe.")]
        found += [(node.lineno, name, id(node) in top) for name in names]
    return found


def folder(module: str) -> str:
    return module.split(".")[0]


def test_every_module_is_in_a_layer_folder_with_a_docstring():
    assert {folder(m) for m in modules()} <= set(FOLDERS), [m for m in modules() if folder(m) not in FOLDERS]
    for sub in sorted({p.parent for p in PACKAGE.rglob("*.py") if "data" not in p.relative_to(PACKAGE).parts}):
        init = sub / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), f"{init}: no docstring"


@pytest.mark.parametrize("module", modules())
def test_imports_point_down_from_the_top_of_the_file(module):
    wrong = [
        f"draftpipe/{module.replace('.', '/')}.py:{line} imports {target} "
        f"(folder {folder(target)}, layer {FOLDERS[folder(target)]}; not below {folder(module)}, "
        f"layer {FOLDERS[folder(module)]})"
        for line, target, _ in package_imports(module)
        if folder(target) != folder(module) and FOLDERS[folder(target)] >= FOLDERS[folder(module)]
    ]
    buried = [
        f"draftpipe/{module.replace('.', '/')}.py:{line} imports {target} inside a block"
        for line, target, at_top in package_imports(module)
        if not at_top
    ]
    assert wrong + buried == []


def test_imports_within_a_folder_have_no_cycle():
    nodes = set(modules())
    graph = {m: {t for _, t, _ in package_imports(m) if t in nodes} for m in nodes}
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join((*path, m))
        if m not in done:
            for t in sorted(graph[m]):
                visit(t, (*path, m))
            done.add(m)

    for m in sorted(graph):
        visit(m, ())


def test_the_layer_test_sees_upward_and_buried_imports(tmp_path, monkeypatch):
    """The checks above can fail: an upward import inside a function is reported twice, and a module outside the
    layer folders is named."""
    fake = tmp_path / "draftpipe"
    (fake / "core").mkdir(parents=True)
    (fake / "bench").mkdir()
    (fake / "core" / "io.py").write_text("import json\n\n\ndef f():\n    from draftpipe.bench.benchmark import plot\n")
    (fake / "bench" / "benchmark.py").write_text("")
    (fake / "loose.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert package_imports("core.io") == [(5, "bench.benchmark", False)]
    with pytest.raises(AssertionError, match="loose"):
        test_every_module_is_in_a_layer_folder_with_a_docstring()
    with pytest.raises(AssertionError, match="layer 5; not below core"):
        test_imports_point_down_from_the_top_of_the_file("core.io")


def test_each_module_imports_alone():
    """Each module in a fresh interpreter; a few at a time (twice this process's cores), not all ~70 at once: many
    import torch, vLLM or speculators (hundreds of MB each), and another test may be running a pipeline beside."""
    from concurrent.futures import ThreadPoolExecutor

    def imports(m: str) -> str | None:
        proc = subprocess.run(
            [sys.executable, "-c", f"import draftpipe.{m}"], capture_output=True, text=True, timeout=300
        )
        return None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-2000:]

    with ThreadPoolExecutor(2 * len(os.sched_getaffinity(0))) as pool:
        results = dict(zip(modules(), pool.map(imports, modules())))
    assert {m: out for m, out in results.items() if out is not None} == {}


def parse_time_modules() -> list[str]:
    """The draftpipe modules the Snakefile and ``rules/*.smk`` import (every parse: dry runs, cluster jobs)."""
    files = [PACKAGE.parent / "Snakefile", *sorted((PACKAGE.parent / "rules").glob("*.smk"))]
    found = set(re.findall(r"^\s*(?:from|import) draftpipe\.([\w.]+)", "\n".join(f.read_text() for f in files), re.M))
    return sorted(found)


def test_parsing_the_workflow_imports_no_ml_library():
    parse_time = parse_time_modules()
    assert {"workflow.config", "workflow.plan", "workflow.fingerprint"} <= set(parse_time)
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
        "draftpipe-publish",
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


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def oversized(package: Path) -> list[str]:
    """Modules of more than :data:`MAX_MODULE_LINES` lines and functions (docstring included) of more than
    :data:`MAX_FUNCTION_LINES`, as ``path:line name (N lines)``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if "data" in path.relative_to(package).parts:
            continue
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(package.parent)} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_module_over_600_lines_and_no_function_over_80(tmp_path):
    assert oversized(PACKAGE) == []
    # the check can fail: a long function in a long module is named twice
    fake = tmp_path / "draftpipe" / "core"
    fake.mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_MODULE_LINES))
    (fake / "big.py").write_text(f"def f():\n{body}")
    assert oversized(tmp_path / "draftpipe") == [
        f"draftpipe/core/big.py ({MAX_MODULE_LINES + 1} lines)",
        f"draftpipe/core/big.py:1 f ({MAX_MODULE_LINES + 1} lines)",
    ]

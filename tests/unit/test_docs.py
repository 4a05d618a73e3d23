"""The documentation: the configuration reference generated from the schema holds every key, the README stays
short and gives the site its quick start, and every page of docs/ is in the site's navigation."""

from __future__ import annotations

import re

import yaml
from conftest import REPO

from draftpipe.workflow.reference import load_schema, render_config_reference, schema_keys, type_text


def test_the_config_reference_has_a_row_for_every_schema_key_with_its_default_and_description():
    schema = load_schema()
    page = render_config_reference(schema)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", page, flags=re.M)}
    keys = [key for key, _ in schema_keys(schema)]
    assert len(keys) > 100 and set(keys) == set(rows)
    assert len(rows) == len(re.findall(r"^\| `", page, flags=re.M))  # one row per key
    for key, sub in schema_keys(schema):
        assert sub.get("description"), f"{key} has no description in config.schema.yaml"
        assert " ".join(sub["description"].split()).replace("|", "\\|") in rows[key], key
    assert rows["draft.epochs"].startswith("| `draft.epochs` | integer; >= 1 | `10` |")
    assert rows["verifier.path"].startswith("| `verifier.path` | string | required |")
    assert "| `prompts.sources[].dataset` | string |" in page  # a key of each source of a list
    assert type_text({"type": ["integer", "null"], "enum": [1, None]}) == "integer \\| null; one of `1`, `null`"


def test_the_readme_is_short_and_the_site_takes_its_quick_start_from_it():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    index = (REPO / "docs" / "index.md").read_text()
    for section in ("intro", "quickstart", "default"):
        assert f'--8<-- "README.md:{section}"' in index
        start, end = readme.index(f"--8<-- [start:{section}]"), readme.index(f"--8<-- [end:{section}]")
        assert start < end
    quick = readme[readme.index("--8<-- [start:quickstart]") : readme.index("--8<-- [end:quickstart]")]
    assert "bash envs/setup.sh && .venv/bin/snakemake results/draft/model.safetensors --cores all" in quick
    assert "bash envs/setup.sh smollm2 trackers && .venv/bin/python -m pytest -q tests" in quick
    # the test command is what CI runs, word for word (CI adds its pytest options through PYTEST_ADDOPTS)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "bash envs/setup.sh smollm2 trackers && .venv/bin/python -m pytest -q tests" in ci
    for link in re.findall(r"\]\(([^)#:]+)\)", readme):  # relative links resolve in the repository
        assert (REPO / link).exists(), link


def test_every_page_is_in_the_navigation_and_every_nav_entry_exists():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(nav):
        for entry in nav:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                yield from pages(value) if isinstance(value, list) else [value]

    nav = set(pages(config["nav"]))
    written = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    generated = {"reference/config.md", "reference/cli.md", "changelog.md"}  # docs/hooks/generated.py
    assert nav == written | generated


def test_the_site_loads_nothing_from_the_network():
    """Opened from ``site/index.html`` with no network, the site's search runs through the iframe-worker shim shipped
    in ``docs/assets`` (the offline plugin would load it from unpkg.com; without it the search stays at
    "Initializing search" in a browser, which refuses web workers from ``file://``), and the theme asks Google Fonts
    for nothing."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert "offline" in config["plugins"]
    shims = [p for p in config["extra"]["polyfills"] if "iframe-worker" in p]
    assert shims and not any(p.startswith(("http:", "https:", "//")) for p in shims)
    for shim in shims:
        text = (REPO / "docs" / shim).read_text()
        assert "postMessage" in text and "importScripts" in text  # the shim, not a placeholder
    assert (REPO / "docs" / "assets" / "iframe-worker" / "LICENSE").read_text().startswith("Copyright")
    assert config["theme"]["font"] is False


def test_the_test_modules_have_distinct_names():
    """``pytest tests`` (the README's test command) imports each test module by its file name (pytest's default
    ``prepend`` import mode, which the unit modules that import each other need): two folders holding a module of
    one name fail the collection ("import file mismatch")."""
    names = [p.name for p in (REPO / "tests").glob("*/test_*.py")]
    assert len(names) > 40 and sorted({n for n in names if names.count(n) > 1}) == []

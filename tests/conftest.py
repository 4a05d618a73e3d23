"""Shared fixtures: the repository root, the embedded default verifier converted once per session, the embedded
default built once per test run (no test writes into that build: tests that change it work in a copy; under
``pytest -n N`` the workers share it, :func:`once`), a copy of it benchmarked once, and the ``unit`` / ``e2e``
marker of every test from its folder. Under ``pytest -n N`` each worker gets an equal part of the machine's cores
(:data:`CORES`: Snakemake's ``--cores``, the OpenMP threads and the vLLM engines' core binding of its tests), and
under ``--dist loadfile`` a test module runs on one worker, whose module-scoped builds it shares, the modules
handed out longest first (:func:`pytest_xdist_make_scheduler`)."""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO / "draftpipe" / "data" / "stories260K" / "stories260K.gguf"
TINYSTORIES = REPO / "draftpipe" / "data" / "prompts" / "tinystories_evaluation_prompts.jsonl"


WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
#: Cores for this process's tests: all the process may use, or under ``pytest -n N`` an N-th of them (at least 1).
#: Every workflow run of the tests asks Snakemake for this many (``--cores``), so two workers' jobs never run more
#: threads than the machine has: two draft trainings of 2 OpenMP threads each on 2 cores trained ~40 times slower.
#: Runs whose bytes are compared must use the same count (the hidden states and the draft depend on it at the last
#: bit); the workers of one run all do.
CORES = max(1, len(os.sched_getaffinity(0)) // WORKERS)


def pytest_configure(config):
    """On a worker of ``pytest -n N`` (pytest-xdist, ``PYTEST_XDIST_WORKER=gw<i>``) with a core per worker, give the
    worker's own torch and everything it starts :data:`CORES` OpenMP threads (``OMP_NUM_THREADS``), and bind the
    OpenMP threads of the vLLM engines its tests start to core ``i`` (``VLLM_CPU_OMP_THREADS_BIND``, unless set):
    vLLM's ``auto`` binding gives every engine of the machine the same cores, so two workers' engines would share
    one core of two while the other idles."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0))
    if worker.startswith("gw") and 1 < WORKERS <= len(cores):
        os.environ["OMP_NUM_THREADS"] = str(CORES)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))


#: Seconds each module took on CI (2 cores, fixtures it built first included), for the order in which ``--dist
#: loadfile`` hands modules out; a module not listed counts 60 s (end-to-end) or 5 s (unit: they fill the workers'
#: last minutes). A wrong value costs balance between the workers, never a result.
MODULE_SECONDS = {
    "e2e/test_faults.py": 841,
    "e2e/test_pipeline.py": 720,
    "e2e/test_draft_training.py": 685,
    "e2e/test_streaming.py": 380,
    "e2e/test_slurm.py": 379,
    "e2e/test_architectures.py": 341,
    "e2e/test_serving.py": 233,
    "e2e/test_smollm2.py": 179,
    "e2e/test_extract_vllm.py": 164,
    "e2e/test_chat_data.py": 120,
    "e2e/test_interruptions.py": 120,
    "unit/test_layers.py": 70,
    "unit/test_loss.py": 65,
    "unit/test_io.py": 40,
    "unit/test_hub_sources.py": 30,
    "unit/test_tokenizer_gate.py": 16,
}


def module_seconds(scope: str) -> int:
    """:data:`MODULE_SECONDS` of a module given by its path (``tests/<folder>/<file>``)."""
    key = "/".join(Path(scope).parts[-2:])
    return MODULE_SECONDS.get(key, 5 if key.startswith("unit/") else 60)


#: The builds made once per test run (:func:`once`) and, for each, what else it is made from.
ONCE_BUILDS = {"built": {"built"}, "benched": {"built", "benched"}, "one_epoch": {"built", "one_epoch"}}


def once_builds_of(module: Path) -> set[str]:
    """The builds of :data:`ONCE_BUILDS` a test module's tests or fixtures take as arguments (read from its text)."""
    names = set()
    for args in re.findall(r"^\s*def \w+\(([^)]*)\)", module.read_text(), flags=re.M):
        for name in set(re.findall(r"\w+", args)) & ONCE_BUILDS.keys():
            names |= ONCE_BUILDS[name]
    return names


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``, hand each idle worker the longest module left (:data:`MODULE_SECONDS`; the
    longest-processing-time rule) and only when it starts its module's last test, instead of the modules in file
    order, two ahead; and, while a build made once per run (:func:`once`) that a module needs is being made by
    another worker, a module that does not need it where one is left (rather than a worker waiting minutes on the
    build's lock)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    root = config._tmp_path_factory.getbasetemp()  # the workers' basetemps are its folders (once()'s root)

    class LongestModuleFirst(LoadFileScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self.asked: set[str] = set()  # the builds the modules given out so far need

        def _assign_work_unit(self, node) -> None:
            needs = {scope: once_builds_of(config.rootpath / scope) for scope in self.workqueue}
            pending = {name for name in self.asked if not (root / f"{name}.done").is_file()}
            free = [scope for scope in self.workqueue if not needs[scope] & pending] or list(self.workqueue)
            longest = max(free, key=module_seconds)
            self.asked |= needs[longest]
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:  # a worker runs a test once it has the next
                self._assign_work_unit(node)

    return LongestModuleFirst(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark each test ``unit`` or ``e2e`` after its folder (``tests/unit``, ``tests/e2e``)."""
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in ("unit", "e2e"):
            item.add_marker(kind)


def once(tmp_path_factory, name: str, make) -> Path:
    """``make(folder)`` (``folder`` is a new empty directory; ``make`` returns the result's path) once per test run:
    in this session's temporary directory, or, on a worker of ``pytest -n N``, in the run's directory common to the
    workers, made by the first worker that asks while the others wait on a lock and then take its result. A failed
    ``make`` leaves no result: the next worker to ask tries again, in a directory of its own."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent  # pytest-N/, holding each worker's popen-gw<i>/
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = root / f"{name}.done"
        if not done.is_file():
            done.write_text(str(make(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root)))))
        return Path(done.read_text())


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory) -> Path:
    """stories260K as a Hugging Face directory with head_dim 32 (what the `verifier` rule builds)."""
    import torch

    from draftpipe.stages.verifier import convert_gguf

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("verifier") / "stories260K"
    convert_gguf(GGUF, out, max_position_embeddings=512)
    return out


def tree_state(work: Path) -> dict[str, tuple[int, int]]:
    """``{path: (size, mtime_ns)}`` of every file of a workflow copy outside ``.snakemake/`` (where a dry run keeps
    its locks and the workflow its caches)."""
    return {
        str(p.relative_to(work)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in work.rglob("*")
        if p.is_file() and not p.is_symlink() and ".snakemake" not in p.relative_to(work).parts
    }


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """The embedded default built to the draft once per session in a copy of the workflow (uninterrupted run).

    No test may change it (a test that runs jobs or edits files works in :func:`helpers.workflow.copy_build`, and
    config variants are written beside it): at the end of the session every file must have the size and mtime it
    had after the build, else the fixture fails naming the files."""
    from helpers.workflow import copy_workflow, small_extraction_calls, snakemake

    def build(folder: Path) -> Path:
        work = copy_workflow(folder / "workflow")
        small_extraction_calls(work)  # the fault test compares bytes with this run: the same vLLM calls
        proc = snakemake(
            work, "results/draft/model.safetensors", "results/prompts/stats.json", "results/completions/stats.json"
        )
        (work.parent / "build.out").write_text(proc.stdout + proc.stderr)  # what the console showed
        return work

    work = once(tmp_path_factory, "built", build)
    before = tree_state(work)
    yield work
    after = tree_state(work)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        pytest.fail(f"tests changed the session build {work}: {changed[:20]}")


@pytest.fixture(scope="session")
def benched(built, tmp_path_factory) -> Path:
    """A copy of the session build with its offline vLLM benchmark (``bench_run``, and the compat report it needs)
    run once, shared by the tests of the benchmark and of the served sweep: each works in a copy of it
    (:func:`helpers.workflow.copy_build`), so the measurement is made once per session, not once per test."""
    from helpers.workflow import copy_build, snakemake

    def bench(folder: Path) -> Path:
        work = copy_build(built, folder / "wf")
        snakemake(work, "results/bench/summary.json")
        return work

    return once(tmp_path_factory, "benched", bench)


@pytest.fixture(scope="session")
def one_epoch(built, tmp_path_factory) -> Path:
    """A copy of the session build whose draft is trained again for one epoch (``draft.epochs: 1``,
    :func:`helpers.workflow.one_epoch`; the shards and every other artifact are the session build's), made once per
    run: the reference of the tests that train a draft again in a way that must give its bytes (a kill and a
    resume) or its values (the streamed hidden states), for a quarter of the four epochs' training."""
    from helpers.workflow import copy_build, one_epoch_config, planned_jobs, snakemake

    def train(folder: Path) -> Path:
        work = copy_build(built, folder / "wf")
        cfg = one_epoch_config(work)
        assert planned_jobs(work, "--configfile", cfg) == {"draft": 1}  # nothing upstream reruns
        snakemake(work, "results/draft/model.safetensors", "--configfile", cfg)
        return work

    return once(tmp_path_factory, "one_epoch", train)


TINY_CONFIGS = REPO / "tests" / "data" / "verifiers"


@pytest.fixture(scope="session")
def tiny_verifier(verifier_dir, tmp_path_factory):
    """``tiny_verifier(name)``: the verifier of ``tests/data/verifiers/<name>.json`` with random weights (seed 0)
    and stories260K's tokenizer, built once per session; ``"stories260K"`` is the embedded default."""
    from helpers.verifiers import build_random_verifier

    built: dict[str, Path] = {"stories260K": verifier_dir}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_random_verifier(
                TINY_CONFIGS / f"{name}.json", tmp_path_factory.mktemp("tiny") / name, verifier_dir
            )
        return built[name]

    return get

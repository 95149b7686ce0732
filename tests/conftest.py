"""Shared pytest fixtures, and how the test command spreads over the CPU's cores.

Models are loaded at most once per session: the tiny random pair (milliseconds) and the
built-in 0.5B/1.5B pair in fp32 (about 8 GB of memory; only for tests marked ``slow``).

The test command runs on pytest-xdist workers (``-n auto --dist loadfile`` in pyproject.toml:
each file, and so each notebook's cells, stays on one worker). :func:`pytest_xdist_auto_num_workers`
gives one worker per core, as many as the memory holds, and each worker (with the notebook kernels
and Dask workers it starts) gets an equal share of the cores as torch threads: a decoding step feeds
1 to 32 tokens, where a second torch thread buys nothing on a 2-core CPU and a second worker doubles
the throughput. The heavy files (notebooks, the real-model and study tests) are handed out first,
so that no worker is left with a long one at the end.
"""

from __future__ import annotations

import os

# The tests never use the Hugging Face Hub; offline mode makes a failed lookup (a deliberately
# unknown model name) fail at once instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORKER_MEMORY_GB = 9.0  # a worker may hold the built-in pair in fp32 while a notebook kernel runs beside it
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:  # before torch is imported, so that this process and its children read it
    _threads = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_name, _threads)

import pytest  # noqa: E402

from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET, prepare_builtin
from specviz.models.loading import load_pair
from specviz.models.types import ModelPair
from specviz.models.tiny import tiny_pair as make_tiny_pair

if _WORKERS > 1:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session", name="tiny_pair")
def tiny_pair_fixture() -> ModelPair:
    """The tiny random target/draft pair of :func:`specviz.models.tiny_pair` (fp32)."""
    return make_tiny_pair()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An empty specviz cache for the whole module (SPECVIZ_CACHE points at it)."""
    root = tmp_path_factory.mktemp("cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECVIZ_CACHE", str(root))
    yield root
    patch.undo()


@pytest.fixture(scope="module")
def real_pair_fp32() -> ModelPair:
    """The built-in Qwen2.5-Coder 1.5B (target) / 0.5B (draft) pair in fp32 (about 8 GB), for
    one test module at a time: the notebooks' kernels that nbval starts later need the memory.

    Skipped when the model data packages are not installed, except under ``CI=true``,
    where a missing model is a failure.
    """
    try:
        return load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32")
    except FileNotFoundError as exc:
        if _in_ci():
            pytest.fail(f"CI=true but the built-in models cannot be loaded: {exc}")
        pytest.skip(f"built-in models not installed: {exc}")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at most as many as the available memory holds."""
    import psutil

    cores = os.cpu_count() or 1
    fits = int(psutil.virtual_memory().available / 1e9 // WORKER_MEMORY_GB)
    return max(1, min(cores, fits))


HEAVY_FILES = ("test_real_models.py", "test_study.py", "test_work.py", "test_browser.py")


def pytest_collection_modifyitems(config, items):
    """Notebooks and the heavy test files first (a stable sort: each file's order is kept),
    and the built-in pair's fp32 cache entries prepared before any of them runs.

    A notebook kernel that loads a model first on a fresh cache would print the conversion's
    progress on stderr, an output its committed copy does not have (nbval fails the cell), and
    which notebook comes first depends on how the files are spread over the workers. Each
    worker prepares the entries here (the cache's lock lets one convert while the other waits;
    nothing happens when they are cached)."""
    def light(item) -> bool:
        return not (item.path.suffix == ".ipynb" or item.path.name in HEAVY_FILES)

    items.sort(key=light)
    if items and not light(items[0]):
        for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
            try:
                prepare_builtin(name, "fp32")
            except (FileNotFoundError, ValueError):  # not installed: the tests that need them say so
                pass

"""Shared pytest fixtures.

Models are loaded at most once per session: the tiny random pair (milliseconds) and the
built-in 0.5B/1.5B pair in fp32 (about 8 GB of memory; only for tests marked ``slow``).
"""

from __future__ import annotations

import os

# The tests never use the Hugging Face Hub; offline mode makes a failed lookup (a deliberately
# unknown model name) fail at once instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
from specviz.models.loading import load_pair
from specviz.models.types import ModelPair
from specviz.models.tiny import tiny_pair as make_tiny_pair


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session", name="tiny_pair")
def tiny_pair_fixture() -> ModelPair:
    """The tiny random target/draft pair of :func:`specviz.models.tiny_pair` (fp32)."""
    return make_tiny_pair()


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

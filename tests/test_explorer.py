"""Explorer logic without a browser: settings, drafters, caching and what the widget shows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specviz.draft.model import ChainDrafter, DynamicTreeDrafter, TreeDrafter
from specviz.draft.lookahead import LookaheadDrafter
from specviz.draft.ngram import NgramTrieDrafter
from specviz.render.explorer import (
    STRATEGIES,
    Explorer,
    ExplorerSettings,
    build_drafter,
    run_settings,
    strategy_spec,
    verifier_for,
)

PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.fixture(autouse=True)
def one_thread():
    # tiny forward passes are ~100x slower with an oversubscribed thread pool on a busy 2-core box
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _settings(**kw) -> ExplorerSettings:
    return ExplorerSettings(prompt="def add(a, b):", max_new_tokens=8, **kw)


def test_settings_validate():
    with pytest.raises(ValueError, match="strategy"):
        _settings(strategy="beam")
    with pytest.raises(ValueError, match="depth"):
        _settings(depth=0)
    with pytest.raises(ValueError, match="temperature"):
        _settings(temperature=-1.0)
    with pytest.raises(ValueError, match="prompt"):
        ExplorerSettings(prompt="  ")


def test_canonical_settings_share_cache_entries():
    assert _settings(strategy="chain", width=3, budget=9).canonical() == \
        _settings(strategy="chain", width=5, budget=40).canonical()
    assert _settings(strategy="static shape", width=2, depth=2, budget=50).canonical().budget == 6
    dynamic = _settings(strategy="dynamic", budget=5)
    assert dynamic.canonical() != replace(dynamic, budget=6).canonical()


def test_build_drafter_and_verifier(tiny_pair):
    kinds = {"chain": ChainDrafter, "static shape": TreeDrafter, "dynamic": DynamicTreeDrafter,
             "n-gram": NgramTrieDrafter, "lookahead": LookaheadDrafter}
    for strategy in STRATEGIES:
        assert isinstance(build_drafter(_settings(strategy=strategy), tiny_pair), kinds[strategy])
    names = {strategy: strategy_spec(_settings(strategy=strategy, width=3, depth=2, budget=5)).name
             for strategy in STRATEGIES}
    assert names == {"chain": "chain-k2", "static shape": "tree-k3-d2-n5", "dynamic": "dynamic-k3-d2-n5",
                     "n-gram": "ngram-trie-n3-d2-b5-m3", "lookahead": "lookahead-w3-n3-g5"}
    assert verifier_for(_settings()) == "greedy"
    assert verifier_for(_settings(strategy="chain", temperature=0.7)) == "chain"
    assert verifier_for(_settings(strategy="dynamic", temperature=0.7)) == "topk"


def test_run_settings_reports_steps(tiny_pair):
    seen = []
    settings = _settings(strategy="static shape", depth=2, budget=4)
    result = run_settings(settings, tiny_pair, on_step=seen.append)
    assert len(seen) == len(result.steps) > 0
    assert all(s.tree.budget <= 4 for s in result.steps)


def _points(out) -> int:
    spec = out.outputs[0]["data"][PLOTLY_MIME]
    return sum(len(t["x"]) for t in spec["data"] if "markers" in t.get("mode", ""))


def test_explorer_updates_and_caches(tiny_pair):
    ex = Explorer(tiny_pair, _settings(strategy="dynamic", width=2, depth=2, budget=32), background=False)
    assert ex.computations == 1
    before = _points(ex.tree_out)
    assert "acceptance length" in ex.stats.value
    assert PLOTLY_MIME in ex.steps_out.outputs[0]["data"]
    ex.depth.value = 3
    assert ex.computations == 2 and _points(ex.tree_out) != before
    ex.depth.value = 2  # seen before: drawn from the cache
    assert ex.computations == 2 and _points(ex.tree_out) == before
    ex.strategy.value = "chain"
    assert ex.width.disabled and ex.budget.disabled
    ex.width.value = 5  # a chain ignores the width: no new model calls
    assert ex.computations == 3
    ex.step.value = ex.step.max
    assert f"step {ex.step.max}" in ex.stats.value
    ex.show_mask.value = True
    assert PLOTLY_MIME in ex.mask_out.outputs[0]["data"]


def test_explorer_lookahead_shows_its_window_and_two_branch_mask(tiny_pair):
    ex = Explorer(tiny_pair, _settings(strategy="lookahead", width=3, depth=2, budget=4), background=False)
    assert (ex.width.description, ex.depth.description, ex.budget.description) == \
        ("window W", "guess N-1", "guesses G")
    result = next(iter(ex.results.values()))
    assert result.drafter == "lookahead(w=3,n=3,g=4)" and result.steps[0].side_tokens == 3
    assert len(ex.tree_out.outputs) == 2  # the guess tree and the step's window and guesses
    ex.show_mask.value = True
    annotations = [a["text"] for a in ex.mask_out.outputs[0]["data"][PLOTLY_MIME]["layout"]["annotations"]]
    assert any(a.startswith("lookahead branch") for a in annotations)
    ex.strategy.value = "dynamic"
    assert ex.width.description == "width (top-k)" and len(ex.tree_out.outputs) == 1


def test_explorer_background_thread(tiny_pair):
    ex = Explorer(tiny_pair, _settings(strategy="chain", depth=2), background=True)
    ex.depth.value = 3
    assert ex.wait(timeout=60)
    assert ex.computations == 2
    assert ex.progress.layout.visibility == "hidden" and ex.status.value == ""
    assert "chain(k=3)" in ex.stats.value


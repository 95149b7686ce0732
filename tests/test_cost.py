"""Tests for specviz.bench.cost: cost curves, the step-cost model and timed runs (tiny models)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from specviz.draft.model import ChainDrafter
from specviz.tree.sequoia import expected_tokens
from specviz.tree.shapes import chain, expansion
from specviz.bench.cost import (CostModel, compare_runs, forward_cost_curve, predicted_speedup, predicted_wall_s,
                                run_counts, sequoia_plan, speed_summary, timed_run, tree_step_cost)

COSTS = CostModel(((1, 500.0), (8, 1400.0), (64, 4700.0)), ((1, 180.0), (8, 490.0), (64, 1500.0)))


def test_cost_curve_of_a_tiny_model(tiny_pair):
    curve = forward_cost_curve(tiny_pair.target, [1, 4], prefix_len=8, warmup=0, repeats=2)
    assert list(curve["n_tokens"]) == [1, 4]
    assert (curve["min_ms"] > 0).all() and (curve["min_ms"] <= curve["median_ms"]).all()
    assert set(curve["prefix_len"]) == {8}
    with pytest.raises(ValueError, match="sizes"):
        forward_cost_curve(tiny_pair.target, [0])
    with pytest.raises(ValueError, match="prefix_len"):
        forward_cost_curve(tiny_pair.target, [1], prefix_len=-1)
    prefill = forward_cost_curve(tiny_pair.target, [5, 30], prefix_len=0, warmup=0, repeats=1)  # into an empty cache
    assert list(prefill["n_tokens"]) == [5, 30] and set(prefill["prefix_len"]) == {0}
    assert (prefill["min_ms"] > 0).all()


def test_predicted_wall_prices_prefill_drafts_and_verification():
    rows = pd.DataFrame({"prompt_tokens": [101, 41, 101], "steps": [10, 4, 128], "drafted": [30, 0, 0],
                         "draft_s": [2.0, 0.0, math.nan]})
    prefill = [(20, 100.0), (100, 900.0)]
    wall = predicted_wall_s(rows, COSTS, prefill)
    # row 0: prefill of 100 tokens, its draft time, 10 verifications of 4 nodes
    assert wall[0] == pytest.approx(0.9 + 2.0 + 10 * COSTS.target_s(4))
    # row 1: prefill of 40 tokens (between the points), nothing drafted: one node per step
    assert wall[1] == pytest.approx(0.1 + 0.8 * 20 / 80 + 4 * COSTS.target_s(1))
    assert math.isnan(wall[2])  # a peer: no draft time of its own
    with pytest.raises(ValueError, match="prefill_ms"):
        predicted_wall_s(rows, COSTS, [(100, 1.0), (20, 2.0)])


def test_cost_model_interpolates_and_extrapolates():
    assert COSTS.target_s(1) == pytest.approx(0.5)
    assert COSTS.target_s(4.5) == pytest.approx(0.95)
    assert COSTS.target_s(120) == pytest.approx(4.7 + 56 * 3.3 / 56)
    assert COSTS.draft_s(8) == pytest.approx(0.49)
    with pytest.raises(ValueError, match="increasing"):
        CostModel(((4, 1.0), (1, 2.0)), ((1, 1.0),))


def test_step_cost_follows_the_tree_drafter():
    # chain of 4: the bonus token, then levels 1..3 (the leaf is never fed)
    c = tree_step_cost(chain(4), COSTS)
    assert c.draft_forwards == 4
    assert c.draft_s == pytest.approx(4 * 0.18)
    assert c.verify_s == pytest.approx(COSTS.target_s(5))
    # expansion [2, 2, 1]: levels 1 (2 nodes with children) and 2 (4 nodes with children)
    c = tree_step_cost(expansion([2, 2, 1]), COSTS)
    assert c.draft_forwards == 3
    assert c.draft_s == pytest.approx(COSTS.draft_s(1) + COSTS.draft_s(2) + COSTS.draft_s(4))
    assert predicted_speedup(3.0, 1.5, COSTS) == pytest.approx(3.0 * 0.5 / 1.5)
    assert math.isnan(predicted_speedup(3.0, 0.0, COSTS))


def test_sequoia_plan_ranks_by_time_per_token():
    a = (0.7, 0.1, 0.05)
    plan = sequoia_plan(a, [1, 4, 8], [1, 2, 4], COSTS)
    assert list(plan["ms_per_token"]) == sorted(plan["ms_per_token"])
    assert not ((plan["budget"] == 8) & (plan["max_depth"] == 1)).any()  # 8 nodes do not fit one level of 3
    row = plan[(plan["budget"] == 4) & (plan["max_depth"] == 4)].iloc[0]
    assert row["expected_tau"] == pytest.approx(expected_tokens(chain(4), a))
    with pytest.raises(ValueError, match="fits"):
        sequoia_plan(a, [64], [1], COSTS)


def test_timed_runs(tiny_pair):
    plain = timed_run(tiny_pair.target, None, "def f(x):", max_new_tokens=6)
    assert plain.method == "plain" and plain.steps == plain.new_tokens == len(plain.output_ids)
    assert plain.tau == 1.0 and plain.wall_s > 0
    spec = timed_run(tiny_pair.target, ChainDrafter(tiny_pair.draft, 3), "def f(x):", max_new_tokens=6)
    assert spec.output_ids == plain.output_ids  # greedy speculative decoding is lossless (fp32)
    assert spec.drafted >= spec.accepted and spec.steps <= plain.steps
    assert spec.tau == pytest.approx(spec.new_tokens / spec.steps)


def _runs() -> pd.DataFrame:
    row = dict(draft_s=0.0, verify_s=0.0, mean_nodes=1.0)
    return pd.DataFrame([
        dict(method="plain", question_id=1, new_tokens=8, wall_s=4.0, steps=8, drafted=0, accepted=0,
             output_ids=[1, 2, 3], **row),
        dict(method="chain", question_id=1, new_tokens=8, wall_s=2.0, steps=2, drafted=8, accepted=6,
             output_ids=[1, 2, 3], draft_s=0.4, verify_s=1.2, mean_nodes=5.0),
        dict(method="plain", question_id=2, new_tokens=6, wall_s=2.0, steps=6, drafted=0, accepted=0,
             output_ids=[4, 5], **row),
        dict(method="chain", question_id=2, new_tokens=6, wall_s=3.0, steps=3, drafted=12, accepted=3,
             output_ids=[4, 6], draft_s=0.6, verify_s=1.8, mean_nodes=5.0),
    ])


def test_compare_runs_adds_matches_and_speedups():
    runs = compare_runs(_runs())
    assert list(runs.columns)[-3:] == ["matches_plain", "tokens_per_s", "speedup"]
    assert runs["matches_plain"].tolist() == [True, True, True, False]
    assert runs["tokens_per_s"].tolist() == [2.0, 4.0, 3.0, 2.0]
    assert runs["speedup"].tolist() == [1.0, 2.0, 1.0, pytest.approx(2 / 3)]
    with pytest.raises(ValueError, match="question ids \\[2\\]"):
        compare_runs(_runs().iloc[:2].assign(question_id=[1, 2]))
    with pytest.raises(ValueError, match="wall_s"):
        compare_runs(_runs().drop(columns="wall_s"))


def test_run_counts_per_method():
    counts = run_counts(compare_runs(_runs()))
    assert list(counts.columns) == ["method", "prompts", "new_tokens", "steps", "tau", "drafted", "accepted",
                                    "acceptance_rate", "matches_plain"]
    plain, chain_ = counts.to_dict("records")
    assert plain["method"] == "plain" and plain["tau"] == 1.0 and math.isnan(plain["acceptance_rate"])
    assert chain_["tau"] == 14 / 5 and chain_["acceptance_rate"] == 9 / 20 and chain_["matches_plain"] == 0.5


def test_speed_summary_prices_the_measured_steps():
    speed = speed_summary(compare_runs(_runs()), COSTS)
    plain, chain_ = speed.to_dict("records")
    assert plain["predicted"] == 1.0 and plain["verify_curve_ms"] == pytest.approx(500.0)
    assert chain_["draft_ms"] == pytest.approx(200.0) and chain_["verify_ms"] == pytest.approx(600.0)
    assert chain_["speedup"] == pytest.approx((2.0 + 2 / 3) / 2)
    assert chain_["predicted"] == pytest.approx(predicted_speedup(14 / 5, 0.2 + COSTS.target_s(5), COSTS))

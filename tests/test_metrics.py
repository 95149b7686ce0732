"""Acceptance metrics (specviz.metrics) on hand-made traces with known answers, plus one run."""

import math

import pytest
import torch

from specviz.decode.engine import speculative_generate
from specviz.decode.records import GenerationResult, StepTrace
from specviz.draft.model import ChainDrafter
from specviz.metrics.acceptance import AcceptanceStats, per_depth_acceptance, summarize, summarize_steps, to_frame, to_records
from specviz.sampling import GREEDY
from specviz.tree.core import DraftTree
from specviz.verify.rules import Acceptance


def _step(parents, accepted_nodes, expected=0.0, drafter="d", draft_time=0.1, verify_time=0.2) -> StepTrace:
    n = len(parents)
    tree = DraftTree(torch.arange(n) + 100, torch.tensor(parents))
    acc = Acceptance(tuple(accepted_nodes), tuple(100 + i for i in accepted_nodes), 7,
                     torch.ones(n), torch.ones(n, dtype=torch.bool), "greedy", True)
    return StepTrace(0, tree, acc, torch.ones(n), expected, draft_time, verify_time, drafter, 10)


def _result(steps, drafter="d", verifier="greedy", new_tokens=None, wall=1.0) -> GenerationResult:
    n_new = new_tokens if new_tokens is not None else sum(s.acceptance.tau for s in steps)
    return GenerationResult((1, 2), tuple(range(n_new)), "", tuple(steps), wall, "max_new_tokens", drafter,
                            verifier, GREEDY, 64)


CHAIN3 = [-1, 0, 1, 2]
# root -> {1, 2}; 1 -> {3, 4}; 3 -> {5}
TREE = [-1, 0, 0, 1, 1, 3]


def test_counts_rates_lengths_and_tau():
    steps = [_step(CHAIN3, [1, 2, 3], expected=2.5), _step(CHAIN3, [1], expected=1.5), _step(CHAIN3, [], expected=0.5),
             _step(TREE, [1, 3], expected=1.0)]
    stats = summarize_steps(steps)
    assert stats.n_steps == 4
    assert stats.drafted_tokens == 3 + 3 + 3 + 5
    assert stats.accepted_tokens == 3 + 1 + 0 + 2
    assert stats.acceptance_rate == pytest.approx(6 / 14)
    assert stats.accepted_per_step == pytest.approx(6 / 4)
    assert stats.tau == pytest.approx(1 + 6 / 4)
    assert stats.expected_accepted == pytest.approx((2.5 + 1.5 + 0.5 + 1.0) / 4)
    assert stats.new_tokens == 6 + 4
    assert stats.draft_time_s == pytest.approx(0.4) and stats.verify_time_s == pytest.approx(0.8)
    assert stats.strategy == "d" and stats.verifier == "greedy"


def test_per_depth_acceptance_counts_only_reachable_trials():
    # chain fully accepted: trials at depths 1-3, all successes; no depth-4 candidate
    # chain accepted 1: trials at 1 (win), 2 (loss)
    # chain accepted 0: trial at 1 (loss)
    # tree accepted 1 -> 3: depth 1 win, depth 2 win, depth 3 (node 3 has child 5) loss
    steps = [_step(CHAIN3, [1, 2, 3]), _step(CHAIN3, [1]), _step(CHAIN3, []), _step(TREE, [1, 3])]
    alpha, trials = per_depth_acceptance(steps)
    assert trials == (4, 3, 2)
    assert alpha == pytest.approx((3 / 4, 2 / 3, 1 / 2))
    # a tree accepted to a leaf offers no trial below it
    alpha, trials = per_depth_acceptance([_step(TREE, [2])])
    assert trials == (1,) and alpha == (1.0,)


def test_nothing_drafted_gives_nan_rate_not_an_error():
    stats = summarize_steps([_step([-1], []), _step([-1], [])])
    assert stats.drafted_tokens == 0 and math.isnan(stats.acceptance_rate)
    assert stats.tau == 1.0 and stats.alpha == ()
    assert math.isnan(summarize_steps([]).accepted_per_step)


def test_summarize_groups_by_drafter_and_verifier():
    a = _result([_step(CHAIN3, [1, 2])], drafter="chain", new_tokens=3, wall=2.0)
    b = _result([_step(CHAIN3, [])], drafter="chain", new_tokens=1, wall=1.0)
    c = _result([_step(TREE, [1])], drafter="tree", new_tokens=2)
    d = _result([_step(TREE, [1])], drafter="tree", verifier="topk", new_tokens=2)
    stats = summarize([a, b, c, d])
    assert [(s.strategy, s.verifier) for s in stats] == [("chain", "greedy"), ("tree", "greedy"), ("tree", "topk")]
    chain = stats[0]
    assert chain.n_sequences == 2 and chain.new_tokens == 4 and chain.wall_s == 3.0
    assert chain.tokens_per_second == pytest.approx(4 / 3)
    with pytest.raises(TypeError, match="GenerationResult"):
        summarize([a.steps[0]])


def test_records_and_frame_flatten_per_depth_columns():
    stats = summarize([_result([_step(CHAIN3, [1, 2, 3])], drafter="long"), _result([_step(CHAIN3, [])], drafter="x")])
    records = to_records(stats)
    assert records[0]["alpha_1"] == 1.0 and records[0]["alpha_3"] == 1.0
    assert records[1]["alpha_1"] == 0.0 and math.isnan(records[1]["alpha_2"])
    frame = to_frame(stats)
    assert list(frame["strategy"]) == ["long", "x"]
    assert {"acceptance_rate", "accepted_per_step", "tau", "expected_accepted", "tokens_per_second"} <= set(frame)
    assert isinstance(stats[0], AcceptanceStats)


def test_metrics_of_a_real_run_are_consistent(tiny_pair):
    result = speculative_generate(tiny_pair.target, ChainDrafter(tiny_pair.draft, 3), "def f(x):", max_new_tokens=24)
    (stats,) = summarize([result])
    assert stats.n_steps == result.n_steps and stats.new_tokens == 24
    assert stats.expected_accepted == pytest.approx(stats.accepted_per_step)  # greedy
    assert stats.drafted_tokens <= 3 * stats.n_steps
    assert 0.0 <= stats.acceptance_rate <= 1.0

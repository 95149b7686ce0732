"""Tests for specviz.decode.replay, ranks and scoring: the rank walk and the shared
dynamic replay equal the engine's replay, the tree scorer equals a plain forward, and the
aggregations follow the definitions of specviz.metrics."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from specviz.decode.engine import plain_generate, speculative_generate
from specviz.decode.ranks import draft_ranks, positional_acceptance
from specviz.decode.records import records_from_result
from specviz.decode.scoring import TreeScorer, score_rules, score_rules_along
from specviz.draft.model import DynamicTreeDrafter, TreeDrafter
from specviz.metrics.acceptance import acceptance_summary, per_depth_table, records_table, summarize_steps
from specviz.draft.ngram import NgramDrafter
from specviz.data.store import ResultStore
from specviz.sampling import SamplingConfig, make_generator
from specviz.tree.shapes import chain, expansion, from_paths, kary
from specviz.decode.replay import greedy_reference, replay_acceptance, replay_dynamic, replay_shape
from specviz.tree.budgets import SHAPE_FAMILIES, budget_shapes, first_nodes
from specviz.tree.core import DraftTree
from specviz.verify.rules import VERIFIERS, get_verifier

PROMPTS = ("def fizzbuzz(n):", "What is 17 * 23? Think step by step.")
SHAPES = {
    "chain1": chain(1),
    "chain5": chain(5),
    "kary2x3": kary(2, 3),
    "expansion321": expansion([3, 2, 1]),
    "paths": from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]),
}


@pytest.fixture(scope="module")
def references(tiny_pair):
    return [plain_generate(tiny_pair.target, p, max_new_tokens=40, stop_at_eos=False) for p in PROMPTS]


def _same_steps(records, result):
    expected = records_from_result(result)
    assert records == expected


@pytest.mark.parametrize("name", list(SHAPES))
def test_rank_walk_equals_the_engine_replay(tiny_pair, references, name):
    for ref in references:
        ranks = draft_ranks(tiny_pair.draft, ref.prompt_ids, ref.output_ids)
        walked = replay_shape(SHAPES[name], ranks, ref, target=tiny_pair.target)
        engine = replay_acceptance(tiny_pair.target, TreeDrafter(tiny_pair.draft, SHAPES[name]), ref)
        _same_steps(walked, engine)


def test_rank_walk_respects_a_smaller_budget_and_end_of_sequence(tiny_pair, references):
    ref = references[0]
    ranks = draft_ranks(tiny_pair.draft, ref.prompt_ids, ref.output_ids)
    walked = replay_shape(chain(6), ranks, ref, target=tiny_pair.target, max_new_tokens=13)
    engine = replay_acceptance(tiny_pair.target, TreeDrafter(tiny_pair.draft, chain(6)), ref, max_new_tokens=13)
    _same_steps(walked, engine)
    assert sum(r.committed for r in walked) == 13
    # pretend the reference's 5th token ends the sequence
    stop = ref.output_ids[4]
    walked = replay_shape(chain(3), ranks, ref, stop_ids=[stop])
    assert sum(r.committed for r in walked) == ref.output_ids.index(stop) + 1


@pytest.mark.parametrize("budgets", [(1, 3, 10), (4, 16)])
def test_shared_dynamic_replay_equals_one_replay_per_budget(tiny_pair, references, budgets):
    for ref in references:
        shared = replay_dynamic(tiny_pair.draft, ref, budgets, topk=3, depth=4, target=tiny_pair.target)
        assert set(shared) == set(budgets)
        for b in budgets:
            engine = replay_acceptance(tiny_pair.target, DynamicTreeDrafter(tiny_pair.draft, 3, 4, b), ref)
            _same_steps(shared[b], engine)


def test_records_aggregate_like_the_metrics_module(tiny_pair, references):
    result = replay_acceptance(tiny_pair.target, TreeDrafter(tiny_pair.draft, kary(2, 3)), references[0])
    stats = summarize_steps(result.steps)
    table = records_table(records_from_result(result), strategy="kary", question_id=1)
    summary = acceptance_summary(table, ["strategy"]).iloc[0]
    assert summary["steps"] == stats.n_steps
    assert summary["drafted_tokens"] == stats.drafted_tokens
    assert summary["accepted_tokens"] == stats.accepted_tokens
    assert summary["new_tokens"] == len(result.output_ids)
    assert summary["tau"] == pytest.approx(stats.tau)
    assert summary["acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    depth = per_depth_table(table, ["strategy"])
    assert tuple(depth["alpha"]) == pytest.approx(stats.alpha)
    assert tuple(depth["trials"]) == stats.alpha_trials


def test_records_of_a_model_free_drafter(tiny_pair, references):
    ref = references[1]
    result = replay_acceptance(tiny_pair.target, NgramDrafter(n=2, k=4), ref)
    records = records_from_result(result)
    assert sum(r.committed for r in records) == len(result.output_ids)
    assert all(r.drafted == s.tree.budget for r, s in zip(records, result.steps))


def test_positional_acceptance_counts_ranks():
    ranks = torch.tensor([0, 0, 1, 3, 9, 0])
    a = positional_acceptance(ranks, k=4)
    assert a == pytest.approx((3 / 6, 1 / 6, 0.0, 1 / 6))
    assert positional_acceptance([ranks[:3], ranks[3:]], k=4) == a


def test_budget_shapes_have_the_exact_budget():
    for budget in (1, 4, 8, 16, 33, 64):
        shapes = budget_shapes(budget, (0.6, 0.15, 0.05))
        assert tuple(shapes) == SHAPE_FAMILIES
        assert all(s.budget == budget for s in shapes.values())
    assert "sequoia" not in budget_shapes(8)
    assert first_nodes(kary(2, 2), 3).parents == (-1, 0, 0, 1)
    with pytest.raises(ValueError, match="fewer"):
        first_nodes(chain(2), 3)
    with pytest.raises(ValueError, match="budget"):
        budget_shapes(0)


def test_greedy_reference_is_kept_in_a_store(tiny_pair, tmp_path):
    store = ResultStore.open(tmp_path, "refs")
    first = greedy_reference(tiny_pair.target, PROMPTS[0], 12, store=store)
    again = greedy_reference(tiny_pair.target, PROMPTS[0], 12, store=ResultStore.open(tmp_path, "refs"))
    assert again.output_ids == first.output_ids and again.prompt_ids == first.prompt_ids
    assert len(ResultStore.open(tmp_path, "refs")) == 1


def test_tree_scorer_equals_a_full_forward(tiny_pair, references):
    target = tiny_pair.target
    ref = references[0]
    seq = list(ref.prompt_ids) + list(ref.output_ids)
    scorer = TreeScorer(target)
    for cut in (len(ref.prompt_ids), len(ref.prompt_ids) + 7, len(ref.prompt_ids) + 3):
        context = seq[:cut]
        trees = [DraftTree.from_lists([context[-1], 5, 6, 7], [-1, 0, 0, 1]),
                 DraftTree.from_lists([context[-1], 5, 9], [-1, 0, 1])]
        got = scorer.logits(context, trees)
        for tree, logits in zip(trees, got):
            for node, path in ((0, []), (1, [5]), (tree.n_nodes - 1, None)):
                if path is None:
                    path = []
                    n = node
                    while n > 0:
                        path.insert(0, int(tree.tokens[n]))
                        n = int(tree.parents[n])
                ids = torch.tensor([context + path])
                with torch.no_grad():
                    full = target.model(input_ids=ids).logits[0, -1].float()
                torch.testing.assert_close(logits[node], full, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="rooted"):
        scorer.logits(seq[:20], [DraftTree.from_lists([seq[20], 1], [-1, 0])])


def test_score_rules_matches_the_live_expectation(tiny_pair):
    config = SamplingConfig(temperature=1.0)
    live = speculative_generate(tiny_pair.target, TreeDrafter(tiny_pair.draft, kary(2, 2)), PROMPTS[0],
                                max_new_tokens=6, config=config, verifier="topk", seed=3)
    step = live.steps[0]
    scorer = TreeScorer(tiny_pair.target)
    (logits,) = scorer.logits(list(live.prompt_ids), [step.tree])
    (score,) = score_rules(step.tree, logits, config, ["topk"], make_generator(0))
    assert score.expected == pytest.approx(step.expected_accepted, abs=1e-5)
    assert score.drafted == step.tree.budget
    rows = pd.DataFrame([vars(score)])
    assert list(rows.columns) == ["rule", "drafted", "expected", "realised"]


def test_score_rules_along_scores_every_rule_on_its_tree(tiny_pair):
    ref = greedy_reference(tiny_pair.target, PROMPTS[0], 10)
    scores = score_rules_along(tiny_pair, ref, shape=expansion([2, 1]), chain_length=3, temperatures=[0.0, 1.0],
                               stride=4, generator=make_generator(5))
    again = score_rules_along(tiny_pair, ref, shape=expansion([2, 1]), chain_length=3, temperatures=[0.0, 1.0],
                              stride=4, generator=make_generator(5))
    assert scores == again  # every draw comes from the one generator, in a fixed order
    assert sorted({s.position for s in scores}) == [0, 4, 8]
    assert [s.rule for s in scores if s.temperature == 0.0][:len(VERIFIERS)] == list(VERIFIERS)
    assert "greedy" not in {s.rule for s in scores if s.temperature == 1.0}
    assert len(scores) == 3 * (2 * len(VERIFIERS) - 1)
    assert {s.drafted for s in scores if s.rule == "chain"} == {3}
    assert {s.drafted for s in scores if s.rule != "chain"} == {4}
    for s in scores:
        assert s.lossless == get_verifier(s.rule).lossless
        assert 0 <= s.realised <= s.drafted and 0.0 <= s.expected <= s.drafted
    # at temperature 0 every tree rule sees the same greedy tree, so lossless rules agree with greedy
    for position in (0, 4, 8):
        greedy = {s.rule: s.expected for s in scores if s.temperature == 0.0 and s.position == position}
        for rule in ("specinfer", "sequoia", "topk"):
            assert greedy[rule] == pytest.approx(greedy["greedy"], abs=1e-6)
    # the first context's top-k tree verified by hand gives the same exact expectation
    context = list(ref.prompt_ids)
    tree = TreeDrafter(tiny_pair.draft, expansion([2, 1])).draft(torch.tensor(context), SamplingConfig(), "topk",
                                                                 make_generator(0))
    (logits,) = TreeScorer(tiny_pair.target).logits(context, [tree])
    (hand,) = score_rules(tree, logits, SamplingConfig(temperature=1.0), ["topk"], make_generator(0))
    (first,) = [s for s in scores if s.position == 0 and s.temperature == 1.0 and s.rule == "topk"]
    assert first.expected == pytest.approx(hand.expected, abs=1e-6)
    with pytest.raises(ValueError, match="stride"):
        score_rules_along(tiny_pair, ref, shape=chain(2), chain_length=2, temperatures=[0.0], stride=0,
                          generator=make_generator(0))

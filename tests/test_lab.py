"""Tests for specviz.verify.lab: toy models, drafting by sibling mode, the distribution check."""

from __future__ import annotations

import pytest
import torch

from specviz.sampling import GREEDY, SamplingConfig, make_generator, probs_from_logits
from specviz.tree.shapes import chain, expansion
from specviz.verify.lab import (
    ToyModel,
    check_rule,
    checks_table,
    distributions_table,
    draft_tree,
    expected_acceptance_table,
    toy_pair,
)
from specviz.tree.core import children_lists

PAIR = toy_pair(vocab=6, max_depth=2, seed=3)
T1 = SamplingConfig(temperature=1.0)


def test_toy_model_logits_depend_on_the_path_only():
    target = PAIR.target
    assert target.vocab == 6 and target.max_depth == 2
    tree = draft_tree(PAIR.draft, expansion([2, 2]), T1, "iid", make_generator(0))
    logits = target.tree_logits(tree)  # (N, V)
    assert logits.shape == (tree.n_nodes, 6)
    assert torch.equal(logits[0], target.logits([]))
    node = 3  # a depth-2 node: its logits are indexed by the two tokens above it
    path = [int(tree.tokens[int(tree.parents[node])]), int(tree.tokens[node])]
    assert torch.equal(logits[node], target.logits(path))
    probs = target.token_probs(tree, T1)
    p_parent = probs_from_logits(logits[int(tree.parents[node])], T1)
    assert probs[0] == 1.0 and probs[node] == pytest.approx(float(p_parent[tree.tokens[node]]))
    with pytest.raises(ValueError, match="deeper"):
        target.logits([0, 0, 0])
    with pytest.raises(ValueError, match="shape"):
        ToyModel((torch.zeros(1, 3), torch.zeros(2, 3)))


def test_draft_modes():
    g = make_generator(1)
    shape = expansion([3, 2])
    topk = draft_tree(PAIR.draft, shape, T1, "topk", g)
    assert topk.ranks.tolist() == list(shape.ranks)
    assert topk.draft_probs.shape == (shape.n_nodes, 6)
    for _ in range(20):
        wr = draft_tree(PAIR.draft, shape, T1, "without_replacement", g)
        for kids in children_lists(wr):
            tokens = [int(wr.tokens[k]) for k in kids]
            assert len(tokens) == len(set(tokens))
    greedy = draft_tree(PAIR.draft, shape, GREEDY, "iid", g)  # greedy decoding drafts the top ranks
    assert torch.equal(greedy.tokens, topk.tokens)
    with pytest.raises(ValueError, match="sibling_sampling"):
        draft_tree(PAIR.draft, shape, T1, "random", g)
    with pytest.raises(ValueError, match="depth"):
        draft_tree(PAIR.draft, chain(3), T1, "iid", g)


def test_without_replacement_drafts_fewer_children_than_the_support_allows():
    narrow = SamplingConfig(temperature=1.0, top_k=2)
    tree = draft_tree(PAIR.draft, expansion([4, 1]), narrow, "without_replacement", make_generator(0))
    assert len(children_lists(tree)[0]) == 2 and tree.budget == 4


def test_lossless_rule_matches_and_lossy_rule_does_not():
    exact = check_rule(PAIR, expansion([2, 2]), "specinfer", T1, trials=300, seed=0)
    lossy = check_rule(PAIR, expansion([2, 2]), "typical", T1, trials=300, seed=0)
    assert exact.matches_target() and not lossy.matches_target()
    assert exact.sibling_sampling == "iid" and lossy.lossless is False
    assert sum(exact.empirical) == pytest.approx(1.0) and sum(exact.target) == pytest.approx(1.0)
    assert abs(exact.mean_accepted - exact.expected_accepted) < 0.2
    table = checks_table([exact, lossy])
    assert table["matches_target"].tolist() == [True, False]
    dist = distributions_table([exact], PAIR.tokenizer)
    assert len(dist) == 6 and dist["word"].tolist() == list(PAIR.tokenizer.words)


def test_chain_rule_needs_a_chain_and_trials_are_checked():
    assert check_rule(PAIR, chain(2), "chain", T1, trials=50).rule == "chain"
    with pytest.raises(ValueError, match="chain"):
        check_rule(PAIR, expansion([2]), "chain", T1, trials=5)
    with pytest.raises(ValueError, match="trials"):
        check_rule(PAIR, chain(2), "chain", T1, trials=0)


def test_expected_acceptance_table_at_temperature_zero_is_greedy_for_lossless_rules():
    table = expected_acceptance_table(PAIR, {"chain": chain(2), "tree": expansion([2, 2])},
                                      ["chain", "specinfer", "sequoia", "topk"], [0.0, 1.0], trees=3)
    assert set(table.columns) == {"shape", "budget", "rule", "temperature", "expected_accepted", "expected_tau"}
    assert "chain" not in set(table[table["shape"] == "tree"]["rule"])
    greedy_rows = table[table["temperature"] == 0.0]
    for _, group in greedy_rows.groupby("shape"):
        assert group["expected_accepted"].nunique() == 1
    assert (table["expected_tau"] - table["expected_accepted"]).tolist() == pytest.approx([1.0] * len(table))

"""Jacobi and lookahead decoding: the side branch, the window, the pool, identity and losslessness."""

import pytest
import torch

from specviz.draft.base import SideBranching, TargetOutputs
from specviz.decode.engine import plain_generate, speculative_generate, speculative_generate_batch
from specviz.draft.lookahead import (JacobiDrafter, LookaheadDrafter, guess_tree, guesses_of,
                                     lookahead_window_mask)
from specviz.draft.registry import build_drafter, parse_strategy
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.tiny import tiny_model, tiny_pair
from specviz.sampling import GREEDY, SamplingConfig
from specviz.tree.core import DraftTree, forward_mask, pad_trees
from specviz.tree.side import SideBranch
from specviz.verify.lab import check_proposals, toy_pair

PAIR = tiny_pair(seed=0)
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [11, 12, 13])


def _plain(prompt, n=40, target=PAIR.target):
    return plain_generate(target, prompt, max_new_tokens=n, stop_at_eos=False).output_ids


# -- the window mask and the side branch -----------------------------------------------------------

def test_window_mask_sees_level_zero_up_to_its_column_and_its_own_column_above():
    m = lookahead_window_mask(3, 5)
    assert m.shape == (15, 15) and bool(m.diagonal().all())
    # (level 2, column 3) = index 13 sees level 0 columns 0..3 and (1, 3), (2, 3)
    assert torch.nonzero(m[13]).flatten().tolist() == [0, 1, 2, 3, 8, 13]
    # level 0 is causal within itself
    assert torch.equal(m[:5, :5], torch.ones(5, 5, dtype=torch.bool).tril())
    assert not bool(m[:5, 5:].any())
    with pytest.raises(ValueError, match="levels"):
        lookahead_window_mask(0, 5)


def test_side_branch_rejects_bad_shapes():
    with pytest.raises(ValueError, match="offsets must be >= 1"):
        SideBranch(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.eye(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must have shape"):
        SideBranch(torch.tensor([1, 2]), torch.tensor([1, 2]), torch.eye(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="attend to itself"):
        SideBranch(torch.tensor([1, 2]), torch.tensor([1, 2]), torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-empty"):
        SideBranch(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), torch.zeros(0, 0))


def test_forward_mask_keeps_the_tree_blind_to_the_side_branch():
    tree = DraftTree.from_lists([9, 1, 2, 3], [-1, 0, 1, 0])
    side = SideBranch(torch.tensor([4, 5]), torch.tensor([1, 2]), torch.ones(2, 2, dtype=torch.bool).tril())
    m = forward_mask(tree, side)
    assert m.shape == (6, 6)
    assert not bool(m[:4, 4:].any())  # no tree node sees a side token
    assert bool(m[4:, 0].all()) and not bool(m[4:, 1:4].any())  # side tokens see the root, not the guesses
    assert torch.equal(forward_mask(tree), m[:4, :4])


def _logits_of(target, ids):
    """The target's logits at every position of ``ids``, plain causal forward."""
    cache = new_cache(target.model)
    return forward_tokens(target.model, cache, torch.tensor([ids]), torch.arange(len(ids))[None], None)[0]


def test_side_logits_are_the_jacobi_predictions_and_tree_logits_are_unchanged():
    target = PAIR.target
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    root, p = ctx[-1], len(ctx) - 1
    levels = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    w, m = 3, 3
    side = SideBranch(torch.tensor([t for lv in levels for t in lv]),
                      torch.tensor([lv + c + 1 for lv in range(m) for c in range(w)]), lookahead_window_mask(m, w))
    tree = guess_tree(root, [[7, 8], [7, 5], [2]])
    cache = new_cache(target.model)
    forward_tokens(target.model, cache, torch.tensor([ctx[:-1]]), torch.arange(p)[None], None)
    batch = pad_trees([tree], [p], sides=[side])
    logits = forward_tokens(target.model, cache, batch.tokens, batch.position_ids, batch.mask)[0]
    n = tree.n_nodes
    for lv in range(m):
        for c in range(w):
            seq = ctx + levels[0][:c + 1] + [levels[k][c] for k in range(1, lv + 1)]
            want = _logits_of(target, seq)[-1]
            assert torch.allclose(logits[n + lv * w + c], want, atol=1e-4), (lv, c)
    for node, path in ((2, [7, 8]), (4, [2])):
        assert torch.allclose(logits[node], _logits_of(target, ctx + path)[-1], atol=1e-4)


# -- the drafters -----------------------------------------------------------------------------------

def test_guess_tree_merges_shared_prefixes():
    tree = guess_tree(9, [[1, 2, 3], [1, 2, 4], [5, 6, 7]])
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 5, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 0, 5, 6]
    assert guess_tree(9, []).n_nodes == 1


def test_lookahead_fills_its_window_then_its_pool():
    d = LookaheadDrafter(window=3, ngram=3, guesses=2)
    ctx = torch.tensor([4, 5, 6, 7])
    tree = d.draft(ctx, GREEDY, "greedy", None)
    assert tree.n_nodes == 1  # nothing pooled yet
    assert isinstance(d, SideBranching) and not isinstance(JacobiDrafter(), SideBranching)
    side = d.side_branch(ctx, tree)
    assert side.size == 3 and side.offsets.tolist() == [1, 2, 3]
    vocab = 20

    def logits_for(preds):
        out = torch.full((len(preds), vocab), -1.0)
        out[torch.arange(len(preds)), torch.tensor(preds)] = 1.0
        return out

    class Step:
        class acceptance:
            accepted_nodes = ()
            committed_tokens = (8,)

    level0 = side.tokens.tolist()
    d.observe(Step, TargetOutputs(logits_for([0]), logits_for([11, 12, 13])))  # warm-up: a second level
    side = d.side_branch(torch.tensor([4, 5, 6, 7, 8]), tree)
    assert side.size == 6 and side.offsets.tolist() == [1, 2, 3, 2, 3, 4] and d.pool_size == 0
    d.observe(Step, TargetOutputs(logits_for([0]), logits_for([0, 0, 0, 14, 15, 16])))  # full: n-grams harvested
    for col, (middle, new) in enumerate(zip([11, 12, 13], [14, 15, 16])):
        assert (middle, new) in d.pool_guesses(level0[col])
    assert d.pool_size == len(set(zip(level0, [11, 12, 13], [14, 15, 16])))
    assert d._levels == [[11, 12, 13], [14, 15, 16]]


def test_lookahead_pool_keeps_the_most_recent_guesses_per_token():
    d = LookaheadDrafter(window=2, ngram=2, guesses=2, pool="context")
    tree = d.draft(torch.tensor([1, 2, 1, 3, 1, 4, 1]), GREEDY, "greedy", None)
    assert d.pool_guesses(1) == [(4,), (3,)]
    assert tree.tokens.tolist() == [1, 4, 3]


def test_jacobi_guesses_are_last_steps_predictions_after_the_accepted_path():
    d = JacobiDrafter(k=3)
    ctx = torch.tensor([1, 2, 3])
    tree = d.draft(ctx, GREEDY, "greedy", None)
    assert tree.n_nodes == 4 and tree.parents.tolist() == [-1, 0, 1, 2]

    class Step:
        class acceptance:
            accepted_nodes = (1,)
            committed_tokens = (int(tree.tokens[1]), 7)

    logits = torch.zeros(4, 12)
    logits[torch.arange(4), torch.tensor([5, 7, 9, 10])] = 1.0
    guesses = list(d._guesses)
    d.observe(Step)  # a call without the target's outputs (a replay's): nothing to learn from
    assert d._guesses == guesses
    d.observe(Step, TargetOutputs(logits, None))
    nxt = d.draft(torch.tensor([1, 2, 3, int(tree.tokens[1]), 7]), GREEDY, "greedy", None)
    assert nxt.tokens.tolist()[:3] == [7, 9, 10]
    # a context that does not continue the last one starts over
    assert d.draft(torch.tensor([5, 5]), GREEDY, "greedy", None).n_nodes == 4


def test_registry_names_and_errors():
    spec = parse_strategy("lookahead-w7-n3-g2-context")
    assert spec.arguments() == {"window": 7, "ngram": 3, "guesses": 2, "pool": "context"}
    assert build_drafter("lookahead", PAIR).name == "lookahead(w=5,n=4,g=5)"
    assert build_drafter("lookahead-context", PAIR).name == "lookahead(w=5,n=4,g=5,context)"
    assert build_drafter("jacobi-k4", PAIR).name == "jacobi(k=4)"
    assert spec.verifier(0.8) == "topk"
    with pytest.raises(ValueError, match="ngram must be >= 2"):
        LookaheadDrafter(ngram=1)
    with pytest.raises(ValueError, match="pool must be one of"):
        LookaheadDrafter(pool="prompt")
    with pytest.raises(ValueError, match="unknown strategy"):
        parse_strategy("lookahead-w5")


# -- decoding -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["jacobi", "lookahead", "lookahead-w3-n3-g2", "lookahead-w2-n2-g1-context"])
def test_greedy_decoding_equals_plain_decoding(name):
    for prompt in PROMPTS:
        r = speculative_generate(PAIR.target, build_drafter(name, PAIR), prompt, max_new_tokens=40,
                                 stop_at_eos=False)
        assert r.output_ids == _plain(prompt)
    batch = speculative_generate_batch(PAIR.target, build_drafter(name, PAIR), list(PROMPTS), max_new_tokens=40,
                                       stop_at_eos=False)
    assert [b.output_ids for b in batch] == [_plain(p) for p in PROMPTS]


def test_lookahead_records_its_window_and_accepts_guesses():
    r = speculative_generate(PAIR.target, build_drafter("lookahead", PAIR), PROMPTS[1], max_new_tokens=40,
                             stop_at_eos=False)
    assert r.steps[0].side_tokens == 5 and max(s.side_tokens for s in r.steps) == 15
    assert all(s.fed_tokens == s.tree.n_nodes + s.side_tokens for s in r.steps)
    assert sum(len(s.acceptance.accepted_nodes) for s in r.steps) > 0
    step = next(s for s in r.steps if s.acceptance.accepted_nodes)
    views = guesses_of(step)
    assert max(v["accepted"] for v in views) == len(step.acceptance.accepted_nodes)


def test_the_window_is_dropped_where_it_would_pass_the_context_limit():
    small = tiny_model(seed=0, max_context=40)
    prompt = list(range(1, 30))
    r = speculative_generate(small, LookaheadDrafter(), prompt, max_new_tokens=8, stop_at_eos=False)
    assert r.output_ids == _plain(prompt, 8, small)
    assert r.steps[-1].side_tokens == 0 and r.steps[0].side_tokens > 0


def test_sampled_lookahead_is_reproducible_and_runs_the_topk_rule():
    cfg = SamplingConfig(temperature=0.8)
    runs = [speculative_generate(PAIR.target, build_drafter("lookahead", PAIR), PROMPTS[1], max_new_tokens=30,
                                 config=cfg, verifier="topk", seed=3) for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids and runs[0].verifier == "topk"


def test_guess_trees_verified_by_the_topk_rule_keep_the_target_distribution():
    """Lookahead's guesses are fixed before the step and carry no draft distribution;
    the topk rule then accepts a guess with its residual target probability, which keeps
    the first emitted token distributed as the target. A rule that accepts more than
    that (typical acceptance) fails the same test."""
    pair = toy_pair(vocab=6, max_depth=3, sharpness=1.5)
    t1 = SamplingConfig(temperature=1.0)

    def propose(g):
        guesses = torch.randint(0, 6, (3, 3), generator=g).tolist()
        return guess_tree(0, guesses)

    exact = check_proposals(pair, propose, "topk", t1, trials=1500, seed=0)
    lossy = check_proposals(pair, propose, "typical", t1, trials=1500, seed=0)
    assert exact.matches_target() and not lossy.matches_target()
    assert abs(exact.mean_accepted - exact.expected_accepted) < 0.1


# -- pictures -------------------------------------------------------------------------------------------

def test_mask_and_step_figures_label_both_branches():
    from specviz.render.lookahead import BRANCH_COLORS, lookahead_mask_figure, lookahead_step_figure

    r = speculative_generate(PAIR.target, build_drafter("lookahead", PAIR), PROMPTS[1], max_new_tokens=30,
                             stop_at_eos=False)
    step = next(s for s in r.steps if s.acceptance.accepted_nodes and s.side_tokens == 15)
    fig = lookahead_mask_figure(step, tokenizer=PAIR.target.tokenizer)
    z = fig.data[0].z
    n, s = step.tree.n_nodes, step.side_tokens
    assert len(z) == n + s
    assert {v for row in z[n:] for v in row} == {0, 3} and {v for row in z[1:n] for v in row} <= {0, 2}
    texts = [a.text for a in fig.layout.annotations]
    assert any(t.startswith("verification branch") for t in texts) and any(t.startswith("lookahead branch") for t in texts)
    assert fig.data[0].x[n].startswith("L0c0:") and fig.data[0].x[-1].startswith("L2c4:")
    assert BRANCH_COLORS["lookahead branch"] in str(fig.data[0].colorscale)

    view = lookahead_step_figure(step, tokenizer=PAIR.target.tokenizer)
    rows = list(view.layout.yaxis.categoryarray)[::-1]
    assert rows[:3] == ["window level 0", "window level 1", "window level 2"] and rows[-1] == "committed"
    assert sum(r.startswith("guess") for r in rows) == len(guesses_of(step))
    committed = [x for x, y in zip(view.data[0].x, view.data[0].y) if y == "committed"]
    assert sorted(committed) == list(range(len(step.acceptance.committed_tokens) + 1))
    with pytest.raises(TypeError, match="StepTrace"):
        lookahead_step_figure(step.tree)


def test_replay_and_merging_refuse_drafters_that_need_the_targets_outputs():
    from specviz.bench.cost import timed_run
    from specviz.decode.replay import replay_acceptance
    from specviz.draft.merged import MergedDrafter
    from specviz.draft.ngram import NgramDrafter

    ref = plain_generate(PAIR.target, PROMPTS[1], max_new_tokens=12, stop_at_eos=False)
    with pytest.raises(ValueError, match="run it live"):
        replay_acceptance(PAIR.target, LookaheadDrafter(), ref)
    with pytest.raises(ValueError, match="merged tree"):
        MergedDrafter([NgramDrafter(), JacobiDrafter()])
    run = timed_run(PAIR.target, LookaheadDrafter(window=3, ngram=3, guesses=2), PROMPTS[1], max_new_tokens=12)
    assert run.mean_nodes > 6  # the window's 6 tokens count in what the target processed

"""N-gram index and prompt-lookup drafters (specviz.draft.ngram)."""

import pytest
import torch

from specviz.draft.ngram import AdaptiveNgramDrafter, NgramDrafter, NgramIndex, NgramMatch, NgramTrieDrafter
from specviz.sampling import GREEDY, SamplingConfig, make_generator
from specviz.tree.core import DraftTree, children_lists


def _ctx(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def _random_context(seed: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=make_generator(seed))


def _same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            and torch.equal(a.q, b.q) and torch.equal(a.ranks, b.ranks))


def _tables(index: NgramIndex) -> dict:
    return {n: index.table(n) for n in range(index.min_n, index.max_n + 1)}


# -- NgramIndex ----------------------------------------------------------------------

def test_index_excludes_the_final_position_and_lists_recent_first():
    index = NgramIndex(max_n=2, min_n=1)
    index.sync([1, 2, 1, 2, 1])
    # ends 0..3 are indexed; the final token (end 4) has nothing after it yet
    assert index.table(1) == {(1,): (0, 2), (2,): (1, 3)}
    assert index.table(2) == {(1, 2): (1, 3), (2, 1): (2,)}
    assert index.occurrences(1) == (2, 0)
    assert index.occurrences(1, limit=1) == (2,)
    assert index.occurrences(2) == (2,)


def test_index_continuation_self_extends_past_the_context():
    index = NgramIndex(max_n=1)
    index.sync([5, 6, 5, 6, 5])
    assert index.continuation(0, 3) == (6, 5, 6)
    assert index.continuation(2, 6) == (6, 5, 6, 5, 6, 5)
    assert index.continuation(3, 4) == (5, 5, 5, 5)
    with pytest.raises(ValueError, match="end must be in"):
        index.continuation(4, 2)


def test_incremental_index_equals_rebuilt_index():
    full = _random_context(0, 400, vocab=6).tolist()
    step_sizes = _random_context(1, 400, vocab=3).add(1).tolist()  # grow by 1..3 tokens
    incremental = NgramIndex(max_n=4, min_n=1)
    length, checks = 1, 0
    for step in step_sizes:
        if length > len(full):
            break
        incremental.sync(full[:length])
        if checks % 10 == 0 or length == len(full):
            rebuilt = NgramIndex(max_n=4, min_n=1)
            rebuilt.sync(full[:length])
            assert _tables(incremental) == _tables(rebuilt), f"mismatch at length {length}"
        checks += 1
        length += step
    assert incremental.n_rebuilds == 0

    # a context that is not an extension (edited earlier token) forces a rebuild
    edited = list(full[:300])
    edited[100] = (edited[100] + 1) % 6
    incremental.sync(edited)
    rebuilt = NgramIndex(max_n=4, min_n=1)
    rebuilt.sync(edited)
    assert incremental.n_rebuilds == 1
    assert _tables(incremental) == _tables(rebuilt)
    assert len(incremental) == 300

    # so does a shorter one
    incremental.sync(edited[:50])
    rebuilt = NgramIndex(max_n=4, min_n=1)
    rebuilt.sync(edited[:50])
    assert incremental.n_rebuilds == 2
    assert _tables(incremental) == _tables(rebuilt)


@pytest.mark.parametrize("kwargs, error", [
    ({"max_n": 0}, ValueError), ({"max_n": 2, "min_n": 0}, ValueError),
    ({"max_n": 2, "min_n": 3}, ValueError), ({"max_n": 2.0}, TypeError),
    ({"max_n": True}, TypeError),
])
def test_index_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        NgramIndex(**kwargs)


# -- NgramDrafter --------------------------------------------------------------------

def test_chain_proposes_what_followed_the_longest_match():
    drafter = NgramDrafter(n=3, k=5)
    ctx = _ctx(1, 2, 3, 4, 5, 9, 9, 1, 2, 3)
    assert drafter.lookup(ctx) == NgramMatch(end=2, length=3, continuation=(4, 5, 9, 9, 1))
    tree = drafter.draft(ctx, GREEDY, "greedy", None)
    assert tree.tokens.tolist() == [3, 4, 5, 9, 9, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    assert tree.q.tolist() == [1.0] * 6
    assert tree.ranks.tolist() == [0] * 6
    assert tree.draft_probs is None


def test_chain_uses_the_most_recent_occurrence():
    tree = NgramDrafter(n=2, k=3).draft(_ctx(1, 2, 7, 1, 2, 8, 1, 2), GREEDY, "greedy", None)
    assert tree.tokens.tolist() == [2, 8, 1, 2]


def test_chain_falls_back_to_shorter_ngrams():
    drafter = NgramDrafter(n=3, k=2, min_n=1)
    ctx = _ctx(4, 6, 7, 8, 5, 6)  # (8, 5, 6) and (5, 6) never occurred before, (6,) did
    assert drafter.lookup(ctx) == NgramMatch(end=1, length=1, continuation=(7, 8))
    assert NgramDrafter(n=3, k=2, min_n=2).lookup(ctx) is None


def test_chain_without_match_is_root_only():
    drafter = NgramDrafter(n=3, k=4)
    for ctx in (_ctx(1, 2, 3, 4, 5), _ctx(7)):
        tree = drafter.draft(ctx, GREEDY, "greedy", None)
        assert tree.n_nodes == 1 and int(tree.tokens[0]) == int(ctx[-1])


def test_chain_self_extends_a_repeating_pattern():
    tree = NgramDrafter(n=3, k=6).draft(_ctx(5, 6, 5, 6, 5), GREEDY, "greedy", None)
    assert tree.tokens.tolist() == [5, 6, 5, 6, 5, 6, 5]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_chain_length_is_bounded_by_k(k):
    drafter = NgramDrafter(n=2, k=k)
    for seed in range(5):
        tree = drafter.draft(_random_context(seed, 60, vocab=5), GREEDY, "greedy", None)
        assert tree.budget == k  # vocab 5 in 60 tokens always has a 1-gram match
        assert tree.depth == tree.budget


def test_chain_ignores_the_sampling_config():
    ctx = _random_context(3, 80, vocab=7)
    drafter = NgramDrafter(n=3, k=4)
    a = drafter.draft(ctx, GREEDY, "greedy", None)
    b = drafter.draft(ctx, SamplingConfig(temperature=0.8, top_p=0.9), "iid", make_generator(0))
    assert _same_tree(a, b)


def test_chain_drafter_stepping_through_a_sequence_equals_a_fresh_drafter():
    full = _random_context(4, 300, vocab=8)
    stateful = NgramDrafter(n=3, k=4)
    for length in range(1, 300, 7):
        ctx = full[:length]
        fresh = NgramDrafter(n=3, k=4).draft(ctx, GREEDY, "greedy", None)
        assert _same_tree(stateful.draft(ctx, GREEDY, "greedy", None), fresh)
    other = _random_context(5, 120, vocab=8)  # a new prompt: not an extension
    fresh = NgramDrafter(n=3, k=4).draft(other, GREEDY, "greedy", None)
    assert _same_tree(stateful.draft(other, GREEDY, "greedy", None), fresh)
    stateful.reset()
    assert _same_tree(stateful.draft(other, GREEDY, "greedy", None), fresh)


@pytest.mark.parametrize("kwargs, error", [
    ({"n": 0}, ValueError), ({"k": 0}, ValueError), ({"n": 2, "min_n": 3}, ValueError),
    ({"min_n": 0}, ValueError), ({"k": 2.5}, TypeError), ({"n": "3"}, TypeError),
])
def test_chain_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        NgramDrafter(**kwargs)


def test_drafters_reject_bad_context_and_mode():
    drafter = NgramDrafter()
    with pytest.raises(ValueError, match="at least one token"):
        drafter.draft(torch.zeros(0, dtype=torch.long), GREEDY, "greedy", None)
    with pytest.raises(ValueError, match="1-D"):
        drafter.draft(torch.zeros(2, 3, dtype=torch.long), GREEDY, "greedy", None)
    with pytest.raises(TypeError, match="integer"):
        drafter.draft(torch.zeros(4), GREEDY, "greedy", None)
    with pytest.raises(ValueError, match="sibling_sampling"):
        NgramTrieDrafter().draft(_ctx(1, 2, 1), GREEDY, "beam", None)


# -- NgramTrieDrafter ----------------------------------------------------------------

# suffix (1, 2) occurred three times, followed by 3 4 9 / 3 5 8 / 3 4 7 (oldest first)
TRIE_CTX = _ctx(1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3, 4, 7, 1, 2)


def test_trie_merges_common_prefixes():
    drafter = NgramTrieDrafter(n=2, min_n=2, depth=3, budget=16)
    assert [m.end for m in drafter.matches(TRIE_CTX)] == [11, 6, 1]
    tree = drafter.draft(TRIE_CTX, GREEDY, "greedy", None)
    # best-first: 3 (all), 4 (two matches), 7 (most recent of the single-match nodes), 5, 8, 9
    assert tree.tokens.tolist() == [2, 3, 4, 7, 5, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 1, 4, 2]
    assert tree.q.tolist() == pytest.approx([1.0, 1.0, 2 / 3, 1 / 2, 1 / 3, 1.0, 1 / 2])
    assert tree.ranks.tolist() == [0, 0, 0, 0, 1, 0, 1]
    assert tree.draft_probs is None


def test_trie_respects_the_budget():
    tree = NgramTrieDrafter(n=2, min_n=2, depth=3, budget=3).draft(TRIE_CTX, GREEDY, "greedy", None)
    assert tree.tokens.tolist() == [2, 3, 4, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_trie_prefers_longer_matches():
    # (6, 1, 2) matches once (followed by 5); the 2-gram (1, 2) alone is followed by 3 twice
    ctx = _ctx(1, 2, 3, 0, 1, 2, 3, 0, 6, 1, 2, 5, 0, 6, 1, 2)
    tree = NgramTrieDrafter(n=3, min_n=1, depth=2, budget=1).draft(ctx, GREEDY, "greedy", None)
    assert tree.tokens.tolist() == [2, 5]


@pytest.mark.parametrize("budget", [1, 4, 10, 25])
def test_trie_invariants_on_random_contexts(budget):
    drafter = NgramTrieDrafter(n=3, min_n=1, depth=4, budget=budget, max_matches=6)
    for seed in range(6):
        ctx = _random_context(seed, 120, vocab=6)
        found = drafter.matches(ctx)
        assert 1 <= len(found) <= 6
        assert len({m.end for m in found}) == len(found)
        assert [m.length for m in found] == sorted((m.length for m in found), reverse=True)
        tree = drafter.draft(ctx, GREEDY, "greedy", None)
        assert 1 <= tree.budget <= budget
        assert tree.depth <= 4
        parents = tree.parents.tolist()
        assert all(parents[i] < i for i in range(1, tree.n_nodes))
        for u, kids in enumerate(children_lists(tree)):
            kid_tokens = tree.tokens[kids].tolist()
            assert len(set(kid_tokens)) == len(kid_tokens)  # prefixes were merged
            assert tree.ranks[kids].tolist() == list(range(len(kids)))
            assert float(tree.q[kids].sum()) <= 1.0 + 1e-6
        assert bool(((tree.q > 0) & (tree.q <= 1)).all())


def test_trie_with_one_match_equals_the_chain():
    chain = NgramDrafter(n=3, k=5)
    trie = NgramTrieDrafter(n=3, depth=5, budget=5, max_matches=1)
    for seed in range(5):
        ctx = _random_context(seed, 90, vocab=9)
        assert _same_tree(trie.draft(ctx, GREEDY, "greedy", None),
                          chain.draft(ctx, GREEDY, "greedy", None))


def test_trie_without_match_is_root_only():
    tree = NgramTrieDrafter().draft(_ctx(1, 2, 3), GREEDY, "topk", None)
    assert tree.n_nodes == 1 and tree.tokens.tolist() == [3]


def test_trie_drafter_stepping_through_a_sequence_equals_a_fresh_drafter():
    full = _random_context(6, 250, vocab=8)
    stateful = NgramTrieDrafter(n=3, depth=3, budget=8)
    for length in range(1, 250, 9):
        ctx = full[:length]
        fresh = NgramTrieDrafter(n=3, depth=3, budget=8).draft(ctx, GREEDY, "greedy", None)
        assert _same_tree(stateful.draft(ctx, GREEDY, "greedy", None), fresh)


@pytest.mark.parametrize("kwargs, error", [
    ({"budget": 0}, ValueError), ({"depth": 0}, ValueError), ({"max_matches": 0}, ValueError),
    ({"n": 1, "min_n": 2}, ValueError), ({"budget": None}, TypeError),
])
def test_trie_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        NgramTrieDrafter(**kwargs)


# -- the adaptive-length lookup chain -----------------------------------------------------------

class _Step:
    """The fields of a StepTrace that AdaptiveNgramDrafter.observe reads: the tree's size,
    the accepted tokens and the bonus token (the step commits both), the verification time
    and the step's index in its sequence."""

    def __init__(self, n_nodes, accepted, verify_s, bonus=0, step=1):
        self.step = step
        self.tree = DraftTree.from_lists(list(range(n_nodes)), list(range(-1, n_nodes - 1)))
        self.acceptance = type("A", (), {"n_accepted": len(accepted), "accepted_tokens": tuple(accepted),
                                         "bonus_token": bonus})()
        self.verify_time_s = verify_s


def _best_length(rates, costs, available):
    """Brute force: argmax over k of (1 + sum_i prod_j<=i rates[j]) / (costs[k] / costs[0])."""
    values = []
    for k in range(available + 1):
        expected, reach = 1.0, 1.0
        for i in range(1, k + 1):
            reach *= rates[i]
            expected += reach
        values.append(expected / (costs[k] / costs[0]))
    return max(range(available + 1), key=lambda k: (values[k] - 1e-9 * k))


@pytest.mark.parametrize("rates", [[0, 0.9, 0.8, 0.7, 0.6, 0.5], [0, 0.3, 0.3, 0.3, 0.3, 0.3],
                                   [0, 0.95, 0.95, 0.95, 0.95, 0.95], [0, 0.1, 0.9, 0.9, 0.9, 0.9]])
def test_adaptive_length_maximizes_expected_throughput(rates):
    costs = [100, 130, 150, 210, 260, 300]  # a CPU where a 4-token forward costs twice a step
    d = AdaptiveNgramDrafter(n=2, k_max=5, costs=costs)
    d._accepted[2] = torch.tensor(rates, dtype=torch.float64)
    d._tried[2] = torch.ones(6, dtype=torch.float64)
    assert d.choose_length(2, 5) == _best_length(rates, costs, 5)
    assert d.choose_length(2, 2) == _best_length(rates, costs, 2)
    assert d.relative_costs() == pytest.approx([c / 100 for c in costs])


def test_adaptive_length_drafts_nothing_where_it_does_not_pay_and_long_where_it_does():
    costs = [100, 190, 280, 370, 460]  # verification as dear as decoding token by token
    d = AdaptiveNgramDrafter(n=2, k_max=4, costs=costs)
    d._accepted[1], d._tried[1] = torch.full((5,), 3.0, dtype=torch.float64), torch.full((5,), 10.0, dtype=torch.float64)
    assert d.choose_length(1, 4) == 0  # 30% per token never pays for 90% more time
    flat = AdaptiveNgramDrafter(n=2, k_max=4, costs=[100, 101, 102, 103, 104])
    flat._accepted[1], flat._tried[1] = d._accepted[1].clone(), d._tried[1].clone()
    assert flat.choose_length(1, 4) == 3  # nearly free verification: the 4th token's 0.8% is not worth 1%
    flat._accepted[1] = torch.full((5,), 9.0, dtype=torch.float64)
    assert flat.choose_length(1, 4) == 4  # likely tokens: draft everything
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 2])  # a one-token match of "2"
    tree = d.draft(tokens, SamplingConfig(), "greedy", None)
    assert tree.n_nodes == 1 and d.history[-1] == (1, 0)


def test_adaptive_length_learns_acceptance_per_match_length_and_costs_online():
    d = AdaptiveNgramDrafter(n=3, k_max=4)  # costs measured online
    assert d.relative_costs() == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])  # the prior slope
    ctx = torch.tensor([7, 8, 9, 10, 11, 7, 8, 9])  # a three-token match of "7 8 9": continuation 10 11 7 8
    tree = d.draft(ctx, SamplingConfig(), "greedy", None)
    # prior acceptance 1/2: one token is worth 1.5 / 1.25, two 1.75 / 1.5
    assert tree.tokens.tolist() == [9, 10] and d.history[-1] == (3, 1) and d.last_worth == pytest.approx(1.2)
    d.observe(_Step(2, accepted=[10], verify_s=0.30, bonus=11))  # accepted, and the bonus is the next one
    # Beta(1, 1) prior plus one acceptance at position 1, and at position 2, which the bonus confirmed
    assert d._tried[3, 1] == 3 and d._accepted[3, 1] == 2 and d._tried[3, 2] == 3 and d._accepted[3, 2] == 2
    assert d._tried[3, 3] == 2 and d._tried[2, 1] == 2  # beyond the committed tokens, other lengths: untouched
    d.observe(_Step(1, accepted=[], verify_s=0.10, bonus=5))  # a step with no lookup: only its time counts
    assert d._time[1] == [0.10] and d._time[2] == [0.30] and d._tried[3, 1] == 3
    costs = d.relative_costs()
    assert costs[0] == 1.0 and costs[1] == pytest.approx(3.0)
    # a rejected first token counts as tried, not accepted, at position 1 only
    d.draft(ctx, SamplingConfig(), "greedy", None)
    d.observe(_Step(d.history[-1][1] + 1, accepted=[], verify_s=0.2, bonus=99))
    assert d._tried[3, 1] == 4 and d._accepted[3, 1] == 2 and d._tried[3, 2] == 3
    # a draft another drafter replaced still learns from what the step committed
    d.draft(ctx, SamplingConfig(), "greedy", None)
    d.withdraw()
    assert d.history[-1] == (3, 0)
    d.observe(_Step(3, accepted=[10, 11], verify_s=0.2, bonus=7))
    assert (d._tried[3, 1:4].tolist(), d._accepted[3, 1:4].tolist()) == ([5, 4, 3], [3, 3, 2])
    # a match whose chain was not worth drafting learns from the plain step's token
    flat = AdaptiveNgramDrafter(n=3, k_max=4, prior_accepted=1, prior_rejected=9)
    assert flat.draft(ctx, SamplingConfig(), "greedy", None).n_nodes == 1 and flat.history[-1] == (3, 0)
    flat.observe(_Step(1, accepted=[], verify_s=0.1, bonus=10))
    assert flat._tried[3, 1] == 11 and flat._accepted[3, 1] == 2
    # one slow step (a first forward, a busy moment) does not move the measured cost; a sequence's first
    # step is not timed at all
    for t in (0.1, 5.0, 0.1, 0.1):
        d.observe(_Step(1, [], t))
    assert d.verify_time(1) == 0.1 and d.plain_step_time() == 0.1
    d.observe(_Step(4, [], 9.0, step=0))
    assert d.verify_time(4) is None
    # two measured sizes: the size between them is interpolated
    d2 = AdaptiveNgramDrafter(n=2, k_max=3)
    d2.observe(_Step(1, [], 0.1))
    d2.observe(_Step(3, [], 0.2))
    assert d2.relative_costs() == pytest.approx([1.0, 1.5, 2.0, 2.25])


def test_adaptive_ngram_arguments_are_checked():
    with pytest.raises(ValueError, match=r"costs must hold k_max \+ 1 = 4 positive times"):
        AdaptiveNgramDrafter(k_max=3, costs=[1, 2, 3])
    with pytest.raises(ValueError, match="prior_accepted must be > 0"):
        AdaptiveNgramDrafter(prior_accepted=0)
    with pytest.raises(ValueError, match="prior_slope must be >= 0"):
        AdaptiveNgramDrafter(prior_slope=-1)
    with pytest.raises(ValueError, match="min_n must be <= n"):
        AdaptiveNgramDrafter(n=2, min_n=3)


def test_adaptive_ngram_with_online_costs_reproduces_greedy_decoding(tiny_pair):
    from specviz.decode.engine import plain_generate, speculative_generate

    prompt = "Repeat after me three times: the red fox jumps over the lazy dog, the red fox jumps."
    drafter = AdaptiveNgramDrafter(n=3, k_max=6)
    result = speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=40, stop_at_eos=False)
    assert result.output_ids == plain_generate(tiny_pair.target, prompt, max_new_tokens=40,
                                               stop_at_eos=False).output_ids
    assert len(drafter.history) == len(result.steps)
    assert 1 in drafter._time and len(drafter._time) >= 2  # plain steps and drafted ones were timed
    drafted = [s.tree.n_nodes - 1 for s in result.steps]
    chosen = [k for _, k in drafter.history]
    # the engine trims the last step's tree to the tokens still wanted
    assert drafted[:-1] == chosen[:-1] and drafted[-1] <= chosen[-1]

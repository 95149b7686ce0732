"""Drafters (specviz.draft): the draft model's cache, tree filling, EAGLE-2, adaptive
chains, self-speculation and merged trees, on the tiny random pair."""

import math

import pytest
import torch

from specviz.decode.engine import encode_prompt
from specviz.decode.records import StepTrace
from specviz.draft.adaptive import AdaptiveChainDrafter
from specviz.draft.base import DraftModelState, draft_all, run_draft_forwards
from specviz.draft.merged import MergedDrafter
from specviz.draft.model import ChainDrafter, DynamicTreeDrafter, TreeDrafter
from specviz.draft.ngram import NgramDrafter, NgramTrieDrafter
from specviz.draft.self_spec import SelfSpeculativeDrafter, truncated_model
from specviz.models.kvcache import cache_length
from specviz.sampling import GREEDY, SamplingConfig, make_generator
from specviz.tree.core import DraftTree, depths, path_to
from specviz.tree.shapes import TreeShape, chain, expansion, from_paths, kary
from specviz.verify.rules import Acceptance

SAMPLED = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def context(tiny_pair):
    return encode_prompt(tiny_pair.target.tokenizer, "def add(a, b):")


def _full_logits(model, ids) -> torch.Tensor:
    """Plain causal forward of the whole sequence, ``(L, V)``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _path_tokens(tree: DraftTree, node: int) -> list[int]:
    tokens = tree.tokens.tolist()
    return [tokens[i] for i in path_to(tree, node)[1:]]


def _fake_step(tree: DraftTree, accepted: int, draft_time: float = 0.0, verify_time: float = 0.0) -> StepTrace:
    nodes = tuple(range(1, accepted + 1))  # chains only
    acc = Acceptance(nodes, tuple(tree.tokens[list(nodes)].tolist()), 0,
                     torch.ones(tree.n_nodes), torch.ones(tree.n_nodes, dtype=torch.bool), "greedy", True)
    return StepTrace(0, tree, acc, torch.ones(tree.n_nodes), float(accepted), draft_time, verify_time, "x", 1)


# -- the draft model's KV cache ---------------------------------------------------------------

def _serve(request) -> torch.Tensor:
    (logits,) = run_draft_forwards([request])
    return logits


def test_tree_expansion_equals_causal_forward_of_each_path(tiny_pair, context):
    model = tiny_pair.draft.model
    state = DraftModelState(model)
    root = _serve(state.sync(context))[-1]
    torch.testing.assert_close(root, _full_logits(model, context)[-1], atol=1e-5, rtol=1e-5)
    # depth 1: two siblings; depth 2: two children of the first, one of the second
    request, h1 = state.expand([10, 11], [-1, -1])
    l1 = _serve(request)
    request, _ = state.expand([20, 21, 22], [h1[0], h1[0], h1[1]])
    l2 = _serve(request)
    for logits, path in ((l1[0], [10]), (l1[1], [11]), (l2[0], [10, 20]), (l2[1], [10, 21]), (l2[2], [11, 22])):
        torch.testing.assert_close(logits, _full_logits(model, context + path)[-1], atol=1e-5, rtol=1e-5)


def test_accepted_draft_nodes_are_reused_and_the_rest_dropped(tiny_pair, context):
    model = tiny_pair.draft.model
    state = DraftModelState(model)
    _serve(state.sync(context))
    request, h = state.expand([10, 11], [-1, -1])
    _serve(request)
    request, _ = state.expand([20], [h[1]])
    _serve(request)
    # the target accepted 11, 20 and added the bonus 30: only the bonus is fed
    new_context = context + [11, 20, 30]
    request = state.sync(new_context)
    assert request.tokens == [30]
    torch.testing.assert_close(_serve(request)[-1], _full_logits(model, new_context)[-1], atol=1e-5, rtol=1e-5)
    assert cache_length(state.cache) == len(new_context)
    # a context that is not an extension (a new prompt) is rebuilt from the common prefix
    other = context[:3] + [40, 41]
    torch.testing.assert_close(_serve(state.sync(other))[-1], _full_logits(model, other)[-1], atol=1e-5, rtol=1e-5)
    assert cache_length(state.cache) == len(other)
    # the same context twice re-feeds just the root
    request = state.sync(other)
    assert request.tokens == [41]
    torch.testing.assert_close(_serve(request)[-1], _full_logits(model, other)[-1], atol=1e-5, rtol=1e-5)


def test_short_catch_up_is_a_masked_forward_equal_to_the_causal_one(tiny_pair, context, monkeypatch):
    """A chain whose every node was accepted leaves the last node and the bonus to feed:
    that catch-up carries its causal mask, so it runs the decoder layer by layer like every
    other draft forward, with the logits of a plain causal forward."""
    import specviz.models.kvcache as kvcache

    model = tiny_pair.draft.model
    state = DraftModelState(model)
    _serve(state.sync(context))
    request, h = state.expand([10], [-1])
    _serve(request)
    request = state.sync(context + [10, 20, 30])  # 10 reused; 20 (never fed) and the bonus 30
    assert request.tokens == [20, 30]
    s = len(context) + 1
    assert request.allowed is not None and request.allowed.shape == (2, s + 2)
    assert request.allowed[:, :s].all() and request.allowed[0, s] and not request.allowed[0, s + 1]
    direct = []
    real = kvcache._direct_forward
    monkeypatch.setattr(kvcache, "_direct_forward", lambda *a, **k: direct.append(1) or real(*a, **k))
    logits = _serve(request)
    assert direct, "the catch-up ran model(...) instead of the decoder loop"
    full = _full_logits(model, context + [10, 20, 30])
    assert logits.shape == (1, full.shape[-1])  # a sync wants only the root's logits
    torch.testing.assert_close(logits, full[-1:], atol=1e-5, rtol=1e-5)
    # a long feed (a new prompt) stays unmasked: the prefill
    assert DraftModelState(model).sync(list(range(3, 3 + 40))).allowed is None


def test_batched_requests_equal_one_at_a_time(tiny_pair, context):
    """Sequences with different cache lengths and request sizes share one forward."""
    model = tiny_pair.draft.model
    contexts = [context, context[:4], [7]]
    alone, together = [DraftModelState(model) for _ in contexts], [DraftModelState(model) for _ in contexts]
    first_alone = [_serve(s.sync(c)) for s, c in zip(alone, contexts)]
    seen = []  # the LM head's inputs: a batch of syncs scores each row's last token only
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        first_together = run_draft_forwards([s.sync(c) for s, c in zip(together, contexts)])
    finally:
        hook.remove()
    assert seen == [(3, 1, model.config.hidden_size)]
    for a, b in zip(first_alone, first_together):
        assert b.shape == a.shape == (1, model.config.vocab_size)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    shapes = [([10, 11], [-1, -1]), ([12], [-1]), ([13, 14, 15], [-1, -1, -1])]
    expand_alone = [_serve(s.expand(*x)[0]) for s, x in zip(alone, shapes)]
    expand_together = run_draft_forwards([s.expand(*x)[0] for s, x in zip(together, shapes)])
    for a, b in zip(expand_alone, expand_together):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(alone, together):
        assert cache_length(a.cache) == cache_length(b.cache)
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["greedy", "iid"])
def test_draft_all_equals_drafting_alone(tiny_pair, context, mode):
    config = GREEDY if mode == "greedy" else SAMPLED
    make = [lambda: ChainDrafter(tiny_pair.draft, 3), lambda: TreeDrafter(tiny_pair.draft, kary(2, 2)),
            lambda: NgramDrafter(n=2, k=3), lambda: AdaptiveChainDrafter(tiny_pair.draft, "heuristic")]
    if mode == "greedy":  # deterministic siblings only
        make.append(lambda: DynamicTreeDrafter(tiny_pair.draft, 2, 3, 5))
        make.append(lambda: MergedDrafter([ChainDrafter(tiny_pair.draft, 2), NgramDrafter()]))
        # its second sub-drafter syncs while other rows expand: mixed requests in one forward
        make.append(lambda: MergedDrafter([ChainDrafter(tiny_pair.draft, 2), TreeDrafter(tiny_pair.draft, kary(2, 1))]))
    contexts = [torch.tensor(context[:k]) for k in range(5, 5 + len(make))]
    alone = [m().draft(c, config, mode, make_generator(i)) for i, (m, c) in enumerate(zip(make, contexts))]
    together = draft_all([m() for m in make], contexts, config, mode, [make_generator(i) for i in range(len(make))])
    for a, b in zip(alone, together):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_expand_rejects_unknown_parent(tiny_pair, context):
    state = DraftModelState(tiny_pair.draft.model)
    _serve(state.sync(context))
    with pytest.raises(ValueError, match="parent handle 3"):
        state.expand([1], [3])


# -- static trees -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [chain(4), kary(2, 2), expansion([3, 1, 2]),
                                   from_paths([(0,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0)])],
                         ids=["chain4", "kary2x2", "exp312", "paths"])
def test_tree_drafter_fills_the_shape_with_ranked_candidates(tiny_pair, context, shape):
    drafter = TreeDrafter(tiny_pair.draft, shape)
    tree = drafter.draft(torch.tensor(context), GREEDY, "greedy", None)
    assert tree.n_nodes == shape.n_nodes and int(tree.tokens[0]) == context[-1]
    assert sorted(tree.ranks.tolist()) == sorted(shape.ranks)
    assert sorted(depths(tree).tolist()) == sorted(shape.depths())
    assert tree.draft_probs is None
    model = tiny_pair.draft.model
    for i in range(1, tree.n_nodes):
        parent_path = _path_tokens(tree, int(tree.parents[i]))
        ranked = torch.argsort(_full_logits(model, context + parent_path)[-1], descending=True)
        assert int(ranked[int(tree.ranks[i])]) == int(tree.tokens[i])
    assert drafter.forwards == 1 + sum(1 for d in range(1, shape.depth))  # one per depth with children


def test_sampled_siblings_carry_their_draft_distributions(tiny_pair, context):
    drafter = TreeDrafter(tiny_pair.draft, kary(3, 2))
    tree = drafter.draft(torch.tensor(context), SAMPLED, "iid", make_generator(0))
    assert tree.draft_probs is not None and tree.draft_probs.shape == (13, tiny_pair.draft.vocab_size)
    has_kids = torch.bincount(tree.parents[1:], minlength=13) > 0
    sums = tree.draft_probs.sum(-1)
    torch.testing.assert_close(sums[has_kids], torch.ones(int(has_kids.sum())))
    assert bool((sums[~has_kids] == 0).all())
    for i in range(1, 13):
        assert float(tree.q[i]) == pytest.approx(float(tree.draft_probs[int(tree.parents[i]), int(tree.tokens[i])]))
    again = TreeDrafter(tiny_pair.draft, kary(3, 2)).draft(torch.tensor(context), SAMPLED, "iid", make_generator(0))
    assert torch.equal(tree.tokens, again.tokens)


def test_without_replacement_siblings_are_distinct_and_limited_by_support(tiny_pair, context):
    drafter = TreeDrafter(tiny_pair.draft, kary(4, 2))
    tree = drafter.draft(torch.tensor(context), SAMPLED, "without_replacement", make_generator(1))
    kids: dict[int, list[int]] = {}
    for i in range(1, tree.n_nodes):
        kids.setdefault(int(tree.parents[i]), []).append(int(tree.tokens[i]))
    assert all(len(set(v)) == len(v) for v in kids.values())
    narrow = drafter.draft(torch.tensor(context), SamplingConfig(temperature=1.0, top_k=2), "without_replacement",
                           make_generator(1))
    assert narrow.n_nodes == 1 + 2 + 4  # only two tokens have mass at every node


def test_tree_drafter_rejects_bad_specs(tiny_pair):
    with pytest.raises(TypeError, match="TreeShape"):
        TreeDrafter(tiny_pair.draft, [(0,), (1,)])
    with pytest.raises(ValueError, match="parent"):
        TreeDrafter(tiny_pair.draft, TreeShape((-1, 0, 5), (0, 0, 0)))
    with pytest.raises(ValueError, match="k must be"):
        ChainDrafter(tiny_pair.draft, 0)
    with pytest.raises(ValueError, match="sibling_sampling"):
        ChainDrafter(tiny_pair.draft, 2).draft(torch.tensor([1, 2]), GREEDY, "random", None)


# -- EAGLE-2 dynamic trees --------------------------------------------------------------------

def test_dynamic_tree_keeps_the_best_scored_connected_nodes(tiny_pair, context):
    drafter = DynamicTreeDrafter(tiny_pair.draft, topk=3, depth=4, budget=10)
    tree = drafter.draft(torch.tensor(context), GREEDY, "greedy", None)
    assert tree.budget == 10 and tree.depth <= 4
    score = torch.zeros(tree.n_nodes)
    for i in range(1, tree.n_nodes):
        score[i] = score[int(tree.parents[i])] + math.log(float(tree.q[i]))
        assert score[i] <= score[int(tree.parents[i])] + 1e-6
    # depth 1 holds the draft's top candidates at the root, best first
    root_logits = _full_logits(tiny_pair.draft.model, context)[-1]
    top = torch.topk(root_logits, 3).indices.tolist()
    first = [int(tree.tokens[i]) for i in range(1, tree.n_nodes) if int(tree.parents[i]) == 0]
    assert first == top[:len(first)] and first
    assert drafter.forwards == 4  # the sync plus one batched forward per expanded depth


def test_dynamic_tree_needs_deterministic_siblings_under_sampling(tiny_pair):
    drafter = DynamicTreeDrafter(tiny_pair.draft)
    with pytest.raises(ValueError, match="topk"):
        drafter.draft(torch.tensor([1, 2, 3]), SAMPLED, "iid", make_generator(0))
    assert drafter.draft(torch.tensor([1, 2, 3]), SAMPLED, "topk", make_generator(0)).budget == 16


# -- adaptive chains --------------------------------------------------------------------------

def test_heuristic_schedule_grows_by_two_and_shrinks_by_one(tiny_pair):
    drafter = AdaptiveChainDrafter(tiny_pair.draft, "heuristic", k_init=4, k_max=7)
    ctx = torch.tensor([5, 6, 7])
    lengths = []
    for accepted_all in (True, True, False, False, True):
        tree = drafter.draft(ctx, GREEDY, "greedy", None)
        lengths.append(tree.budget)
        drafter.observe(_fake_step(tree, tree.budget if accepted_all else 0))
    assert lengths == [4, 6, 7, 6, 5]
    assert drafter.history == lengths


def test_throughput_schedule_follows_cost_and_confidence(tiny_pair):
    ctx = torch.tensor([5, 6, 7])
    cheap = AdaptiveChainDrafter(tiny_pair.draft, "throughput", k_max=10, cost_ratio=1e-4)
    costly = AdaptiveChainDrafter(tiny_pair.draft, "throughput", k_max=10, cost_ratio=50.0)
    assert cheap.draft(ctx, GREEDY, "greedy", None).budget == 10
    assert costly.draft(ctx, GREEDY, "greedy", None).budget == 1
    # a drafter that learns its draft tokens are always accepted drafts longer chains
    mid = AdaptiveChainDrafter(tiny_pair.draft, "throughput", k_max=10, cost_ratio=0.5)
    before = mid.draft(ctx, GREEDY, "greedy", None).budget
    for _ in range(30):
        tree = mid.draft(ctx, GREEDY, "greedy", None)
        mid.observe(_fake_step(tree, tree.budget))
    assert mid.draft(ctx, GREEDY, "greedy", None).budget > before


def test_adaptive_rejects_bad_settings(tiny_pair):
    with pytest.raises(ValueError, match="schedule"):
        AdaptiveChainDrafter(tiny_pair.draft, "magic")
    with pytest.raises(ValueError, match="k_min <= k_init <= k_max"):
        AdaptiveChainDrafter(tiny_pair.draft, k_init=20, k_max=5)


# -- self-speculation -------------------------------------------------------------------------

def test_truncated_model_shares_weights_and_equals_the_first_layers(tiny_pair, context):
    target = tiny_pair.target.model
    small = truncated_model(target, 1)
    assert small.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert small.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    with torch.no_grad():
        hidden = target(torch.tensor([context]), output_hidden_states=True).hidden_states[1]
        expected = target.lm_head(target.model.norm(hidden))[0]
        got = small(torch.tensor([context])).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="n_layers"):
        truncated_model(target, 2)


def test_self_speculative_drafter_drafts_with_the_truncated_target(tiny_pair, context):
    drafter = SelfSpeculativeDrafter(tiny_pair.target, 1, kary(2, 2))
    tree = drafter.draft(torch.tensor(context), GREEDY, "greedy", None)
    assert tree.budget == 6
    small = truncated_model(tiny_pair.target.model, 1)
    with torch.no_grad():
        first = int(small(torch.tensor([context])).logits[0, -1].argmax())
    assert int(tree.tokens[1]) == first


# -- merged trees, spawn, factory -------------------------------------------------------------

def test_merged_drafter_shares_prefixes_and_labels_sources(tiny_pair, context):
    chain_drafter = ChainDrafter(tiny_pair.draft, 3)
    tree_drafter = TreeDrafter(tiny_pair.draft, kary(2, 2))
    merged = MergedDrafter([chain_drafter, tree_drafter, NgramDrafter(n=2, k=3)])
    tree = merged.draft(torch.tensor(context), GREEDY, "greedy", None)
    a = ChainDrafter(tiny_pair.draft, 3).draft(torch.tensor(context), GREEDY, "greedy", None)
    b = TreeDrafter(tiny_pair.draft, kary(2, 2)).draft(torch.tensor(context), GREEDY, "greedy", None)
    c = NgramDrafter(n=2, k=3).draft(torch.tensor(context), GREEDY, "greedy", None)

    def token_paths(t):
        return {tuple(_path_tokens(t, i)) for i in range(t.n_nodes)}

    union = token_paths(a) | token_paths(b) | token_paths(c)
    assert token_paths(tree) == union
    assert tree.n_nodes == len(union) < a.n_nodes + b.n_nodes + c.n_nodes - 2  # shared prefixes stored once
    assert tree.source is not None and set(tree.source.tolist()) <= {0, 1, 2}
    assert merged.name == "merged(chain(k=3)+tree(n=6,d=2)+ngram(n=2,k=3))"
    with pytest.raises(ValueError, match="topk"):
        merged.draft(torch.tensor(context), SAMPLED, "iid", make_generator(0))


def test_budgeted_merge_shares_the_budget_in_order(tiny_pair, context):
    ctx = torch.tensor(context)
    lookup = NgramDrafter(n=2, k=3)
    dynamic = DynamicTreeDrafter(tiny_pair.draft, topk=3, depth=4, budget=10)
    merged = MergedDrafter([lookup, dynamic], budget=6)
    assert merged.name == "merged(n=6:ngram(n=2,k=3)+dynamic(k=3,d=4,n=10))"
    first = lookup.draft(ctx, GREEDY, "greedy", None)
    assert first.budget > 0  # the context repeats itself: the lookup proposes
    tree = merged.draft(ctx, GREEDY, "greedy", None)
    assert tree.budget <= 6 and dynamic.budget == 10  # the part's own budget is untouched
    # the dynamic tree was grown to what the lookup left, so it keeps its own best nodes
    rest = DynamicTreeDrafter(tiny_pair.draft, topk=3, depth=4, budget=6 - first.budget).draft(ctx, GREEDY, "greedy",
                                                                                              None)

    def token_paths(t):
        return {tuple(_path_tokens(t, i)) for i in range(t.n_nodes)}

    assert token_paths(tree) == token_paths(first) | token_paths(rest)
    # where the lookup finds nothing, the dynamic tree takes the whole budget
    silent = torch.tensor(list(range(40, 60)))
    alone = DynamicTreeDrafter(tiny_pair.draft, topk=3, depth=4, budget=6).draft(silent, GREEDY, "greedy", None)
    assert lookup.draft(silent, GREEDY, "greedy", None).budget == 0
    assert token_paths(merged.draft(silent, GREEDY, "greedy", None)) == token_paths(alone)
    # a part without a budget of its own is cut to its first nodes; a part left nothing does not draft
    cut = MergedDrafter([ChainDrafter(tiny_pair.draft, 4), NgramDrafter(n=2, k=3)], budget=2).draft(
        ctx, GREEDY, "greedy", None)
    chain4 = ChainDrafter(tiny_pair.draft, 4).draft(ctx, GREEDY, "greedy", None)
    assert cut.tokens.tolist() == chain4.tokens[:3].tolist() and cut.parents.tolist() == [-1, 0, 1]
    # without a budget, every part's whole tree
    whole = MergedDrafter([lookup, dynamic]).draft(ctx, GREEDY, "greedy", None)
    assert whole.budget > 6
    twin = merged.spawn()
    assert twin.budget == 6 and twin.drafters[1] is not dynamic and twin.name == merged.name
    for bad in (0, -1, 2.5, "6"):
        with pytest.raises(ValueError, match="budget"):
            MergedDrafter([lookup, dynamic], budget=bad)


def test_draft_steps_within_grows_or_cuts_to_the_step_limit(tiny_pair, context):
    from specviz.draft.base import Budgeted, drafting_steps_within, run_draft_steps

    ctx = torch.tensor(context)

    def within(drafter, n):
        return run_draft_steps(drafting_steps_within(drafter, n, ctx, GREEDY, "greedy", None))

    def same(a, b):
        return a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()

    # budgeted drafters grow their own best nodes to the smaller budget, and keep their own budget
    dynamic = DynamicTreeDrafter(tiny_pair.draft, topk=3, depth=4, budget=10)
    assert same(within(dynamic, 4), DynamicTreeDrafter(tiny_pair.draft, topk=3, depth=4, budget=4).draft(
        ctx, GREEDY, "greedy", None))
    assert same(within(dynamic, 50), dynamic.draft(ctx, GREEDY, "greedy", None)) and dynamic.budget == 10
    trie = NgramTrieDrafter(n=2, depth=4, budget=12, max_matches=4)
    assert same(within(trie, 3), NgramTrieDrafter(n=2, depth=4, budget=3, max_matches=4).draft(
        ctx, GREEDY, "greedy", None)) and trie.budget == 12
    assert isinstance(dynamic, Budgeted) and isinstance(trie, Budgeted)
    # any other drafter: its tree cut to the first nodes
    chain = ChainDrafter(tiny_pair.draft, 4)
    assert not isinstance(chain, Budgeted)
    cut = within(chain, 2)
    assert cut.tokens.tolist() == chain.draft(ctx, GREEDY, "greedy", None).tokens[:3].tolist()
    for drafter in (dynamic, trie, chain):
        with pytest.raises(ValueError, match="max_nodes"):
            within(drafter, 0)


def test_spawn_gives_independent_state(tiny_pair, context):
    drafter = ChainDrafter(tiny_pair.draft, 3)
    drafter.draft(torch.tensor(context), GREEDY, "greedy", None)
    clone = drafter.spawn()
    assert clone.state is not drafter.state and cache_length(clone.state.cache) == 0
    assert clone.draft_model is drafter.draft_model
    merged = MergedDrafter([drafter, NgramDrafter()])
    twin = merged.spawn()
    assert twin.drafters[0] is not drafter and twin.drafters[0].state is not drafter.state

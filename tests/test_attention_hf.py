"""specviz's tree attention inside a transformers model (specviz.attention.hf): the verification
forward with "specviz" and "specviz-split" gives transformers' sdpa logits (bitwise for the
masked variant, in fp32 and bf16), speculative decoding gives the same tokens either way, and
the model's attention implementation is always restored."""

import pytest
import torch

from specviz.attention import hf
from specviz.attention.hf import ATTENTION_CHOICES, attention_implementation
from specviz.decode import speculative_generate, speculative_generate_batch
from specviz.draft import DynamicTreeDrafter, TreeDrafter
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.tiny import tiny_pair as make_tiny_pair
from specviz.tree.core import DraftTree, pad_trees
from specviz.tree.shapes import expansion

TOL = dict(atol=1e-5, rtol=1e-5)


def random_tree(n_nodes: int, g: torch.Generator, vocab: int = 200) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n_nodes)]
    return DraftTree.from_lists(torch.randint(0, vocab, (n_nodes,), generator=g).tolist(), parents)


def prefilled(model, prefixes: list[list[int]]):
    """A cache holding each prefix as one right-padded row (padding hidden by the mask)."""
    cache = new_cache(model)
    lens = [len(p) for p in prefixes]
    m = max(lens)
    ids = torch.zeros(len(prefixes), m, dtype=torch.long)  # (B, m)
    allowed = torch.ones(len(prefixes), m, m, dtype=torch.bool).tril()  # (B, m, m)
    for r, p in enumerate(prefixes):
        ids[r, :len(p)] = torch.tensor(p)
        allowed[r, :, len(p):] = False
        allowed[r].fill_diagonal_(True)
    forward_tokens(model, cache, ids, torch.arange(m).expand(len(prefixes), m), allowed, attention="sdpa")
    return cache, lens


def verify_logits(model, prefixes, trees, attention):
    cache, lens = prefilled(model, prefixes)
    batch = pad_trees(trees, lens)
    return forward_tokens(model, cache, batch.tokens, batch.position_ids, batch.mask, attention=attention)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_single_tree_logits_equal_sdpa(dtype):
    model = make_tiny_pair(dtype=dtype).target.model
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(0, 200, (37,), generator=g).tolist()]
    trees = [random_tree(12, g)]
    out = {a: verify_logits(model, prefixes, trees, a) for a in ATTENTION_CHOICES}
    # the masked variant is the same SDPA call on un-copied K/V heads: bitwise equal
    assert torch.equal(out["specviz"], out["sdpa"])
    if dtype == "fp32":
        torch.testing.assert_close(out["specviz-split"], out["sdpa"], **TOL)
    assert model.config._attn_implementation == "sdpa"


def test_batch_with_different_prefix_lengths_equals_sdpa(tiny_pair, monkeypatch):
    """Rows share only the shortest prefix: the split attends that part unmasked and the
    rest (the longer rows' extra slots, the trees) with the mask. Trees of different sizes
    add padding queries that see only themselves, so nothing is shared: the masked path."""
    model = tiny_pair.target.model
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (23, 9, 16)]
    splits = []
    split = hf.split_tree_attention
    monkeypatch.setattr(hf, "split_tree_attention", lambda q, k, v, m, shared, **kw: (
        splits.append(shared), split(q, k, v, m, shared, **kw))[1])
    for sizes, shared in [((8, 8, 8), 9), ((7, 11, 1), None)]:
        trees = [random_tree(n, g) for n in sizes]
        out = {a: verify_logits(model, prefixes, trees, a) for a in ATTENTION_CHOICES}
        assert torch.equal(out["specviz"], out["sdpa"])
        torch.testing.assert_close(out["specviz-split"], out["sdpa"], **TOL)
        assert splits == ([shared] * model.config.num_hidden_layers if shared else [])
        splits.clear()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_token_forward_with_a_mask_equals_sdpa(dtype):
    """A root-only tree (the last step of a budget) is one query: sdpa's own call, bitwise."""
    model = make_tiny_pair(dtype=dtype).target.model
    g = torch.Generator().manual_seed(2)
    prefixes = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (300, 41)]
    trees = [DraftTree.from_lists([7], [-1]), DraftTree.from_lists([9], [-1])]
    out = {a: verify_logits(model, prefixes, trees, a) for a in ATTENTION_CHOICES}
    assert torch.equal(out["specviz"], out["sdpa"]) and torch.equal(out["specviz-split"], out["sdpa"])


def test_prefill_with_padding_falls_back_to_the_masked_path(tiny_pair):
    """A padded prefill shares no key across all queries: the split variant is the masked one."""
    model = tiny_pair.target.model
    logits = {}
    for a in ATTENTION_CHOICES:
        cache = new_cache(model)
        ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]])
        allowed = torch.ones(2, 5, 5, dtype=torch.bool).tril()
        allowed[1, :, 2:] = False
        allowed[1].fill_diagonal_(True)
        logits[a] = forward_tokens(model, cache, ids, torch.arange(5).expand(2, 5), allowed, attention=a)
    assert torch.equal(logits["specviz"], logits["sdpa"])
    assert torch.equal(logits["specviz-split"], logits["sdpa"])


@pytest.mark.parametrize("attention", ["specviz", "specviz-split"])
def test_speculative_greedy_output_is_identical(tiny_pair, attention):
    prompt = "def fizzbuzz(n):"
    for make in (lambda: TreeDrafter(tiny_pair.draft, expansion([3, 2, 1])),
                 lambda: DynamicTreeDrafter(tiny_pair.draft, topk=3, depth=4, budget=10)):
        ref = speculative_generate(tiny_pair.target, make(), prompt, max_new_tokens=24, attention="sdpa")
        got = speculative_generate(tiny_pair.target, make(), prompt, max_new_tokens=24, attention=attention)
        assert got.output_ids == ref.output_ids
        assert [s.acceptance.accepted_nodes for s in got.steps] == [s.acceptance.accepted_nodes for s in ref.steps]
    prompts = ["def f(x):", "What is 17 * 23?"]
    drafter = TreeDrafter(tiny_pair.draft, expansion([2, 2]))
    ref = speculative_generate_batch(tiny_pair.target, drafter, prompts, max_new_tokens=16, attention="sdpa")
    got = speculative_generate_batch(tiny_pair.target, drafter, prompts, max_new_tokens=16, attention=attention)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]


def test_no_mask_under_specviz_is_plain_causal_sdpa(tiny_pair):
    model = tiny_pair.target.model
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ref = model(ids).logits
        with attention_implementation(model, "specviz"):
            assert model.config._attn_implementation == "specviz"
            got = model(ids).logits
    assert torch.equal(got, ref)
    assert model.config._attn_implementation == "sdpa"


def test_implementation_restored_when_the_forward_raises(tiny_pair):
    model = tiny_pair.target.model
    cache, lens = prefilled(model, [[1, 2, 3]])
    batch = pad_trees([DraftTree.from_lists([3, 4], [-1, 0])], lens)
    bad = torch.full_like(batch.tokens, 10 ** 6)  # outside the vocabulary: the embedding raises
    with pytest.raises(IndexError):
        forward_tokens(model, cache, bad, batch.position_ids, batch.mask, attention="specviz")
    assert model.config._attn_implementation == "sdpa"


def test_bad_attention_choices(tiny_pair):
    model = tiny_pair.target.model
    cache = new_cache(model)
    with pytest.raises(ValueError, match="attention must be one of .*'flash'"):
        forward_tokens(model, cache, torch.tensor([[1]]), torch.tensor([[0]]), None, attention="flash")
    with pytest.raises(ValueError, match="name must be one of .*'nope'"):
        with attention_implementation(model, "nope"):
            pass
    assert model.config._attn_implementation == "sdpa"

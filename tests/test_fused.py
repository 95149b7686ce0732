"""Fused decoder layers for a ``w4a8-token`` draft (specviz.models.fused)."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch

from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft.fallback import FallbackDrafter
from specviz.draft.model import ChainDrafter, DynamicTreeDrafter, TreeDrafter
from specviz.draft.ngram import NgramDrafter
from specviz.quant.extension import w4a8_token_op
from specviz.models.fused import (FUSED_MAX_TOKENS, causal_over_cache, fuse_layers, fused_support, is_fused,
                                  layers_of)
from specviz.models.kvcache import direct_forward_supported, cache_length, crop_cache, forward_tokens, new_cache
from specviz.models.loading import load_model
from specviz.models.tiny import tiny_pair as make_tiny_pair
from specviz.tree.core import path_to, tree_attention_mask
from specviz.tree.shapes import expansion

pytestmark = pytest.mark.skipif(w4a8_token_op() is None, reason="the compiled operator is not available")

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def w4_pair():
    return make_tiny_pair(dtype="fp32", draft_dtype="w4a8-token")


def _decode(model, ids: torch.Tensor, steps: int, layers: str):
    """Prefill ``ids`` then ``steps`` greedy one-token forwards with the draft's layers run
    as ``layers``; (logits per step, cache)."""
    fuse_layers(model, layers)
    try:
        cache = new_cache(model)
        n = ids.shape[1]
        logits = [forward_tokens(model, cache, ids, torch.arange(n)[None], None, 1)[0, -1]]
        for i in range(steps):
            token = logits[-1].argmax().view(1, 1)
            logits.append(forward_tokens(model, cache, token, torch.tensor([[n + i]]), None, 1)[0, -1])
        return torch.stack(logits), cache
    finally:
        fuse_layers(model)


def test_load_pair_fuses_a_w4a8_draft_only(w4_pair):
    assert layers_of(w4_pair.draft.model) == "fused-one-pass" and not is_fused(w4_pair.target.model)
    assert fused_support(w4_pair.draft.model) is None
    assert "not w4a8-token layers" in fused_support(w4_pair.target.model)
    pair = make_tiny_pair(dtype="fp32", draft_dtype="w4a8-token", draft_layers="modules")
    assert layers_of(pair.draft.model) == "modules"
    assert not is_fused(make_tiny_pair(dtype="w8a8-token").draft.model)  # another mode: modules
    for retired in ("fast", "fused"):  # "fused", the two activation passes, is retired
        with pytest.raises(ValueError, match="draft_layers must be one of"):
            make_tiny_pair(draft_dtype="w4a8-token", draft_layers=retired)
    with pytest.raises(ValueError, match="layers must be one of"):
        fuse_layers(w4_pair.draft.model, True)


def test_fused_layers_approximate_the_modules_and_fill_the_same_cache(w4_pair):
    model = w4_pair.draft.model
    ids = w4_pair.draft.tokenizer(PROMPT, return_tensors="pt").input_ids
    modules, module_cache = _decode(model, ids, 12, "modules")
    scale = modules.abs().max()
    fused, fused_cache = _decode(model, ids, 12, "fused-one-pass")
    tolerance = 0.05  # one activation pass and the operator's own float code: rounding
    assert (fused - modules).abs().max() < tolerance * scale  # rounding, not a different computation
    assert not torch.equal(fused, modules)  # its own float code: not the modules' bits
    assert (fused.argmax(-1) == modules.argmax(-1)).float().mean() >= 0.8
    assert cache_length(fused_cache) == cache_length(module_cache) == ids.shape[1] + 12
    for a, b in zip(fused_cache.layers, module_cache.layers):
        assert a.keys.shape == b.keys.shape
        assert (a.keys - b.keys).abs().max() < tolerance * b.keys.abs().max()
        assert (a.values - b.values).abs().max() < tolerance * b.values.abs().max()


def test_a_fused_forward_of_several_tokens_equals_one_token_forwards_bit_for_bit(w4_pair):
    """Every row runs the same code whatever the forward holds: a catch-up of three tokens
    gives each token the logits and cache entries of feeding it alone."""
    model = w4_pair.draft.model
    fuse_layers(model, "fused-one-pass")
    ids = w4_pair.draft.tokenizer(PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    new = torch.tensor([[11, 12, 13]])
    one = new_cache(model)
    forward_tokens(model, one, ids, torch.arange(n)[None], None, 1)
    singles = torch.cat([forward_tokens(model, one, new[:, i:i + 1], torch.tensor([[n + i]]), None)
                         for i in range(3)], dim=1)  # (1, 3, V)
    three = new_cache(model)
    forward_tokens(model, three, ids, torch.arange(n)[None], None, 1)
    allowed = torch.ones(3, n + 3, dtype=torch.bool).tril(n)[None]  # a catch-up's causal mask
    together = forward_tokens(model, three, new, torch.arange(n, n + 3)[None], allowed)
    assert torch.equal(singles, together)
    for a, b in zip(one.layers, three.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    fuse_layers(model)


def test_one_pass_holds_for_the_modules_forwards_too(w4_pair):
    """``fused-one-pass`` puts every product of the draft (head included) in one activation
    pass, so a tree forward through the modules is one pass as well; ``"modules"`` gives
    each layer back the passes it was built with."""
    from specviz.quant.w4a8 import W4A8TokenLinear

    model = w4_pair.draft.model
    products = [m for m in model.modules() if isinstance(m, W4A8TokenLinear)]
    assert len(products) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate/up, down per layer, head
    ids = w4_pair.draft.tokenizer(PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    p = n - 3
    allowed = torch.ones(1, 3, n, dtype=torch.bool)
    allowed[0, :, p:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a tree: not causal

    def prefill_and_tree():
        cache = new_cache(model)
        first = forward_tokens(model, cache, ids[:, :p], torch.arange(p)[None], None)  # a prefill
        # the tree forward onto one cache for every choice: a fused prefill fills the cache with
        # other rounding than the modules', and int8 activation codes can flip on such a difference
        cache = copy.deepcopy(start)
        tree = forward_tokens(model, cache, ids[:, p:], torch.tensor([[p, p + 1, p + 1]]), allowed)  # modules
        return first, tree, forward_tokens(model, cache, torch.tensor([[5]]), torch.tensor([[n]]), None)

    fuse_layers(model, "modules")
    start = new_cache(model)
    forward_tokens(model, start, ids[:, :p], torch.arange(p)[None], None)
    try:
        results = {}
        for layers in ("fused-one-pass", "modules", "fused-one-pass", "modules"):
            fuse_layers(model, layers)
            assert {m.residual for m in products} == {layers == "modules"}
            results.setdefault(layers, []).append(prefill_and_tree())
        for runs in results.values():  # switching back and forth gives the same bits
            assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[-1]))
        one, two = results["fused-one-pass"][0][1], results["modules"][0][1]
        assert not torch.equal(one, two) and (one - two).abs().max() < 0.05 * two.abs().max()
        fuse_layers(model, "fused-one-pass")
        for layer in products:  # in one pass, the operator still computes the PyTorch code's bits
            x = torch.randn(2, layer.in_features)
            assert torch.equal(layer(x), layer.forward_pytorch(x))
    finally:
        fuse_layers(model)


def test_tree_masks_run_the_modules_and_crops_reuse_the_buffers(w4_pair, monkeypatch):
    import specviz.models.kvcache as kvcache

    model = w4_pair.draft.model
    ids = w4_pair.draft.tokenizer(PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    cache = new_cache(model)
    forward_tokens(model, cache, ids, torch.arange(n)[None], None, 1)
    calls = []
    real = kvcache.fused_forward
    monkeypatch.setattr(kvcache, "fused_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    tree = torch.ones(1, 2, n + 2, dtype=torch.bool)
    tree[0, 1, n] = False  # two siblings: not causal
    assert not causal_over_cache(tree, n)
    forward_tokens(model, cache, torch.tensor([[5, 6]]), torch.tensor([[n, n]]), tree)
    assert not calls and cache_length(cache) == n + 2
    long = new_cache(model)  # a prefill longer than FUSED_MAX_TOKENS runs the modules as well
    forward_tokens(model, long, torch.arange(1, FUSED_MAX_TOKENS + 2)[None], torch.arange(FUSED_MAX_TOKENS + 1)[None],
                   None, 1)
    assert not calls and cache_length(long) == FUSED_MAX_TOKENS + 1
    crop_cache(cache, n)
    forward_tokens(model, cache, torch.tensor([[5]]), torch.tensor([[n]]), None)
    assert calls and cache_length(cache) == n + 1
    buffer = cache.layers[0]._specviz_buffers["keys"]
    assert cache.layers[0].keys.data_ptr() == buffer.data_ptr()
    crop_cache(cache, n)
    forward_tokens(model, cache, torch.tensor([[7]]), torch.tensor([[n]]), None)
    assert len(calls) == 2 and cache_length(cache) == n + 1
    assert cache.layers[0].keys.data_ptr() == buffer.data_ptr()  # written in place behind the prefix
    assert causal_over_cache(None, 7) and causal_over_cache(torch.ones(2, 1, 8, dtype=torch.bool), 7)
    assert not causal_over_cache(torch.ones(1, 2, 9, dtype=torch.bool), 7)


@pytest.mark.parametrize("make", [lambda d: ChainDrafter(d, 3), lambda d: TreeDrafter(d, expansion((2, 2))),
                                  lambda d: DynamicTreeDrafter(d, budget=8),
                                  lambda d: FallbackDrafter([NgramDrafter(3, 4), ChainDrafter(d, 2)])],
                         ids=["chain", "tree", "dynamic", "fallback"])
@pytest.mark.parametrize("target_dtype", ["fp32", "w8a8-token"])
def test_a_fused_draft_keeps_greedy_decoding_exact(make, target_dtype):
    pair = make_tiny_pair(dtype=target_dtype, draft_dtype="w4a8-token")
    assert layers_of(pair.draft.model) == "fused-one-pass"
    plain = plain_generate(pair.target, PROMPT, max_new_tokens=32)
    spec = speculative_generate(pair.target, make(pair.draft), PROMPT, max_new_tokens=32)
    assert spec.output_ids == plain.output_ids
    assert spec.n_steps < len(plain.output_ids)


def test_unsupported_models_say_why(w4_pair):
    model = load_model(w4_pair.target, "fp32").model
    assert "not w4a8-token layers" in fused_support(model)
    draft = w4_pair.draft.model
    handle = draft.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    try:
        assert "forward hook" in fused_support(draft)
        ids = torch.tensor([[1, 2, 3]])
        forward_tokens(draft, new_cache(draft), ids, torch.arange(3)[None], None)  # the modules run, hook and all
    finally:
        handle.remove()
    assert fused_support(draft) is None and direct_forward_supported(draft)


def test_the_operator_checks_its_inputs(w4_pair):
    draft = w4_pair.draft.model
    from specviz.models.fused import _model_params

    p = _model_params(draft)[0]
    h = torch.zeros(1, 1, draft.config.hidden_size)
    d = p[17]
    cos = sin = torch.zeros(1, 1, d)
    small = torch.zeros(1, p[16], 0, d)  # no room for the new slot
    with pytest.raises(RuntimeError, match="cache buffers must be float32"):
        torch.ops.specviz.w4a8_decoder_layer(h, small, small, 0, cos, sin, *p, True)
    room = torch.zeros(1, p[16], 4, d)
    with pytest.raises(RuntimeError, match="cos and sin must be float32"):
        torch.ops.specviz.w4a8_decoder_layer(h, room, room.clone(), 0, cos[..., :2], sin[..., :2], *p, True)


def test_the_operator_attends_where_allowed_marks(w4_pair):
    """With ``allowed``, each new row sees exactly the slots it marks: a causal mask gives the
    causal call's outputs bit for bit, a tree mask the outputs of separate causal calls along
    each root-to-node path."""
    draft = w4_pair.draft.model
    from specviz.models.fused import _model_params

    p = _model_params(draft)[0]
    kv, d, e = p[16], p[17], draft.config.hidden_size
    op = torch.ops.specviz.w4a8_decoder_layer
    gen = torch.Generator().manual_seed(0)
    held, n = 5, 4
    h = torch.randn(1, n, e, generator=gen)
    cos, sin = torch.randn(1, n, d, generator=gen).cos(), torch.randn(1, n, d, generator=gen).sin()
    keys, values = torch.randn(1, kv, held + n, d, generator=gen), torch.randn(1, kv, held + n, d, generator=gen)

    def run(rows, slots, allowed):
        k, v = keys[:, :, :slots].clone(), values[:, :, :slots].clone()
        return op(h[:, rows].contiguous(), k, v, slots - len(rows), cos[:, rows].contiguous(),
                  sin[:, rows].contiguous(), *p, True, allowed)

    causal = torch.ones(n, held + n, dtype=torch.bool).tril(held)[None]
    torch.testing.assert_close(run(list(range(n)), held + n, causal), run(list(range(n)), held + n, None),
                               rtol=0, atol=0)
    # a tree: 0 and 1 children of the context, 2 child of 0, 3 child of 2
    parents = [-1, -1, 0, 2]
    tree = tree_attention_mask(parents, held)[None]  # (1, n, held + n)
    got = run(list(range(n)), held + n, tree)
    for i in range(n):
        path = path_to(parents, i)
        # the path's rows fed causally after the context: their keys and values sit in slots held...
        k = torch.cat([keys[:, :, :held], keys[:, :, [held + j for j in path]]], dim=2)
        v = torch.cat([values[:, :, :held], values[:, :, [held + j for j in path]]], dim=2)
        ref = op(h[:, path].contiguous(), k, v, held, cos[:, path].contiguous(), sin[:, path].contiguous(), *p, True)
        torch.testing.assert_close(got[0, i], ref[0, -1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, run(list(range(n)), held + n, None), atol=1e-3)  # the mask changed rows 1-3
    with pytest.raises(RuntimeError, match="allowed must be a bool"):
        run(list(range(n)), held + n, tree[..., :-1])
    with pytest.raises(RuntimeError, match="marks no slot"):
        run(list(range(n)), held + n, torch.zeros_like(tree))


def test_bench_records_how_the_draft_layers_ran(tmp_path, capsys):
    from specviz.bench.__main__ import main
    from specviz.bench.e2e import COLUMNS, load_results

    out = tmp_path / "bench.csv"
    common = ["--models", "tiny", "--dtype", "fp32", "--draft-dtype", "w4a8-token", "--limit", "1",
              "--max-new-tokens", "8", "--warmup-tokens", "2", "--no-predict", "--methods", "plain", "chain-k2"]
    assert main(common + ["--out", str(out)]) == 0
    assert "draft decoder layers: fused-one-pass" in capsys.readouterr().out
    rows = load_results(out)
    assert set(rows["draft_layers"]) == {"fused-one-pass"}
    assert bool(rows.loc[rows["method"] == "chain-k2", "matches_plain"].all())
    assert main(common + ["--draft-layers", "modules", "--out", str(out)]) == 2  # resuming another way is refused
    assert "draft_layers" in capsys.readouterr().err
    other = tmp_path / "modules.csv"
    assert main(common + ["--draft-layers", "modules", "--out", str(other)]) == 0
    assert set(load_results(other)["draft_layers"]) == {"modules"}
    assert main(common + ["--draft-layers", "fast", "--out", str(other)]) == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err
    old = pd.read_csv(out).drop(columns=["draft_layers"])  # a file from before the column
    old.to_csv(tmp_path / "old.csv", index=False)
    back = load_results(tmp_path / "old.csv")
    assert list(back.columns) == list(COLUMNS) and set(back["draft_layers"]) == {"modules"}

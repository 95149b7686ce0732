"""forward_tokens' layer-by-layer decoder loop gives bitwise the logits and hidden states of
transformers' own forward, in every case the engine uses it."""

import pytest
import torch

import specviz.models.kvcache as kv
import specviz.models.slots as slots
from specviz.models.kvcache import cache_length, forward_tokens, new_cache, stack_caches
from specviz.models.tiny import tiny_model


def _both(monkeypatch, model, make_cache, tokens, positions, allowed, **kw):
    """(transformers' forward, the direct loop) outputs and the caches they left."""
    outs, caches = [], []
    calls = []
    real = kv._direct_forward
    monkeypatch.setattr(kv, "_direct_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    for direct in (False, True):
        monkeypatch.setattr(kv, "direct_forward_supported",
                            (lambda m: False) if not direct else kv.__dict__["_supported_original"])
        cache = make_cache()
        outs.append(forward_tokens(model, cache, tokens, positions, allowed, **kw))
        caches.append(cache)
    assert len(calls) == 1  # the second run really took the direct loop
    return outs, caches


@pytest.fixture(autouse=True)
def _keep_original(monkeypatch):
    monkeypatch.setitem(kv.__dict__, "_supported_original", kv.direct_forward_supported)


def _prefilled(model, ids):
    def make():
        cache = new_cache(model)
        forward_tokens(model, cache, ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)
        return cache
    return make


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch,device", [("qwen2", "cpu"), ("qwen2-w8a8-token", "cpu"), ("llama", "cpu"),
                                         pytest.param("qwen2", "cuda", marks=needs_cuda),
                                         pytest.param("qwen2-bf16", "cuda", marks=needs_cuda)])
@pytest.mark.parametrize("attention", ["specviz", "specviz-split"])
def test_tree_forward_is_bitwise_transformers(monkeypatch, arch, device, attention):
    if device == "cuda" and attention == "specviz-split":
        pytest.skip("the split tree attention runs on the CPU only")
    if arch == "llama":
        model = _llama()
    else:
        dtype = {"qwen2": torch.float32, "qwen2-w8a8-token": "w8a8-token", "qwen2-bf16": "bf16"}[arch]
        model = tiny_model(dtype=dtype, device=device).model
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(1))
    # a tree of 4 nodes: root, two children, a grandchild under the second
    tokens = torch.tensor([[5, 6, 7, 8]])
    positions = torch.tensor([[9, 10, 10, 11]])
    allowed = torch.ones(1, 4, 13, dtype=torch.bool)
    allowed[0, :, 9:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    (ref, ours), caches = _both(monkeypatch, model, _prefilled(model, ids), tokens, positions, allowed,
                                attention=attention, hidden=True)
    assert torch.equal(ref[0], ours[0]) and torch.equal(ref[1], ours[1])
    assert ours[1].shape == (1, 4, 64) and ours[0].dtype == torch.float32 and ours[0].device.type == "cpu"
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_one_token_batch_and_logits_to_keep(monkeypatch, tiny_pair):
    model = tiny_pair.target.model
    rows = [torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 8)]

    def make():
        caches = []
        for r in rows:
            c = new_cache(model)
            forward_tokens(model, c, r, torch.arange(r.shape[1])[None], None)
            caches.append(c)
        return stack_caches(model, caches)

    # rows of different lengths: the shorter row's padding is hidden by its mask
    allowed = torch.ones(2, 1, 9, dtype=torch.bool)
    allowed[0, 0, 5:8] = False
    (ref, ours), _ = _both(monkeypatch, model, make, torch.tensor([[11], [12]]), torch.tensor([[5], [8]]),
                           allowed, logits_to_keep=1)
    assert torch.equal(ref, ours) and ours.shape == (2, 1, model.config.vocab_size)
    # one token per row without a mask: every cached slot visible
    one = rows[1]
    (ref, ours), caches = _both(monkeypatch, model, _prefilled(model, one), torch.tensor([[11]]),
                                torch.tensor([[8]]), None)
    assert torch.equal(ref, ours) and cache_length(caches[1]) == 9


def test_hooks_and_unsupported_cases_run_transformers_forward(tiny_pair):
    model = tiny_pair.target.model
    assert kv.direct_forward_supported(model)
    handle = model.register_forward_pre_hook(lambda *a: None)
    try:
        assert not kv.direct_forward_supported(model)
    finally:
        handle.remove()
    handle = model.model.register_forward_hook(lambda *a: None)
    try:
        assert not kv.direct_forward_supported(model)
    finally:
        handle.remove()
    model.train()
    try:
        assert not kv.direct_forward_supported(model)
    finally:
        model.eval()
    assert kv.direct_forward_supported(model)


def _tree_inputs():
    tokens = torch.tensor([[5, 6, 7, 8]])
    positions = torch.tensor([[9, 10, 10, 11]])
    allowed = torch.ones(1, 4, 13, dtype=torch.bool)
    allowed[0, :, 9:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    return tokens, positions, allowed


def _run(model, tokens, positions, allowed, **kw):
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(1))
    cache = _prefilled(model, ids)()
    out = forward_tokens(model, cache, tokens, positions, allowed, hidden=True, **kw)
    return out, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-w8a8-token", "llama"])
def test_traced_layers_are_bitwise_the_python_loop(monkeypatch, arch):
    """On a CPU the direct loop runs each layer's halves as TorchScript programs; the Python
    module calls (SPECVIZ_NO_TRACE=1) give bitwise the same logits, hidden states and cache."""
    model = _llama() if arch == "llama" else tiny_model(dtype={"qwen2": torch.float32,
                                                               "qwen2-w8a8-token": "w8a8-token"}[arch]).model
    monkeypatch.setenv(kv.NO_TRACE_ENV, "1")
    _run(model, *_tree_inputs())
    assert model not in kv._programs  # switched off: nothing recorded
    for tokens, positions, allowed in (_tree_inputs(), (torch.tensor([[11]]), torch.tensor([[9]]), None),
                                       (torch.tensor([[11, 12, 13]]), torch.tensor([[9, 10, 11]]),
                                        torch.ones(1, 3, 12, dtype=torch.bool).tril(9))):
        monkeypatch.setenv(kv.NO_TRACE_ENV, "1")
        ref, ref_cache = _run(model, tokens, positions, allowed)
        monkeypatch.delenv(kv.NO_TRACE_ENV)
        ours, our_cache = _run(model, tokens, positions, allowed)
        assert kv._programs.get(model) is not None  # the programs ran
        assert torch.equal(ref[0], ours[0]) and torch.equal(ref[1], ours[1])
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(ref_cache, our_cache))


def test_traced_layers_follow_hooks_and_swapped_modules():
    """A forward hook inside a layer runs (the Python loop takes over); a module swapped in
    after the programs were recorded is used (they are recorded again)."""
    model = tiny_model(seed=3).model
    tokens, positions, allowed = _tree_inputs()
    first, _ = _run(model, tokens, positions, allowed)
    programs = kv._programs[model][2]
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    try:
        hooked, _ = _run(model, tokens, positions, allowed)
    finally:
        handle.remove()
    assert seen and torch.equal(hooked[0], first[0])
    assert kv._programs[model][2] is programs  # unchanged model: the same programs again
    _run(model, tokens, positions, allowed)
    assert kv._programs[model][2] is programs
    old = model.model.layers[0].mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 2)
    model.model.layers[0].mlp.down_proj = new
    swapped, _ = _run(model, tokens, positions, allowed)
    assert kv._programs[model][2] is not programs
    expected = model(input_ids=torch.cat([torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(1)),
                                          tokens[:, :2]], dim=1)).logits[0, -1]
    assert not torch.equal(swapped[0][0, 1], first[0][0, 1])
    assert torch.allclose(swapped[0][0, 1], expected, atol=1e-5)  # node 1 follows the root: a causal path


class _UserSiLU(torch.nn.Module):
    """A user's own module: outside TRACEABLE_MODULES, so no program may record it."""

    def forward(self, x):
        return torch.nn.functional.silu(x)


def test_layers_with_other_modules_run_in_python():
    """A layer holding a module a recorded program may not reproduce (a user's own module)
    runs as Python calls (and still equals transformers' forward)."""
    model = tiny_model(dtype="w8a8-token").model
    for layer in model.model.layers:
        layer.mlp.act_fn = _UserSiLU()
    tokens, positions, allowed = _tree_inputs()
    ours, _ = _run(model, tokens, positions, allowed)
    assert model not in kv._programs
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(1))
    cache = _prefilled(model, ids)()
    ref = forward_tokens(model, cache, tokens, positions, allowed, attention="sdpa")
    assert torch.equal(ref, ours[0])


def test_cache_appends_in_place_with_the_concatenations_values(monkeypatch):
    """New slots go into spare room behind the old ones (no copy of the cache per forward),
    also after a crop or a compaction narrowed it, and every logit and cache entry is the one
    transformers' concatenating update gives."""
    model = tiny_model(seed=3).model
    ids = torch.randint(0, 200, (1, 70))
    monkeypatch.setattr(slots, "APPEND_FROM", 20)  # the first 19 slots concatenate, the rest append

    def run(use_buffers):
        if not use_buffers:
            monkeypatch.setattr(kv, "append_kv", lambda cache, k, v, i: cache.update(k, v, i))
        cache, logits, pointers = new_cache(model), [], []
        # a one-token prefill, then decoding steps, a crop, a tree-like masked forward and a compaction
        for pos in range(60):
            logits.append(forward_tokens(model, cache, ids[:, pos:pos + 1], torch.tensor([[pos]]), None))
            pointers.append(cache.layers[0].keys.data_ptr())
        kv.crop_cache(cache, 55)
        allowed = torch.ones(1, 3, 58, dtype=torch.bool)
        allowed[0, 1, 56] = allowed[0, 2, 56] = allowed[0, 2, 57] = False  # three siblings
        logits.append(forward_tokens(model, cache, ids[:, 55:58], torch.tensor([[55, 55, 55]]), allowed))
        pointers.append(cache.layers[0].keys.data_ptr())
        kv.compact_cache(cache, [55], [[57]], 56)
        logits.append(forward_tokens(model, cache, ids[:, 60:61], torch.tensor([[56]]), None))
        pointers.append(cache.layers[0].keys.data_ptr())
        monkeypatch.undo()
        monkeypatch.setitem(kv.__dict__, "_supported_original", kv.direct_forward_supported)
        monkeypatch.setattr(slots, "APPEND_FROM", 20)
        return logits, cache, pointers

    reference, ref_cache, ref_ptrs = run(False)
    logits, cache, ptrs = run(True)
    assert all(torch.equal(a, b) for a, b in zip(reference, logits))
    for a, b in zip(ref_cache.layers, cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert len(set(ref_ptrs)) > 10  # the concatenation copies on every forward (freed blocks get reused)
    assert len(set(ptrs[19:])) <= 2  # from 20 slots: a buffer with 64 slots of room, grown once at most
    assert ptrs[-1] == ptrs[-3]  # the crop and the compaction kept writing into the same buffer

"""forward_tokens' layer-by-layer decoder loop gives bitwise the logits and hidden states of
transformers' own forward, in every case the engine uses it."""

import pytest
import torch

import specviz.models.kvcache as kv
from specviz.models.kvcache import cache_length, forward_tokens, new_cache, stack_caches
from specviz.models.loading import tiny_model


def _both(monkeypatch, model, make_cache, tokens, positions, allowed, **kw):
    """(transformers' forward, the direct loop) outputs and the caches they left."""
    outs, caches = [], []
    calls = []
    real = kv._direct_forward
    monkeypatch.setattr(kv, "_direct_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    for direct in (False, True):
        monkeypatch.setattr(kv, "_direct_forward_supported",
                            (lambda m: False) if not direct else kv.__dict__["_supported_original"])
        cache = make_cache()
        outs.append(forward_tokens(model, cache, tokens, positions, allowed, **kw))
        caches.append(cache)
    assert len(calls) == 1  # the second run really took the direct loop
    return outs, caches


@pytest.fixture(autouse=True)
def _keep_original(monkeypatch):
    monkeypatch.setitem(kv.__dict__, "_supported_original", kv._direct_forward_supported)


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
    assert kv._direct_forward_supported(model)
    handle = model.register_forward_pre_hook(lambda *a: None)
    try:
        assert not kv._direct_forward_supported(model)
    finally:
        handle.remove()
    handle = model.model.register_forward_hook(lambda *a: None)
    try:
        assert not kv._direct_forward_supported(model)
    finally:
        handle.remove()
    model.train()
    try:
        assert not kv._direct_forward_supported(model)
    finally:
        model.eval()
    assert kv._direct_forward_supported(model)

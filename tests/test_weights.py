"""Weight modes (specviz.models.weights) on the tiny random pair: every mode runs with a KV
cache, quantized layers stay close to the fp32 reference, speculative decoding in int8
commits exactly what plain int8 decoding does; and the teacher-forced agreement tables of
specviz.checks.accuracy."""

from __future__ import annotations

import copy
import os

import pandas as pd
import pytest
import torch
from torch import nn

from specviz.checks.accuracy import (
    accuracy_bar,
    agreement_by_category,
    agreement_table,
    greedy_choices,
    reference_texts,
    teacher_forced_agreement,
)
from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft.model import ChainDrafter
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.loading import load_model, load_pair, tiny_model, tiny_pair
from specviz.models.weights import (
    CACHEABLE_MODES,
    WEIGHT_MODES,
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    SharedInputGroup,
    SharedInputSlice,
    W8A8TokenLinear,
    WxLinear,
    converted_layers,
    input_absmax,
    parse_weight_mode,
    quantize_model,
    restore_converted,
    vnni_layout,
)
from specviz.study.prompts import Prompt

PROMPT = "def fibonacci(n):"


def _cached_logits(model, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of ``ids`` (1, L) fed as a prefix of ``split`` tokens, then the rest through the cache."""
    cache = new_cache(model.model)
    length = ids.shape[1]
    head = forward_tokens(model.model, cache, ids[:, :split], torch.arange(split)[None], None)
    tail = forward_tokens(model.model, cache, ids[:, split:], torch.arange(split, length)[None], None)
    return torch.cat([head, tail], dim=1).float()  # (1, L, V)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 259, (1, 48), generator=torch.Generator().manual_seed(0))  # (1, L)


@pytest.mark.parametrize("mode", list(WEIGHT_MODES))
def test_every_mode_runs_with_a_kv_cache(tiny_pair, ids, mode):
    model = load_model(tiny_pair.target, mode)
    assert model.weight_mode == mode and model.dtype == WEIGHT_MODES[mode].activation_dtype
    assert model.model.dtype == model.dtype  # embeddings and norms carry the activation dtype
    logits = _cached_logits(model, ids, 32)
    assert logits.shape == (1, 48, model.vocab_size) and torch.isfinite(logits).all()
    # The cache path gives the logits of one full forward, up to float rounding (w8a8: up to
    # 7-bit activation rounding, as the 48-token forward takes the weight-only path).
    full = forward_tokens(model.model, new_cache(model.model), ids, torch.arange(48)[None], None).float()
    tol = 0.05 if mode.startswith("w8a8") else 0.01
    assert (logits - full).abs().max() <= tol * full.abs().max()
    assert tiny_pair.target.weight_mode == "fp32"  # the source is left as it was


def test_converted_layers_replace_every_linear_and_keep_the_embeddings(tiny_pair):
    expected = {"int8": Int8Linear, "int4": Int4Linear, "fp32-wx": WxLinear, "w8a8": W8A8Linear,
                "w8a8-token": W8A8TokenLinear}
    for mode, cls in expected.items():
        model = load_model(tiny_pair.target, mode).model
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        assert isinstance(model.lm_head, cls) and isinstance(model.model.layers[0].mlp.down_proj, cls)
        assert model.model.embed_tokens.weight.dtype == WEIGHT_MODES[mode].activation_dtype
        # Rotary frequencies are buffers and stay float32.
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32


# Measured on tiny_pair seeds 0-3 and this input: max |logit - fp32 logit| / max |fp32 logit| is
# 0.8-0.9% for int8 (bf16 activations dominate: bf16 alone gives 0.5-0.65%) and 9-14% for int4
# (4 bits on Gaussian random weights); top-1 agreement 0.96-1.0 (int8) and 0.79-0.88 (int4).
@pytest.mark.parametrize("mode, rel_tol, min_top1", [("int8", 0.02, 0.9), ("int4", 0.25, 0.7), ("fp32-wx", 1e-5, 1.0),
                                                     ("w8a8", 0.05, 0.9)])
def test_quantized_logits_are_close_to_fp32(tiny_pair, ids, mode, rel_tol, min_top1):
    ref = _cached_logits(tiny_pair.target, ids, 32)
    got = _cached_logits(load_model(tiny_pair.target, mode), ids, 32)
    assert (got - ref).abs().max() <= rel_tol * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= min_top1


def test_round_trip_error_bounds():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen) * torch.rand(48, 1, generator=gen)  # (N, K) rows of varied scale
    w[3] = 0.0  # an all-zero row must not divide by zero
    int8 = Int8Linear(w, None)
    err = (int8.dequantized_weight() - w).abs()  # (N, K)
    assert (err <= int8.scales.float()[:, None] / 2 * (1 + 1e-6)).all()  # no clipping: half a step at most
    assert (int8.scales.float() >= w.abs().amax(1) / 127).all()
    for group in (32, 64, 128):
        int4 = Int4Linear(w, None, group)
        err = (int4.dequantized_weight() - w).abs().reshape(48, 256 // group, group)  # (N, G, g)
        scales = int4.scales_and_zeros[..., 0].T.float()[:48]  # (N, G)
        assert (err <= scales[..., None] / 2 * (1 + 1e-3) + 1e-7).all()


def test_layers_match_their_dequantized_weights():
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(128, 40, bias=True)  # 40 output rows: int4 pads them to 48
    x = torch.randn(2, 5, 128, generator=gen)  # (B, T, K)
    for layer in (Int8Linear.from_linear(linear), Int4Linear.from_linear(linear)):
        y = layer(x.bfloat16())  # (B, T, N)
        assert y.shape == (2, 5, 40) and y.dtype == torch.bfloat16
        ref = nn.functional.linear(x.bfloat16().float(), layer.dequantized_weight(), linear.bias.detach())
        assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()  # bf16 output rounding
    wx = WxLinear.from_linear(linear)
    assert torch.allclose(wx(x), linear(x), atol=1e-5)


def test_w8a8_smoothing_moves_an_outlier_channel_into_the_weights():
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(256, 64, bias=True)
    x = torch.randn(4, 256, generator=gen)  # (M, K)
    x[:, 7] *= 80.0  # one input channel far larger than the rest, as in transformer activations
    ref = linear(x).detach()
    plain = W8A8Linear.from_linear(linear)  # one activation scale, no smoothing
    smoothed = W8A8Linear.from_linear(linear, x.abs().amax(0))
    err_plain = (plain(x) - ref).abs().max()
    err_smooth = (smoothed(x) - ref).abs().max()
    assert err_smooth < 0.5 * err_plain
    assert err_smooth <= 0.02 * ref.abs().max()
    # Long forwards take the weight-only path over the same int8 weights.
    long_x = x.repeat(20, 1)  # (80, K) > dynamic_rows
    assert (smoothed(long_x)[:4] - ref).abs().max() <= 0.03 * ref.abs().max()
    # The smoothed weight divided back is the layer's weight, up to int8 steps.
    assert (smoothed.dequantized_weight() - linear.weight).abs().max() <= (
        smoothed.scales.float()[:, None] * smoothed.inv_smooth[None, :]).max()
    twin = copy.deepcopy(smoothed)  # the fbgemm-packed weight is rebuilt, not shared
    assert torch.equal(twin(x), smoothed(x)) and twin._packed is not smoothed._packed
    with pytest.raises(ValueError, match=r"input_absmax must have shape \(256,\)"):
        W8A8Linear.from_linear(linear, torch.ones(3))


def test_w8a8_token_rows_do_not_depend_on_their_forward():
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(256, 64, bias=True)
    x = torch.randn(6, 256, generator=gen)  # (M, K)
    x[:, 7] *= 80.0
    x[2] *= 0.01  # a token far smaller than the others: one scale per forward would flatten it
    x[4] = 0.0  # and an all-zero row
    ref = linear(x).detach()
    absmax = x.abs().amax(0)
    per_token = W8A8TokenLinear.from_linear(linear, absmax)
    per_forward = W8A8Linear.from_linear(linear, absmax)
    batched = per_token(x)
    alone = torch.cat([per_token(x[i:i + 1]) for i in range(6)])
    assert torch.equal(batched, alone)  # bit for bit, whatever shares the forward
    assert torch.equal(per_token(x[1:4]), batched[1:4])
    assert not torch.equal(per_forward(x), torch.cat([per_forward(x[i:i + 1]) for i in range(6)]))
    torch.testing.assert_close(batched[4], linear.bias.detach())  # a zero token gives the bias
    # The small token keeps its own resolution: its error is relative to its own size.
    small_err = (batched[2] - ref[2]).abs().max() / (ref[2] - linear.bias.detach()).abs().max()
    small_err_forward = (per_forward(x)[2] - ref[2]).abs().max() / (ref[2] - linear.bias.detach()).abs().max()
    assert small_err < 0.05 and small_err < 0.5 * small_err_forward
    assert (batched - ref).abs().max() <= 0.02 * ref.abs().max()
    # Long forwards (prefills) take the same kernel and stay invariant too.
    long_x = x.repeat(20, 1)  # (120, K)
    assert torch.equal(per_token(long_x)[:6], batched)
    twin = copy.deepcopy(per_token)  # repacked with its two extra zero columns
    assert torch.equal(twin(x), batched) and twin._packed is not per_token._packed
    torch.testing.assert_close(per_token.dequantized_weight(), per_forward.dequantized_weight())
    # Without the residual pass, activations keep 8 bits and the rows stay independent.
    one_pass = W8A8TokenLinear.from_linear(linear, absmax, residual=False)
    assert torch.equal(one_pass(x), torch.cat([one_pass(x[i:i + 1]) for i in range(6)]))
    # Against the product with the layer's own quantized weights, the residual pass leaves a
    # small fraction of one pass's activation rounding error.
    exact = nn.functional.linear(x, per_token.dequantized_weight(), linear.bias.detach())
    assert (batched - exact).abs().max() < 0.1 * (one_pass(x) - exact).abs().max()
    assert copy.deepcopy(one_pass).residual is False


def _compiled_op_or_skip():
    from specviz.models.extension import fused_op_status, w8a8_token_op

    if w8a8_token_op() is None:
        if os.environ.get("CI", "").lower() == "true" and "SPECVIZ_NO_EXTENSION" not in os.environ:
            pytest.fail(f"CI=true but the compiled w8a8-token operator is missing: {fused_op_status()}")
        pytest.skip(fused_op_status())


@pytest.mark.parametrize("k, n, bias, residual", [(256, 64, True, True), (256, 64, True, False),
                                                  (96, 40, False, True), (1000, 24, False, False)])
def test_compiled_w8a8_token_operator_equals_the_pytorch_code(k, n, bias, residual):
    _compiled_op_or_skip()
    gen = torch.Generator().manual_seed(k + n)
    linear = nn.Linear(k, n, bias=bias)
    x = torch.randn(3, 5, k, generator=gen)  # (B, T, K)
    x[..., 3] *= 50.0
    x[1, 2] = 0.0  # an all-zero token
    layer = W8A8TokenLinear.from_linear(linear, x.abs().flatten(0, 1).amax(0), residual=residual)
    fused, reference = layer(x), layer.forward_pytorch(x)
    assert fused.shape == (3, 5, n)
    assert torch.equal(fused, reference)  # bit for bit: the same roundings in the same order
    assert torch.equal(layer(x[2, 1:3]), reference[2, 1:3])
    assert torch.equal(layer(x[:0]), reference[:0])  # no rows at all


@pytest.mark.parametrize("k, n, bias, residual", [(256, 64, True, True), (1001, 200, False, True),
                                                  (96, 40, True, False), (3, 1, False, True)])
def test_vnni_kernel_equals_fbgemm_bit_for_bit(k, n, bias, residual):
    """On CPUs with AVX-512 VNNI, short forwards take their integer products from the
    compiled operator's own kernel: the same values as fbgemm's, for every row count it
    takes (odd ones included, K and N not multiples of its blocks), and fbgemm beyond."""
    from specviz.models.extension import vnni_kernel
    from specviz.models.weights import vnni_layout

    _compiled_op_or_skip()
    if not vnni_kernel():
        pytest.skip("this CPU has no AVX-512 VNNI (or SPECVIZ_NO_VNNI is set): fbgemm computes every product")
    gen = torch.Generator().manual_seed(k * n)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(torch.rand(n, 1, generator=gen) * 4)  # rows of different ranges
    x = torch.randn(20, k, generator=gen)
    x[:, 0] *= 40.0
    layer = W8A8TokenLinear.from_linear(linear, x.abs().amax(0), residual=residual)
    weight, offsets, scales = layer._vnni
    assert weight.shape == (-(-n // 64), -(-k // 4), 64, 4)
    assert torch.equal(weight.permute(0, 2, 1, 3).reshape(-1, weight.shape[1] * 4)[:n, :k], layer.qweight)
    assert torch.equal(offsets, layer.qweight.int().sum(1) * 128)
    op = torch.ops.specviz.w8a8_token_linear
    layout = vnni_layout(layer.qweight, layer.scales)
    for rows in (1, 2, 3, 5, 7, 8, 9, 20):
        fbgemm = op(x[:rows], layer.inv_smooth, layer._packed, layer.bias, residual)
        vnni = op(x[:rows], layer.inv_smooth, layer._packed, layer.bias, residual, *layout, 64)
        assert torch.equal(vnni, fbgemm), rows
        assert torch.equal(layer(x[:rows]), fbgemm)  # the layer's own path, whichever it takes
    assert torch.equal(layer(x), layer.forward_pytorch(x))


def test_no_vnni_env_keeps_fbgemm(monkeypatch):
    from specviz.models.extension import vnni_kernel

    monkeypatch.setenv("SPECVIZ_NO_VNNI", "1")
    assert not vnni_kernel()
    layer = W8A8TokenLinear.from_linear(nn.Linear(64, 8))
    assert layer._vnni is None
    monkeypatch.delenv("SPECVIZ_NO_VNNI")
    assert (W8A8TokenLinear.from_linear(nn.Linear(64, 8))._vnni is not None) == vnni_kernel()


def test_w8a8_token_layers_run_pytorch_code_when_asked(monkeypatch):
    from specviz.models.extension import fused_op_status, w8a8_token_op

    linear = nn.Linear(64, 8)
    layer = W8A8TokenLinear.from_linear(linear)
    x = torch.randn(4, 64)
    fused = layer(x)
    monkeypatch.setenv("SPECVIZ_NO_EXTENSION", "1")
    assert w8a8_token_op() is None and "SPECVIZ_NO_EXTENSION" in fused_op_status()
    assert torch.equal(layer(x), fused)
    with pytest.raises((ValueError, RuntimeError), match="64"):
        layer(torch.randn(2, 63))
    monkeypatch.delenv("SPECVIZ_NO_EXTENSION")
    if w8a8_token_op() is not None:
        with pytest.raises(RuntimeError, match="input's last dimension is 63, the layer takes 64"):
            layer(torch.randn(2, 63))


def test_shared_input_group_computes_its_members_in_one_product():
    gen = torch.Generator().manual_seed(5)
    q, k = nn.Linear(64, 32, bias=True), nn.Linear(64, 16, bias=False)
    x = torch.randn(3, 64, generator=gen)  # (M, K)
    absmax = x.abs().amax(0)
    group = SharedInputGroup.from_linears({"q": q, "k": k}, absmax)
    assert group.bounds == {"q": (0, 32), "k": (32, 48)} and group.layer.out_features == 48
    members = {name: SharedInputSlice(group, name) for name in group.names}
    calls = []
    group.layer.register_forward_hook(lambda *_: calls.append(1))
    yq, yk = members["q"](x), members["k"](x)
    assert len(calls) == 1 and group._input is None  # one product; released once both took their columns
    full = group.layer(x)
    assert torch.equal(yq, full[:, :32]) and torch.equal(yk, full[:, 32:])
    assert (yq - q(x)).abs().max() <= 0.02 * q(x).abs().max() and (yk - k(x)).abs().max() <= 0.02 * k(x).abs().max()
    # Another input, a changed input or a member asked twice: the product is computed again.
    calls.clear()
    y2 = members["q"](x[:1])
    assert len(calls) == 1 and torch.equal(y2, yq[:1])
    assert torch.equal(members["k"](x), yk) and len(calls) == 2
    members["q"](x)
    x.mul_(2.0)
    assert torch.equal(members["k"](x), group.layer(x)[:, 32:])
    assert torch.equal(members["q"](x), members["q"](x)) and group._pending == {"k"}
    with pytest.raises(ValueError, match="different widths"):
        SharedInputGroup.from_linears({"a": nn.Linear(64, 8), "b": nn.Linear(32, 8)})


def test_w8a8_token_models_fuse_qkv_and_gate_up():
    model = load_model(tiny_model(), "w8a8-token").model
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert {type(attn.q_proj), type(attn.k_proj), type(attn.v_proj)} == {SharedInputSlice}
    assert attn.q_proj.group is attn.k_proj.group is attn.v_proj.group
    assert mlp.gate_proj.group is mlp.up_proj.group and isinstance(mlp.down_proj, W8A8TokenLinear)
    groups = [m for m in model.modules() if isinstance(m, SharedInputGroup)]
    assert len(groups) == 2 * len(model.model.layers)  # registered once each
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (64, 32)
    assert mlp.gate_proj.group.layer.residual and attn.q_proj.group.layer.residual and mlp.down_proj.residual
    twin = copy.deepcopy(model)  # the copies' members share their own group
    t_attn = twin.model.layers[0].self_attn
    assert t_attn.q_proj.group is t_attn.v_proj.group and t_attn.q_proj.group is not attn.q_proj.group
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin(ids).logits)
    with pytest.raises(ValueError, match="already holds W8A8TokenLinear layers"):
        quantize_model(model, "int8")


@pytest.mark.parametrize("mode", CACHEABLE_MODES)
def test_saved_layers_rebuild_the_converted_model_bit_for_bit(mode):
    import json

    from specviz.models.loading import calibration_ids

    source = tiny_model(seed=5)
    calib = calibration_ids(source.tokenizer) if WEIGHT_MODES[mode].calibrated else None
    converted = quantize_model(copy.deepcopy(source.model), mode, calib)
    layers, tensors = converted_layers(converted)
    layers = json.loads(json.dumps(layers))  # what a cache file holds
    restored = restore_converted(copy.deepcopy(source.model), mode, layers,
                                 {k: v.clone() for k, v in tensors.items()})
    assert [(n, type(m).__name__) for n, m in restored.named_modules()] == \
        [(n, type(m).__name__) for n, m in converted.named_modules()]
    a, b = converted.state_dict(), restored.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {p.dtype for p in restored.parameters()} == {WEIGHT_MODES[mode].activation_dtype}
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, restored(ids).logits)
    if mode == "w8a8-token":  # the groups' members share the rebuilt group
        attn = restored.model.layers[0].self_attn
        assert attn.q_proj.group is attn.v_proj.group and isinstance(attn.q_proj, SharedInputSlice)
    # what cannot be restored leaves the model untouched
    fresh = copy.deepcopy(source.model)
    with pytest.raises(ValueError, match="do not match the model's linear layers"):
        restore_converted(fresh, mode, layers[1:], tensors)
    with pytest.raises(ValueError, match="lack"):
        restore_converted(fresh, mode, layers, {k: v for k, v in tensors.items() if "layers.0." not in k})
    assert not any(isinstance(m, (Int8Linear, W8A8Linear, SharedInputGroup)) for m in fresh.modules())
    with pytest.raises(ValueError, match="already holds"):
        restore_converted(restored, mode, layers, tensors)
    with pytest.raises(ValueError, match="cannot be restored"):
        restore_converted(fresh, "int4", layers, tensors)
    with pytest.raises(ValueError, match="cannot be saved"):
        converted_layers(quantize_model(copy.deepcopy(source.model), "int4"))


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_the_float_models_in_every_mode(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specviz.models.loading import LoadedModel, tiny_tokenizer

    tok = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    source = LoadedModel("tied" if tied else "untied", Qwen2ForCausalLM(config).eval(), tok, torch.float32)
    expected = sum(p.numel() for p in source.model.parameters())  # a tied head counted once
    assert source.parameter_count == expected
    for mode in WEIGHT_MODES:
        assert load_model(source, mode).parameter_count == expected, mode


def test_vnni_layout_of_odd_shapes():
    q = torch.randint(-63, 64, (70, 10), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    weight, offsets, scales = vnni_layout(q, torch.rand(70).bfloat16())
    assert weight.shape == (2, 3, 64, 4) and weight.dtype == torch.int8
    padded = torch.zeros(128, 12, dtype=torch.int8)
    padded[:70, :10] = q
    for c, g, j, i in [(0, 0, 0, 0), (1, 2, 5, 1), (0, 2, 63, 3), (1, 1, 6, 2)]:
        assert weight[c, g, j, i] == padded[64 * c + j, 4 * g + i]
    assert torch.equal(offsets, q.long().sum(1).int() * 128) and scales.dtype == torch.float32


def test_speculative_w8a8_token_commits_what_plain_w8a8_token_decoding_does():
    pair = tiny_pair(dtype="w8a8-token")
    assert pair.target.weight_mode == pair.draft.weight_mode == "w8a8-token"
    plain = plain_generate(pair.target, PROMPT, max_new_tokens=40)
    for k in (1, 4):
        spec = speculative_generate(pair.target, ChainDrafter(pair.draft, k), PROMPT, max_new_tokens=40)
        assert spec.output_ids == plain.output_ids
        assert spec.n_steps < len(plain.output_ids)


def test_w8a8_is_calibrated_on_tokens(tiny_pair, ids):
    absmax = input_absmax(tiny_pair.target.model, ids)
    assert "lm_head" in absmax and absmax["model.layers.0.mlp.down_proj"].shape == (128,)
    with pytest.raises(ValueError, match="weight mode w8a8 is calibrated: pass calibration_ids"):
        quantize_model(tiny_model().model, "w8a8")
    model = load_model(tiny_pair.target, "w8a8")
    copied = load_model(model, "w8a8")
    assert copied is model


def test_speculative_w8a8_runs_lossless_against_plain_w8a8():
    pair = tiny_pair(dtype="w8a8")
    plain = plain_generate(pair.target, PROMPT, max_new_tokens=40)
    spec = speculative_generate(pair.target, ChainDrafter(pair.draft, 3), PROMPT, max_new_tokens=40)
    # One activation scale per forward: a verify forward of 4 tokens rounds differently from
    # four 1-token forwards, so only the start is guaranteed; on the tiny pair the runs agree.
    assert spec.output_ids[:8] == plain.output_ids[:8]
    assert spec.n_steps < len(plain.output_ids)


def test_int4_refuses_layers_it_cannot_pack():
    with pytest.raises(ValueError, match="in_features to be a multiple of the group size 64, got in_features=96"):
        Int4Linear(torch.randn(32, 96), None, 64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4Linear(torch.randn(32, 64), None, 16)
    odd = tiny_model(hidden=96, n_heads=4, n_kv_heads=2)  # 96 inputs: not a multiple of 64
    with pytest.raises(ValueError, match="cannot convert layer 'model.layers.0.self_attn.q_proj' to int4"):
        quantize_model(odd.model, "int4")
    assert isinstance(odd.model.lm_head, nn.Linear)  # nothing was swapped


def test_speculative_int8_matches_plain_int8():
    pair = tiny_pair(dtype="int8")
    assert pair.target.weight_mode == pair.draft.weight_mode == "int8"
    for k in (1, 4):
        plain = plain_generate(pair.target, PROMPT, max_new_tokens=40)
        spec = speculative_generate(pair.target, ChainDrafter(pair.draft, k), PROMPT, max_new_tokens=40)
        assert spec.output_ids == plain.output_ids
        assert spec.n_steps < len(plain.output_ids)  # drafts were accepted, not just bonus tokens


def test_mode_names_and_errors(tiny_pair):
    assert parse_weight_mode("INT8") is WEIGHT_MODES["int8"]
    assert parse_weight_mode(torch.bfloat16) is WEIGHT_MODES["bf16"]
    assert parse_weight_mode("float32") is WEIGHT_MODES["fp32"]
    assert [m.name for m in WEIGHT_MODES.values() if m.lossless] == ["fp32"]
    for bad in ("int3", "q8_0", torch.int8, None):
        with pytest.raises(ValueError, match="unknown weight mode .*use one of fp32, bf16, fp16, fp32-wx, int8, int4, w8a8, w8a8-token"):
            parse_weight_mode(bad)
    with pytest.raises(ValueError, match="unknown weight mode 'int2'"):
        load_pair(tiny_pair.target, tiny_pair.draft, dtype="int2")
    int8 = load_model(tiny_pair.target, "int8")
    with pytest.raises(ValueError, match="weight mode int8, which cannot be converted to int4"):
        load_model(int8, "int4")
    with pytest.raises(ValueError, match="already holds Int8Linear layers"):
        quantize_model(int8.model, "int8")


def test_teacher_forced_agreement_tables(tiny_pair):
    target = tiny_pair.target
    assert teacher_forced_agreement(target, target, list(range(40))) == 1.0
    int8 = load_model(target, "int8")
    assert 0.9 <= teacher_forced_agreement(target, int8, list(range(40))) <= 1.0
    prompts = [Prompt(1, "code", ("def f(x):",)), Prompt(2, "code", ("hello",)), Prompt(3, "qa", ("why?",))]
    texts = reference_texts(target, prompts, max_new_tokens=12)
    assert all(len(t.token_ids) == t.prompt_len + 12 == len(t.reference_choices) for t in texts)
    table = pd.concat([agreement_table(target, texts), agreement_table(int8, texts)])
    assert (table.loc[table.weight_mode == "fp32", "agreement"] == 1.0).all()
    assert (table.continuation_positions == 13).all()
    summary = agreement_by_category(table)
    assert list(summary.category) == ["all", "code", "qa"] * 2
    pooled = summary[(summary.weight_mode == "int8") & (summary.category == "all")].iloc[0]
    assert pooled.positions == table[table.weight_mode == "int8"].positions.sum()
    assert pooled.agreement == pytest.approx(table[table.weight_mode == "int8"].matches.sum() / pooled.positions)
    # Fed in chunks through the cache, fp32 still agrees with itself at every position.
    text = texts[0]
    for chunk in (1, 3):
        got = greedy_choices(target, text.token_ids, text.prompt_len, chunk)
        assert got.tolist() == list(text.reference_choices)
    chunked = agreement_table(load_model(target, "w8a8"), texts, chunk=4)
    assert (chunked.chunk == 4).all() and (chunked.agreement >= 0.8).all()
    with pytest.raises(ValueError, match="prompt_len must be in 1..13"):
        greedy_choices(target, text.token_ids[:13], None, 2)
    bar = accuracy_bar(summary)
    assert set(bar.weight_mode) == {"fp32", "int8"} and bar.loc[bar.weight_mode == "fp32", "lossy"].item() is False


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    from specviz.models.extension import _remove_stale_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    _remove_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    old = os.stat(lock).st_mtime - 3600
    os.utime(lock, (old, old))
    _remove_stale_lock(tmp_path)
    assert not lock.exists()


def test_quantize_model_takes_input_ranges_measured_on_any_run():
    # a module that reads no token ids (e.g. a draft head) is calibrated by running it on its own inputs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128))
    x = torch.randn(9, 128) * torch.linspace(0.1, 8.0, 128)  # uneven channels, as smoothing expects
    ranges = input_absmax(model, run=lambda: model(x))
    assert set(ranges) == {"0", "2"}
    torch.testing.assert_close(ranges["0"], x.abs().amax(0))
    with pytest.raises(ValueError, match="either token_ids or run"):
        input_absmax(model)
    with pytest.raises(ValueError, match=r"no range for layer\(s\) \['2'\]"):
        quantize_model(copy.deepcopy(model), "w8a8-token", input_ranges={"0": ranges["0"]})
    packed = quantize_model(copy.deepcopy(model), "w8a8-token", input_ranges=ranges)
    assert isinstance(packed[0], W8A8TokenLinear) and isinstance(packed[2], W8A8TokenLinear)
    smooth = packed[0].inv_smooth
    assert float(smooth.max() / smooth.min()) > 2  # the measured ranges smoothed the first layer's input
    with torch.no_grad():
        ref, got = model(x), packed(x)
    assert float((got - ref).norm() / ref.norm()) < 0.02

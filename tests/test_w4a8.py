"""w4a8-token: 4-bit group weights x per-token int8 activations, and drafts in their own mode."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft.model import ChainDrafter
from specviz.quant.extension import w4a8_token_op
from specviz.models.loading import load_model
from specviz.models.tiny import tiny_pair as make_tiny_pair
from specviz.quant.w4a8 import W4_GROUP, W4A8TokenLinear, pack_w4, unpack_w4
from specviz.quant.weights import SharedInputGroup, SharedInputSlice

PROMPT = "def fibonacci(n):"


def _layer(n: int, k: int, bias: bool, residual: bool = True, seed: int = 0) -> tuple[W4A8TokenLinear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, 3] *= 20  # an outlier column, as transformer layers have
    b = torch.randn(n, generator=gen) if bias else None
    absmax = torch.rand(k, generator=gen) * 4 + 0.1
    return W4A8TokenLinear(w, b, absmax, residual=residual), w


def test_pack_round_trip_and_layout():
    w = torch.randn(70, 100, generator=torch.Generator().manual_seed(1))
    packed = pack_w4(w)
    assert packed.shape == (2, 2, 2304) and packed.dtype == torch.uint8  # 70 -> 2 blocks, 100 -> 2 groups
    codes, scales, minimums = unpack_w4(packed)
    assert codes.shape == (128, 128) and scales.shape == minimums.shape == (128, 2)
    assert int(codes.max()) <= 15
    deq = (codes.float().view(128, 2, W4_GROUP) * scales[..., None] + minimums[..., None]).view(128, 128)
    step = scales.repeat_interleave(W4_GROUP, dim=1)[:70, :100]
    # every weight within half a step of its group's grid (plus the float16 rounding of the minimum)
    assert ((deq[:70, :100] - w).abs() <= 0.5 * step + 1e-3 * w.abs().max()).all()
    # padding: whole groups of zeros are exact; zero inputs in a partial group are zeros on its grid
    # (activation codes there are zeros, so they add nothing)
    assert (deq[70:] == 0).all()
    assert (deq[:70, 100:].abs() <= 0.5 * scales[:70, 1:] + 1e-3 * w.abs().max()).all()
    # the byte of channel 64c + j, group g, line o, lane i holds inputs 8o + i (low) and 8o + 4 + i (high)
    for c, g, o, j, i in [(0, 0, 0, 0, 0), (1, 1, 3, 5, 2), (0, 1, 7, 63, 3)]:
        byte = int(packed[c, g, o * 256 + j * 4 + i])
        row, col = 64 * c + j, 64 * g + 8 * o + i
        assert byte & 15 == codes[row, col] and byte >> 4 == codes[row, col + 4]
    with pytest.raises(ValueError, match="uint8"):
        unpack_w4(packed.float())


def test_a_layer_approximates_its_float_weights():
    layer, w = _layer(96, 128, bias=False)
    x = torch.randn(5, 128)
    ref = x @ w.T
    rel = float((layer(x) - ref).norm() / ref.norm())
    assert rel < 0.2, rel
    deq = layer.dequantized_weight()
    assert deq.shape == (96, 128)
    assert float((x @ deq.T - ref).norm() / ref.norm()) < 0.2


@pytest.mark.skipif(w4a8_token_op() is None, reason="the compiled operator cannot be built here")
@pytest.mark.parametrize("n, k, bias, residual", [(1152, 896, True, True), (70, 100, True, True), (64, 64, False, False),
                                                  (130, 200, False, True)])
@pytest.mark.parametrize("vnni", [True, False])
def test_compiled_operator_equals_the_pytorch_code(monkeypatch, n, k, bias, residual, vnni):
    if not vnni:
        monkeypatch.setenv("SPECVIZ_NO_VNNI", "1")  # the operator's AVX2 kernel
    layer, _ = _layer(n, k, bias, residual)
    for m in (1, 3, 9, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
        assert torch.equal(layer(x), layer.forward_pytorch(x)), m


@pytest.mark.parametrize("compiled", [True, False])
def test_rows_do_not_depend_on_their_forward(monkeypatch, compiled):
    if not compiled:
        monkeypatch.setenv("SPECVIZ_NO_EXTENSION", "1")
    layer, _ = _layer(100, 96, bias=True)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(3))
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(11)])
    assert torch.equal(together, alone)
    assert torch.equal(layer(x[None]), together[None])  # (B, N, K) inputs keep their shape


def test_w4a8_token_models_fuse_qkv_and_gate_up_and_decode_losslessly(tiny_pair):
    model = load_model(tiny_pair.target, "w4a8-token")
    assert model.weight_mode == "w4a8-token"
    attn, mlp = model.model.model.layers[0].self_attn, model.model.model.layers[0].mlp
    assert isinstance(attn.q_proj, SharedInputSlice) and isinstance(attn.q_proj_k_proj_v_proj, SharedInputGroup)
    assert isinstance(attn.q_proj_k_proj_v_proj.layer, W4A8TokenLinear) and isinstance(mlp.down_proj, W4A8TokenLinear)
    pair = tiny_pair.__class__(target=model, draft=load_model(tiny_pair.draft, "w4a8-token"))
    plain = plain_generate(pair.target, PROMPT, max_new_tokens=32)
    for k in (1, 3):
        spec = speculative_generate(pair.target, ChainDrafter(pair.draft, k), PROMPT, max_new_tokens=32)
        assert spec.output_ids == plain.output_ids
        assert spec.n_steps < len(plain.output_ids)


def test_a_w4a8_draft_keeps_an_fp32_target_exact():
    pair = make_tiny_pair(dtype="fp32", draft_dtype="w4a8-token")
    assert pair.target.weight_mode == "fp32" and pair.draft.weight_mode == "w4a8-token"
    plain = plain_generate(pair.target, PROMPT, max_new_tokens=32)
    spec = speculative_generate(pair.target, ChainDrafter(pair.draft, 3), PROMPT, max_new_tokens=32)
    assert spec.output_ids == plain.output_ids
    assert spec.n_steps < len(plain.output_ids)
    with pytest.raises(ValueError, match="unknown weight mode 'w5a8'"):
        make_tiny_pair(draft_dtype="w5a8")


def test_bench_records_the_draft_mode(tmp_path, capsys):
    from specviz.bench.__main__ import main
    from specviz.bench.e2e import COLUMNS, load_results

    out = tmp_path / "bench.csv"
    assert main(["--models", "tiny", "--dtype", "fp32", "--draft-dtype", "w4a8-token", "--limit", "1",
                 "--max-new-tokens", "8", "--warmup-tokens", "2", "--no-predict", "--methods", "plain", "chain-k2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "draft model in w4a8-token" in printed
    rows = load_results(out)
    assert set(rows["dtype"]) == {"fp32"} and set(rows["draft_dtype"]) == {"w4a8-token"}
    assert bool(rows.loc[rows["method"] == "chain-k2", "matches_plain"].all())
    # resuming under another draft mode is refused, naming the column
    assert main(["--models", "tiny", "--dtype", "fp32", "--limit", "1", "--max-new-tokens", "8", "--no-predict",
                 "--methods", "plain", "chain-k2", "--out", str(out)]) == 2
    assert "draft_dtype" in capsys.readouterr().err
    assert main(["--models", "tiny", "--draft-dtype", "w5a8", "--out", str(tmp_path / "x.csv")]) == 2
    assert "--draft-dtype: unknown weight mode 'w5a8'" in capsys.readouterr().err
    # files from before the column: both models ran in dtype
    old = pd.read_csv(out).drop(columns=["draft_dtype"])
    old.to_csv(tmp_path / "old.csv", index=False)
    back = load_results(tmp_path / "old.csv")
    assert list(back.columns) == list(COLUMNS) and set(back["draft_dtype"]) == {"fp32"}


def test_rows_of_a_layer_are_its_channels_bit_for_bit():
    layer, _ = _layer(200, 130, bias=True)
    rows = torch.tensor([5, 199, 64, 0, 130, 77])
    sub = layer.rows(rows)
    codes, scales, minimums = unpack_w4(layer.packed)
    from specviz.quant.w4a8 import layout_w4

    assert torch.equal(sub.packed, layout_w4(codes[rows], scales[rows], minimums[rows]))
    x = torch.randn(3, 130)
    assert torch.equal(sub(x), layer(x)[:, rows])
    with pytest.raises(ValueError, match="rows must be"):
        layer.rows(torch.tensor([200]))

"""Where a run's time goes (specviz.bench.profile and ``python -m specviz.bench profile``) on the
tiny random pair: the engine's phases are found, every figure adds up, pooling over prompts is
a token-weighted mean, and bad input is refused."""

import json

import pandas as pd
import pytest

import specviz.bench.__main__ as cli
from specviz.bench.e2e import parse_method
from specviz.bench.profile import (KINDS, PROFILE_COLUMNS, aggregate_profile, op_kind, profile_method, profile_methods,
                                   split_events)
from specviz.decode.phases import PHASES, phase
from specviz.draft.registry import build_drafter
from specviz.models.tiny import tiny_pair

IDS = [5, 9, 13, 5, 9, 13, 5, 9, 13, 21, 34, 55]


def test_op_kinds():
    assert op_kind("quantized::linear_dynamic") == "int_products"
    assert op_kind("aten::_int_mm") == "int_products"
    assert op_kind("specviz::w4a8_token_linear") == "int_products"
    assert op_kind("aten::linear") == "float_products"
    assert op_kind("aten::addmm") == "float_products"
    assert op_kind("aten::scaled_dot_product_attention") == "attention"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_kind("aten::add_") == "other_ops"
    assert op_kind("specviz::w8a8_token_linear") == "int_products"
    with pytest.raises(ValueError, match="unknown phase 'drafting'"):
        phase("drafting")


class _Event:
    """What split_events reads of a profiler event."""

    def __init__(self, name, self_us, parent=None):
        self.name, self.self_cpu_time_total, self.cpu_parent = name, self_us, parent


def test_split_events_programs_and_specviz_operators():
    # a verification forward: the range, a TorchScript program's call, specviz's compiled
    # product (a "specviz::" operator, not a phase) with an allocation under it, an
    # attention call outside the program, and the LM head's product
    rng = _Event("specviz::forward", 5.0)
    program = _Event("forward", 3.0, rng)
    product = _Event("specviz::w8a8_token_linear", 100.0, program)
    alloc = _Event("aten::empty", 1.0, product)
    norm = _Event("aten::mul", 2.0, program)
    attn = _Event("aten::scaled_dot_product_attention", 7.0, rng)
    head = _Event("aten::linear", 0.5, rng)
    mm = _Event("aten::mm", 20.0, head)
    outside = _Event("aten::argmax", 4.0)
    times, calls = split_events([rng, program, product, alloc, norm, attn, head, mm, outside])
    assert calls == {"forward": 1}
    assert times == {("forward", "python"): 8.0, ("forward", "int_products"): 101.0,
                     ("forward", "other_ops"): 2.0, ("forward", "attention"): 7.0,
                     ("forward", "float_products"): 20.5, ("other", "other_ops"): 4.0}
    assert sum(times.values()) == sum(e.self_cpu_time_total for e in [rng, program, product, alloc, norm, attn,
                                                                      head, mm, outside])


def test_a_fused_draft_layer_splits_into_its_kinds():
    rng = _Event("specviz::draft", 1.0)
    layer = _Event("specviz::w4a8_decoder_layer", 30.0, rng)
    product = _Event("specviz::w4a8_token_linear", 200.0, layer)
    alloc = _Event("aten::empty", 2.0, product)
    attn = _Event("specviz::w4a8_decoder_layer_attention", 40.0, layer)
    add = _Event("aten::add", 3.0, layer)
    times, calls = split_events([rng, layer, product, alloc, attn, add])
    assert calls == {"draft": 1}
    assert times == {("draft", "python"): 1.0, ("draft", "other_ops"): 33.0, ("draft", "int_products"): 202.0,
                     ("draft", "attention"): 40.0}


def test_integer_mode_profile_adds_up():
    # w8a8-token's products (specviz's compiled operator where it was built, else fbgemm's)
    # run inside the decoder layers' programs: every microsecond lands in a phase
    pair = tiny_pair(dtype="w8a8-token")
    spec = parse_method("chain-k2")
    table = profile_method(spec, pair, IDS, max_new_tokens=10, drafter=build_drafter(spec, pair),
                           verifier="greedy")
    _check_sums(table)
    assert set(table["phase"]) <= set(PHASES) | {"other"}
    assert table.set_index("phase").loc["forward", "int_products"] > 0.0


def _check_sums(table: pd.DataFrame) -> None:
    assert list(table.columns) == list(PROFILE_COLUMNS)
    assert (table[list(KINDS)] >= 0).all().all()
    assert table[list(KINDS)].sum(axis=1).tolist() == pytest.approx(table["ms_per_token"].tolist(), rel=1e-9)
    # the phases cover the profiled wall time (what no range covers is "other")
    wall_ms = 1e3 * table["profiled_wall_s"].iloc[0]
    total = (table["ms_per_token"] * table["tokens"]).sum()
    assert total == pytest.approx(wall_ms, rel=0.05)


def test_speculative_run_phases(tiny_pair):
    spec = parse_method("chain-k2")
    table = profile_method(spec, tiny_pair, IDS, max_new_tokens=12, drafter=build_drafter(spec, tiny_pair),
                           verifier="greedy")
    _check_sums(table)
    calls = dict(zip(table["phase"], table["calls"]))
    steps = int(table["steps"].iloc[0])
    assert calls["prefill"] == 1
    assert calls["forward"] == steps and calls["verify"] == steps and calls["draft"] == 2 * steps
    assert {"prefill", "draft", "tree", "forward", "verify", "cache"} <= set(calls)
    assert set(table["phase"]) <= set(PHASES) | {"other"}
    # the tiny pair runs in float32: its products are float ones, never integer kernels
    assert table["int_products"].sum() == 0.0 and table["float_products"].sum() > 0.0
    assert table["tokens"].iloc[0] == 12


def test_plain_runs(tiny_pair):
    table = profile_methods(["specviz-plain", "plain"], tiny_pair, IDS, max_new_tokens=8)
    mine = table[table["method"] == "specviz-plain"]
    _check_sums(mine)
    calls = dict(zip(mine["phase"], mine["calls"]))
    assert calls["prefill"] == 1 and calls["forward"] == 7  # the prefill makes the first token
    hf = table[table["method"] == "plain"]  # transformers' generate opens no range of the engine
    assert hf["phase"].tolist() == ["other"] and hf["share"].iloc[0] == pytest.approx(1.0, rel=0.05)


def test_refuses_llama_and_bad_budgets(tiny_pair):
    with pytest.raises(ValueError, match="llama.cpp's own process"):
        profile_methods(["llama-plain"], tiny_pair, IDS)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        profile_method(parse_method("specviz-plain"), tiny_pair, IDS, max_new_tokens=0)


def test_aggregate_is_token_weighted():
    base = {"calls": 1, "steps": 1, "wall_s": 1.0, "dtype": "fp32", "threads": 1}
    rows = pd.DataFrame([
        {**base, "method": "m", "question_id": 1, "phase": "forward", "ms_per_token": 10.0, "share": 1.0,
         "int_products": 0.0, "float_products": 6.0, "attention": 1.0, "other_ops": 1.0, "python": 2.0,
         "tokens": 10, "profiled_wall_s": 0.1},
        {**base, "method": "m", "question_id": 2, "phase": "forward", "ms_per_token": 4.0, "share": 0.5,
         "int_products": 0.0, "float_products": 2.0, "attention": 0.0, "other_ops": 1.0, "python": 1.0,
         "tokens": 30, "profiled_wall_s": 0.24},
        {**base, "method": "m", "question_id": 2, "phase": "prefill", "ms_per_token": 4.0, "share": 0.5,
         "int_products": 0.0, "float_products": 4.0, "attention": 0.0, "other_ops": 0.0, "python": 0.0,
         "tokens": 30, "profiled_wall_s": 0.24},
    ])
    out = aggregate_profile(rows)
    assert out["phase"].tolist() == ["prefill", "forward"]  # the engine's order
    fwd = out[out["phase"] == "forward"].iloc[0]
    assert fwd["ms_per_token"] == pytest.approx((100 + 120) / 40)
    assert fwd["float_products"] == pytest.approx((60 + 60) / 40)
    assert fwd["share"] == pytest.approx(220 / 340)
    assert out["share"].sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not a profile table"):
        aggregate_profile(rows.drop(columns=["python"]))


def test_command_line(tmp_path, capsys, monkeypatch, tiny_pair):
    monkeypatch.setattr(cli, "_load_models", lambda args: tiny_pair)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [t]}) + "\n" for q, c, t in
                               [(1, "code", "def add(a, b):"), (2, "qa", "What is the capital of France?")]))
    out = tmp_path / "profile.csv"
    argv = ["profile", "--models", "tiny", "--dtype", "fp32", "--prompts", str(prompts), "--limit", "2",
            "--max-new-tokens", "6", "--methods", "specviz-plain", "ngram-n3-k4", "--out", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "milliseconds per generated token, over 2 prompts" in text
    rows = pd.read_csv(out)
    assert set(rows["question_id"]) == {1, 2} and set(rows["method"]) == {"specviz-plain", "ngram-n3-k4"}
    assert cli.main(["profile", "--models", "tiny", "--methods", "llama-spec-k2"]) == 2
    assert "llama.cpp's own process" in capsys.readouterr().err
    assert cli.main(["profile", "--models", "tiny", "--limit", "0"]) == 2
    assert cli.main(["profile", "--models", "tiny", "--methods", "chain-kx"]) == 2

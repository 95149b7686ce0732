"""Tests for specviz.bench.serving and specviz.study.serving_units: batches, the batched
cost model, crossovers and memory (tiny models)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from specviz.bench.cost import CostModel, forward_cost_curve
from specviz.bench.serving import (BatchCostModel, BatchRun, PeakMemory, chain_budget, crossover_batch,
                                   crossover_interval, depth_acceptance, drafter_bytes, kv_bytes_per_token,
                                   model_bytes, modeled_speedup, predicted_batch_speedup, timed_batch_run)
from specviz.data.prompts import Prompt
from specviz.decode.plain import plain_generate
from specviz.draft.model import ChainDrafter
from specviz.draft.ngram import NgramDrafter
from specviz.study.serving_units import batch_prompts, batch_run_from_row, batch_units
from specviz.study.units import reference_units, references_from
from specviz.study.work import ModelSpec, Work
from specviz.data.store import ResultStore


def _prompts(target, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, target.vocab_size, (6 + 3 * i,), generator=gen).tolist() for i in range(n)]


def _run(shape, step_draft, wall, method="x", accepted=(), drafted=()) -> BatchRun:
    rows = max(r for r, _ in shape) if shape else 1
    return BatchRun(method, rows, wall, (1,) * rows, (1,) * rows, sum(step_draft), 0.0, tuple(shape),
                    tuple(step_draft), tuple(accepted), tuple(drafted), ((),) * rows, 0, "rss")


def test_cost_curve_over_rows(tiny_pair):
    one = forward_cost_curve(tiny_pair.target, [1, 3], prefix_len=8, warmup=0, repeats=1)
    three = forward_cost_curve(tiny_pair.target, [1, 3], prefix_len=8, warmup=0, repeats=1, rows=3)
    assert list(one["rows"]) == [1, 1] and list(three["rows"]) == [3, 3]
    assert (three["min_ms"] > 0).all()
    with pytest.raises(ValueError, match="rows"):
        forward_cost_curve(tiny_pair.target, [1], rows=0)


def test_batched_rows_equal_their_own_plain_decoding(tiny_pair):
    target = tiny_pair.target
    prompts = _prompts(target, 3)
    refs = [plain_generate(target, p, max_new_tokens=10).output_ids for p in prompts]
    plain = timed_batch_run(target, None, prompts, max_new_tokens=10)
    assert plain.method == "plain" and plain.rows == 3 and plain.memory == "rss"
    assert list(plain.output_ids) == [tuple(r) for r in refs]
    assert plain.shape == tuple((3, 1) for _ in range(9))  # nine forwards after the prefill's token
    chain = timed_batch_run(target, ChainDrafter(tiny_pair.draft, 3), prompts, max_new_tokens=10)
    assert list(chain.output_ids) == [tuple(r) for r in refs]
    assert chain.draft_s > 0 and chain.forward_s > 0 and chain.tau >= 1
    assert all(1 <= rows <= 3 and 1 <= fed <= 4 for rows, fed in chain.shape)
    assert len(chain.shape) == max(chain.steps) and all(max(d) <= 3 for d in chain.drafted)
    assert sum(chain.new_tokens) / chain.wall_s == pytest.approx(chain.tokens_per_s)
    with pytest.raises(ValueError, match="at least one prompt"):
        timed_batch_run(target, None, [], max_new_tokens=4)


def _grid(fn, rows=(1, 2, 4), sizes=(1, 2, 8)) -> tuple:
    return tuple((r, n, fn(r, n)) for r in rows for n in sizes)


def test_batch_cost_model_interpolates_over_rows_and_tokens():
    costs = BatchCostModel(_grid(lambda r, n: 10.0 + r * n), _grid(lambda r, n: 2.0 + r * n))
    assert costs.target_s(2, 8) == pytest.approx(0.026)  # a measured point
    assert costs.target_s(3, 8) == pytest.approx(0.010 + 0.024)  # linear in rows between 2 and 4
    assert costs.target_s(2, 5) == pytest.approx(0.020)  # linear in tokens between 2 and 8
    assert costs.target_s(8, 1) == pytest.approx(0.018)  # the last two batch sizes' line, extended
    assert costs.draft_s(4, 2) == pytest.approx(0.010)
    assert isinstance(costs.at(2), CostModel) and costs.at(2).target_s(8) == pytest.approx(0.026)
    with pytest.raises(ValueError, match="distinct"):
        BatchCostModel(((1, 1, 1.0), (1, 1, 2.0)), ((1, 1, 1.0),))
    frame = pd.DataFrame({"n_tokens": [1, 4], "min_ms": [3.0, 5.0]})  # no rows column: one row
    assert BatchCostModel.from_curves(frame, frame).target_ms == ((1, 1, 3.0), (1, 4, 5.0))


def test_roofline_is_bandwidth_or_compute_bound():
    roof = BatchCostModel.roofline(bandwidth_gb_s=1000, tflop_s=100, target_bytes=2e9, draft_bytes=1e9,
                                   target_params=1e9, draft_params=5e8, rows=[1, 64], sizes=[1, 8], overhead_ms=1.0)
    assert roof.target_s(1, 1) == pytest.approx(0.002 + 0.001)  # 2 GB at 1 TB/s
    assert roof.target_s(64, 8) == pytest.approx(2 * 1e9 * 512 / 1e14 + 0.001)  # compute-bound
    assert roof.draft_s(1, 1) == pytest.approx(0.001 + 0.001)
    assert "1000 GB/s" in roof.source
    with pytest.raises(ValueError, match="bandwidth"):
        BatchCostModel.roofline(bandwidth_gb_s=0, tflop_s=1, target_bytes=1, draft_bytes=1, target_params=1,
                                draft_params=1, rows=[1], sizes=[1])


def test_predicted_and_modeled_speedups():
    costs = BatchCostModel(_grid(lambda r, n: 10.0 + r * n), _grid(lambda r, n: 2.0 + r * n))
    plain = _run([(2, 1)] * 6, [0.0] * 6, wall=0.5)  # 6 forwards of 12 ms = 0.072 s; the rest 0.428 s
    spec = _run([(2, 4), (1, 4)], [0.01, 0.01], wall=1.0)
    expected = 0.5 / (0.428 + 0.01 + 0.018 + 0.01 + 0.014)
    assert predicted_batch_speedup(plain, spec, costs) == pytest.approx(expected)
    assert modeled_speedup(costs, 2, 3.0, 4, 2.0) == pytest.approx(3 * 0.012 / (2 * 0.004 + 0.018))


def test_depth_acceptance_is_conditional_on_the_depths_before():
    run = _run([(1, 4)] * 4, [0.0] * 4, 1.0, accepted=[(3, 1, 0, 2)], drafted=[(3, 3, 3, 2)])
    # depth 1: 3 of 4 steps kept it; depth 2: reached by 3 steps (accepted >= 1), kept by 2; depth 3: reached by
    # the steps that accepted 2 or more and drafted 3 (one step: accepted 3), kept by it
    assert depth_acceptance([run], 4) == pytest.approx([0.75, 2 / 3, 1.0])  # depth 4: never reached, not guessed
    assert depth_acceptance([run], 2) == pytest.approx([0.75, 2 / 3])


def test_chain_budget_shrinks_when_verification_gets_dear():
    flat = BatchCostModel(_grid(lambda r, n: 10.0), _grid(lambda r, n: 0.1))
    steep = BatchCostModel(_grid(lambda r, n: 10.0 * r * n), _grid(lambda r, n: 0.1))
    rates = [0.9, 0.9, 0.9, 0.9]
    assert chain_budget(rates, flat, 1) == 4
    assert chain_budget(rates, steep, 4) == 0
    assert chain_budget([0.0] * 4, flat, 1) == 0
    assert chain_budget(rates[:2], flat, 1) == 2  # no longer than the acceptance measured
    # a speculative step that costs more to run than a plain one (the batch's bookkeeping) is not worth it
    assert chain_budget(rates, flat, 1, step_overhead_s=0.05) == 0
    assert chain_budget(rates, flat, 1, step_overhead_s=0.05, plain_overhead_s=0.05) == 4
    assert chain_budget(rates, flat, 1, draft_token_s=0.02) == 0  # drafting measured dearer than the curve says


def test_crossover():
    assert crossover_batch([1, 2, 4], [1.5, 1.0, 0.5]) == pytest.approx(2 ** 1.0)
    assert crossover_batch([1, 2, 4], [1.5, 1.25, 0.75]) == pytest.approx(2 ** 1.5)
    assert math.isinf(crossover_batch([1, 2], [1.2, 1.1]))
    assert crossover_batch([1, 2], [0.9, 1.3]) == 0.0
    table = pd.DataFrame({"batch": [1, 2, 4], "repeat": [0, 0, 0], "speedup": [1.5, 1.0, 0.5]})
    assert crossover_interval(table) == pytest.approx((2.0, 2.0, 2.0))  # one round: no spread
    spread = pd.DataFrame({"batch": [1, 1, 2, 2, 4, 4], "repeat": [0, 1] * 3,
                           "speedup": [1.5, 1.4, 1.2, 0.9, 0.7, 0.8]})
    est, low, high = crossover_interval(spread, n_resamples=500)
    assert low <= est <= high and low < high
    with pytest.raises(ValueError, match="repeat"):
        crossover_interval(table.drop(columns="repeat"))


def test_peak_memory_sees_an_allocation():
    with PeakMemory("cpu") as memory:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
        del block
    assert memory.kind == "rss" and memory.peak_bytes >= 48 * 2**20


def test_memory_of_models_drafters_and_caches(tiny_pair):
    target, draft = tiny_pair.target, tiny_pair.draft
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*target.model.parameters(), *target.model.buffers()]}
    assert model_bytes(target) == sum(storages.values()) > 0
    config = target.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert kv_bytes_per_token(target) == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    chain = ChainDrafter(draft, 2)
    assert drafter_bytes(chain, target) >= model_bytes(draft)
    ngram = NgramDrafter(n=3, k=4)
    fresh = drafter_bytes(ngram, target)
    timed_batch_run(target, ngram, _prompts(target, 1), max_new_tokens=12)  # one row: the drafter itself runs
    assert drafter_bytes(ngram, target) > fresh
    assert drafter_bytes(ngram, target) < model_bytes(target)  # the target's own weights are not counted


def test_batch_units_check_every_row_against_its_reference(tmp_path):
    spec = ModelSpec("tiny")
    prompts = [Prompt(i, "writing", (f"prompt {i} about a tiny model",)) for i in range(2)]
    assert [p.question_id for p in batch_prompts(prompts, 5)] == [0, 1, 0, 1, 0]
    work = Work(spec, out_dir=str(tmp_path))
    refs_store = ResultStore.open(str(tmp_path), "refs")
    work.run(refs_store, reference_units(spec, prompts, 6))
    refs = references_from(refs_store, spec, prompts, 6)
    from functools import partial
    from specviz.draft.registry import build_drafter

    methods = [("plain", None), ("chain-k2", partial(build_drafter, "chain-k2")),
               ("ngram", partial(build_drafter, "ngram"))]
    units = batch_units(spec, prompts, refs, methods, batches=[1, 3], repeats=2, max_new_tokens=6, threads=None)
    assert len({u.id for u in units}) == len(units) == 12
    assert [u.kwargs["method"] for u in units[:3]] == ["plain", "chain-k2", "ngram"]
    assert [u.kwargs["method"] for u in units[6:9]] == ["plain", "ngram", "chain-k2"]  # rotated in round 2
    store = ResultStore.open(str(tmp_path), "batches")
    ids = work.run(store, units[:6])
    rows = [r for u in ids for r in store.rows_of(u)]
    assert all(all(r["matches_plain"]) for r in rows)
    assert [len(r["new_tokens"]) for r in rows] == [1, 1, 1, 3, 3, 3]
    run = batch_run_from_row(rows[4])
    assert run.method == "chain-k2" and run.rows == 3 and len(run.output_ids) == 3
    with pytest.raises(ValueError, match="no reference"):
        batch_units(spec, prompts, {0: refs[0]}, methods, batches=[1], repeats=1, max_new_tokens=6, threads=None)

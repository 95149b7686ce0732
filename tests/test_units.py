"""Tests for specviz.study.units: the study notebooks' units of work (tiny models, in this process)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from specviz.decode.engine import encode_prompt
from specviz.decode.ranks import draft_candidates, draft_ranks
from specviz.decode.records import records_from_result
from specviz.decode.replay import greedy_reference, replay_acceptance, replay_dynamic, replay_shape
from specviz.draft.registry import build_drafter
from specviz.draft.ngram import NgramDrafter
from specviz.draft.self_spec import self_speculative_model
from specviz.metrics.acceptance import label_rows
from specviz.data.prompts import Prompt
from specviz.data.store import ResultStore
from specviz.models.fused import is_fused
from specviz.study.units import (DYNAMIC_STRATEGY, candidates_from, cost_units, drafter_units, dynamic_units,
                                 layer_units, rank_units, ranks_from, reference_id, reference_units, references_from,
                                 shape_units, timed_units)
from specviz.study.work import ModelSpec, Work, models_for
from specviz.tree.budgets import budget_shapes, shape_key

LABELS = {"question_id": 7, "category": "code"}
SPEC = ModelSpec("tiny", "fp32")  # the same pair as the tiny_pair fixture
PROMPT = Prompt(7, "code", ("def fizzbuzz(n):",))


@pytest.fixture(scope="module")
def work():
    return Work(SPEC)


@pytest.fixture(scope="module")
def reference(work):
    store = ResultStore(None)
    work.run(store, reference_units(SPEC, [PROMPT], 20))
    return references_from(store, SPEC, [PROMPT], 20)[7]


def test_reference_units_equal_greedy_decoding(tiny_pair, reference, work, tmp_path):
    direct = greedy_reference(tiny_pair.target, PROMPT.text, 20)
    assert reference.prompt_ids == direct.prompt_ids and reference.output_ids == direct.output_ids
    assert reference.text == direct.text and reference.max_new_tokens == 20
    assert reference_id(SPEC, PROMPT, 20).startswith("tiny-0/fp32/T20/")


def test_rank_units_store_teacher_forced_ranks_once(tiny_pair, reference, tmp_path):
    work = Work(SPEC, out_dir=tmp_path)
    store = ResultStore.open(tmp_path, "ranks")
    units = rank_units(SPEC, ["draft", "self-L1"], {7: reference})
    work.run(store, units)
    assert torch.equal(ranks_from(store, SPEC, "draft", reference),
                       draft_ranks(tiny_pair.draft, reference.prompt_ids, reference.output_ids))
    small = self_speculative_model(tiny_pair.target, 1)
    assert torch.equal(ranks_from(store, SPEC, "self-L1", reference),
                       draft_ranks(small, reference.prompt_ids, reference.output_ids))
    assert work.executed == 2
    again = Work(SPEC, out_dir=tmp_path)
    again.run(ResultStore.open(tmp_path, "ranks"), units)
    assert again.executed == 0
    times = ResultStore.open(tmp_path, "unit_times").frame()
    assert len(times) == 2 and (times["seconds"] > 0).all() and set(times["batch"]) == {"units"}


def test_rank_units_with_k_store_ranks_and_candidates_from_one_forward(tiny_pair, reference):
    work = Work(SPEC)
    store = ResultStore(None)
    ids = work.run(store, rank_units(SPEC, ["draft"], {7: reference}, k=4))
    assert len(ids) == 1 and "/k4/" in ids[0]
    probs, ranks = candidates_from(store, SPEC, "draft", reference, k=4)
    want_probs, want_ranks = draft_candidates(tiny_pair.draft, reference.prompt_ids, reference.output_ids, k=4)
    assert torch.allclose(probs, want_probs) and torch.equal(ranks, want_ranks)
    assert torch.equal(ranks_from(store, SPEC, "draft", reference, k=4), ranks)
    with pytest.raises(KeyError):
        ranks_from(store, SPEC, "draft", reference)  # ranks without candidates are another unit
    with pytest.raises(ValueError, match="k must be at least 1"):
        candidates_from(store, SPEC, "draft", reference, k=0)
    with pytest.raises(ValueError, match="k must be"):
        rank_units(SPEC, ["draft"], {7: reference}, k=-1)


def test_shape_units_store_labelled_replays(tiny_pair, reference, work):
    ranks = draft_ranks(tiny_pair.draft, reference.prompt_ids, reference.output_ids)
    shapes = budget_shapes(4)
    store = ResultStore(None)
    units = shape_units(SPEC, reference, ranks, shapes, pair="tiny", budget=4, labels=LABELS)
    ids = work.run(store, units)
    assert [u.split("/")[1:3] for u in ids] == [[family, shape_key(shape)] for family, shape in shapes.items()]
    chain_rows = store.rows_of(ids[0])
    expected = label_rows(replay_shape(shapes["chain"], ranks, reference, target=tiny_pair.target),
                          pair="tiny", strategy="chain", budget=4, **LABELS)
    assert chain_rows == expected
    assert list(chain_rows[0])[:5] == ["pair", "strategy", "budget", "question_id", "category"]


def test_dynamic_units_replay_every_budget_in_one_unit(tiny_pair, reference, work):
    store = ResultStore(None)
    (unit,) = work.run(store, dynamic_units(SPEC, reference, [8, 4], topk=2, depth=3, pair="tiny", labels=LABELS))
    assert unit.startswith("tiny/dynamic-k2-d3/4-8/")
    replayed = replay_dynamic(tiny_pair.draft, reference, [4, 8], topk=2, depth=3, target=tiny_pair.target)
    expected = [row for b in (4, 8) for row in label_rows(replayed[b], pair="tiny", strategy=DYNAMIC_STRATEGY,
                                                          budget=b, **LABELS)]
    assert store.rows_of(unit) == expected


def test_drafter_units_key_by_name_and_variant(tiny_pair, reference, work):
    store = ResultStore(None)
    drafter = NgramDrafter(n=2, k=4)
    (unit,) = work.run(store, drafter_units(SPEC, reference, {"n-gram chain": drafter}, pair="ngram", budget=4,
                                            variant="d8", labels=LABELS))
    assert unit.startswith(f"ngram/{drafter.name}/d8/tiny-0/fp32/T20/")
    records = records_from_result(replay_acceptance(tiny_pair.target, NgramDrafter(n=2, k=4), reference))
    assert store.rows_of(unit) == label_rows(records, pair="ngram", strategy="n-gram chain", budget=4, **LABELS)


def test_layer_units_measure_truncated_agreement(reference, work):
    store = ResultStore(None)
    (unit,) = work.run(store, layer_units(SPEC, reference, [1]))
    row = store.rows_of(unit)[0]
    assert row["layers"] == 1 and row["share_of_target_layers"] == 0.5
    assert 0.0 <= row["a_2"] <= row["a_1 (top-1 agrees)"] + row["a_2"] <= 1.0


def test_work_rejects_repeated_unit_ids(reference, work):
    units = layer_units(SPEC, reference, [1, 1])
    with pytest.raises(ValueError, match="distinct"):
        work.run(ResultStore(None), units)


def test_model_spec_checks_its_kind():
    with pytest.raises(ValueError, match="models"):
        ModelSpec("huge")
    assert ModelSpec().labels == ("0.5B", "1.5B")


def test_timed_units_run_once_and_read_back(tiny_pair, tmp_path):
    prompt = Prompt(3, "math", ("What is 2 + 2?",))
    store = ResultStore.open(tmp_path, "speed")
    work = Work(SPEC, out_dir=tmp_path)
    units = timed_units(SPEC, prompt, [("plain", None), ("chain-k2", partial(build_drafter, "chain-k2"))],
                        max_new_tokens=5, threads=1)
    plain_id, chain_id = work.run(store, units, timing=True)
    row = store.rows_of(chain_id)[0]
    assert list(row) == ["method", "question_id", "category", "position", "new_tokens", "wall_s", "steps", "drafted",
                         "accepted", "draft_s", "verify_s", "mean_nodes", "output_ids", "prompt_ids", "machine"]
    assert row["method"] == "chain-k2" and row["question_id"] == 3 and row["new_tokens"] == 5
    assert row["position"] == 1 and "cores)" in row["machine"]
    assert row["prompt_ids"] == encode_prompt(tiny_pair.target.tokenizer, prompt.text)
    again = Work(SPEC, out_dir=tmp_path)
    again.run(ResultStore.open(tmp_path, "speed"), units, timing=True)
    assert again.executed == 0 and work.executed == 2
    assert chain_id == f"chain-k2/{reference_id(SPEC, prompt, 5)}/threads1"
    plain = store.rows_of(plain_id)[0]
    assert plain["output_ids"] == row["output_ids"] and plain["steps"] == 5 and plain["position"] == 0


def test_a_draft_in_its_own_weight_mode_keys_the_units_that_run_it(tmp_path):
    four_bit = ModelSpec("tiny", "fp32", draft_dtype="w4a8-token")
    assert ModelSpec("tiny", "fp32", draft_dtype="fp32") == SPEC and SPEC.draft_tag == ""  # one spelling per pair
    assert four_bit.draft_mode == "w4a8-token" and four_bit.draft_tag == "+draft-w4a8-token-fused-one-pass"
    assert ModelSpec("tiny", "fp32", draft_layers="modules").draft_tag == ""  # layers only matter in w4a8-token
    assert ModelSpec("tiny", "w4a8-token", draft_layers="modules").draft_tag == "+draft-w4a8-token-modules"
    with pytest.raises(ValueError, match="draft_layers"):
        ModelSpec("tiny", "fp32", draft_dtype="w4a8-token", draft_layers="fast")
    # the target's references are shared; what runs the draft is not
    assert reference_id(four_bit, PROMPT, 20) == reference_id(SPEC, PROMPT, 20)
    methods = [("plain", None), ("chain-k2", partial(build_drafter, "chain-k2"))]
    plain, chain = timed_units(SPEC, PROMPT, methods, max_new_tokens=6, threads=1)
    plain4, chain4 = timed_units(four_bit, PROMPT, methods, max_new_tokens=6, threads=1)
    assert plain4.id == plain.id and chain4.id != chain.id and "+draft-w4a8-token" in chain4.id
    target, draft = cost_units(SPEC, ["target", "draft"], [1, 2], prefix_len=8, repeats=1, seed=0)
    target4, draft4 = cost_units(four_bit, ["target", "draft"], [1, 2], prefix_len=8, repeats=1, seed=0)
    assert target4.id == target.id and draft4.id != draft.id
    work = Work(four_bit, out_dir=tmp_path)
    pair = models_for(four_bit)
    assert (pair.target.weight_mode, pair.draft.weight_mode) == ("fp32", "w4a8-token") and is_fused(pair.draft.model)
    store = ResultStore.open(tmp_path, "speed")
    ids = work.run(store, [plain4, chain4], timing=True)
    rows = [store.rows_of(i)[0] for i in ids]
    assert rows[0]["output_ids"] == rows[1]["output_ids"]  # the 4-bit draft changes proposals, never the output
    curves = ResultStore.open(tmp_path, "curves")
    work.run(curves, [draft4], timing=True)
    assert set(curves.frame([draft4.id])["dtype"]) == {"w4a8-token"}


def test_self_speculative_model_shares_the_targets_layers(tiny_pair):
    small = self_speculative_model(tiny_pair.target, 1)
    assert small.name == f"{tiny_pair.target.name}[:1]"
    assert small.tokenizer is tiny_pair.target.tokenizer and small.dtype == tiny_pair.target.dtype
    assert small.model.model.layers[0] is tiny_pair.target.model.model.layers[0]
    assert len(small.model.model.layers) == 1
    with pytest.raises(ValueError, match="n_layers"):
        self_speculative_model(tiny_pair.target, 2)

"""Tests for specviz.study.units: store-backed units of the study notebooks (tiny models)."""

from __future__ import annotations

import pytest
import torch

from specviz.decode.engine import encode_prompt
from specviz.decode.ranks import draft_ranks
from specviz.decode.records import records_from_result
from specviz.decode.replay import greedy_reference, reference_key, replay_acceptance, replay_dynamic, replay_shape
from specviz.draft.model import ChainDrafter
from specviz.draft.ngram import NgramDrafter
from specviz.draft.self_spec import self_speculative_model
from specviz.metrics.acceptance import label_rows
from specviz.study.prompts import Prompt
from specviz.study.store import ResultStore
from specviz.study.units import (DYNAMIC_STRATEGY, replay_drafter_units, replay_dynamic_units, replay_shape_units,
                                 stored_draft_ranks, timed_unit)
from specviz.tree.budgets import budget_shapes, shape_key

LABELS = {"question_id": 7, "category": "code"}


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return greedy_reference(tiny_pair.target, "def fizzbuzz(n):", 20)


def test_stored_draft_ranks_are_computed_once(tiny_pair, reference, tmp_path):
    store = ResultStore.open(tmp_path, "ranks")
    ranks = stored_draft_ranks(store, tiny_pair.draft, tiny_pair.target, reference)
    assert torch.equal(ranks, draft_ranks(tiny_pair.draft, reference.prompt_ids, reference.output_ids))
    key = reference_key(tiny_pair.target, reference.prompt_ids, 20)
    assert store.units == (f"{tiny_pair.draft.name}/{key}",)
    again = ResultStore.open(tmp_path, "ranks")
    assert torch.equal(stored_draft_ranks(again, tiny_pair.draft, tiny_pair.target, reference), ranks)
    assert len(again) == 1


def test_shape_units_store_labelled_replays(tiny_pair, reference, tmp_path):
    ranks = draft_ranks(tiny_pair.draft, reference.prompt_ids, reference.output_ids)
    shapes = budget_shapes(4)
    store = ResultStore.open(tmp_path, "steps")
    units = replay_shape_units(store, tiny_pair.target, reference, ranks, shapes, pair="tiny", budget=4,
                               labels=LABELS)
    key = reference_key(tiny_pair.target, reference.prompt_ids, 20)
    assert units == tuple(f"tiny/{family}/{shape_key(shape)}/{key}" for family, shape in shapes.items())
    chain_rows = store.rows_of(units[0])
    expected = label_rows(replay_shape(shapes["chain"], ranks, reference, target=tiny_pair.target),
                          pair="tiny", strategy="chain", budget=4, **LABELS)
    assert chain_rows == expected
    assert list(chain_rows[0])[:5] == ["pair", "strategy", "budget", "question_id", "category"]
    # a second call finds every unit and runs nothing
    resumed = ResultStore.open(tmp_path, "steps")
    assert replay_shape_units(resumed, tiny_pair.target, reference, torch.zeros(0, dtype=torch.long), shapes,
                              pair="tiny", budget=4, labels=LABELS) == units


def test_dynamic_units_run_only_missing_budgets(tiny_pair, reference, tmp_path):
    store = ResultStore.open(tmp_path, "steps")
    first = replay_dynamic_units(store, tiny_pair.target, tiny_pair.draft, reference, [4], topk=2, depth=3,
                                 pair="tiny", labels=LABELS)
    both = replay_dynamic_units(store, tiny_pair.target, tiny_pair.draft, reference, [4, 8], topk=2, depth=3,
                                pair="tiny", labels=LABELS)
    key = reference_key(tiny_pair.target, reference.prompt_ids, 20)
    assert both == (f"tiny/dynamic-k2-d3/4/{key}", f"tiny/dynamic-k2-d3/8/{key}") and both[0] == first[0]
    replayed = replay_dynamic(tiny_pair.draft, reference, [4, 8], topk=2, depth=3, target=tiny_pair.target)
    for b, unit in zip((4, 8), both):
        assert store.rows_of(unit) == label_rows(replayed[b], pair="tiny", strategy=DYNAMIC_STRATEGY, budget=b,
                                                 **LABELS)


def test_drafter_units_key_by_name_and_variant(tiny_pair, reference, tmp_path):
    store = ResultStore.open(tmp_path, "steps")
    drafter = NgramDrafter(n=2, k=4)
    (unit,) = replay_drafter_units(store, tiny_pair.target, reference, {"n-gram chain": drafter}, pair="ngram",
                                   budget=4, variant="d8", labels=LABELS)
    assert unit == f"ngram/{drafter.name}/d8/{reference_key(tiny_pair.target, reference.prompt_ids, 20)}"
    records = records_from_result(replay_acceptance(tiny_pair.target, NgramDrafter(n=2, k=4), reference))
    assert store.rows_of(unit) == label_rows(records, pair="ngram", strategy="n-gram chain", budget=4, **LABELS)


def test_timed_unit_runs_once_and_reads_back(tiny_pair, tmp_path):
    prompt = Prompt(3, "math", ("What is 2 + 2?",))
    store = ResultStore.open(tmp_path, "speed")
    calls = []

    def make():
        calls.append(1)
        return ChainDrafter(tiny_pair.draft, 2)

    row = timed_unit(store, tiny_pair.target, prompt, "chain-k2", make, max_new_tokens=5, position=1)
    assert list(row) == ["method", "question_id", "category", "position", "new_tokens", "wall_s", "steps", "drafted",
                         "accepted", "draft_s", "verify_s", "mean_nodes", "output_ids"]
    assert row["method"] == "chain-k2" and row["question_id"] == 3 and row["new_tokens"] == 5
    again = timed_unit(ResultStore.open(tmp_path, "speed"), tiny_pair.target, prompt, "chain-k2", make,
                       max_new_tokens=5, position=1)
    assert again == row and len(calls) == 1
    (unit,) = store.units
    ids = encode_prompt(tiny_pair.target.tokenizer, prompt.text)
    assert unit == f"chain-k2/{reference_key(tiny_pair.target, ids, 5)}/threads{torch.get_num_threads()}"
    plain = timed_unit(store, tiny_pair.target, prompt, "plain", lambda: None, max_new_tokens=5, position=0)
    assert plain["output_ids"] == row["output_ids"] and plain["steps"] == 5


def test_self_speculative_model_shares_the_targets_layers(tiny_pair):
    small = self_speculative_model(tiny_pair.target, 1)
    assert small.name == f"{tiny_pair.target.name}[:1]"
    assert small.tokenizer is tiny_pair.target.tokenizer and small.dtype == tiny_pair.target.dtype
    assert small.model.model.layers[0] is tiny_pair.target.model.model.layers[0]
    assert len(small.model.model.layers) == 1
    with pytest.raises(ValueError, match="n_layers"):
        self_speculative_model(tiny_pair.target, 2)

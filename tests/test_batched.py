"""Tests for batched decoding (greedy and sampled) and batched EAGLE-2 replays (tiny models): each row
equals its one-by-one run, and the study units built on them read back the same results."""

from __future__ import annotations

import pytest
import torch

from specviz.decode.engine import plain_generate, plain_generate_batch
from specviz.decode.replay import replay_dynamic, replay_dynamic_batch
from specviz.sampling import SamplingConfig
from specviz.data.prompts import Prompt
from specviz.data.store import ResultStore
from specviz.study.units import (DYNAMIC_STRATEGY, dynamic_batch_units, dynamic_units, reference_id, reference_units,
                                 references_from)
from specviz.study.work import ModelSpec, Work

SPEC = ModelSpec("tiny", "fp32")  # the same pair as the tiny_pair fixture
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3], [9, 9, 9, 9, 9], [40, 41]]
TEXTS = [Prompt(1, "code", ("def fizzbuzz(n):",)), Prompt(2, "qa", ("Why is the sky blue?",)),
         Prompt(3, "writing", ("Write a haiku about spring rain on a tin roof.",)), Prompt(4, "qa", ("2+2?",))]


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_plain_generate_batch_equals_one_by_one(tiny_pair, batch_size):
    alone = [plain_generate(tiny_pair.target, p, max_new_tokens=14, stop_at_eos=False) for p in PROMPTS]
    together = plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=14, batch_size=batch_size,
                                    stop_at_eos=False)
    assert [r.prompt_ids for r in together] == [r.prompt_ids for r in alone]  # the order given, not by length
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert all(r.stop_reason == "max_new_tokens" and r.max_new_tokens == 14 for r in together)


def test_plain_generate_batch_stops_rows_at_end_of_sequence(tiny_pair, monkeypatch):
    alone = [plain_generate(tiny_pair.target, p, max_new_tokens=30, stop_at_eos=False) for p in PROMPTS]
    # a token the first row emits early counts as end-of-sequence: rows that emit it stop, the others go on
    monkeypatch.setattr(tiny_pair.target.model.generation_config, "eos_token_id", alone[0].output_ids[3])
    one = [plain_generate(tiny_pair.target, p, max_new_tokens=30) for p in PROMPTS]
    many = plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=30, batch_size=5)
    assert [r.output_ids for r in many] == [r.output_ids for r in one]
    assert [r.stop_reason for r in many] == [r.stop_reason for r in one]
    assert {r.stop_reason for r in many} == {"eos", "max_new_tokens"}


@pytest.mark.parametrize("max_new_tokens", [1, 30])
def test_plain_generate_batch_returns_the_decodings_hidden_states(tiny_pair, monkeypatch, max_new_tokens):
    from specviz.heads import target_features
    alone = [plain_generate(tiny_pair.target, p, max_new_tokens=30, stop_at_eos=False) for p in PROMPTS]
    monkeypatch.setattr(tiny_pair.target.model.generation_config, "eos_token_id", alone[0].output_ids[3])
    plain = plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=max_new_tokens, batch_size=3)
    kept = plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=max_new_tokens, batch_size=3, features=True)
    assert [r.output_ids for r, _ in kept] == [r.output_ids for r in plain]  # the extra forwards change nothing
    if max_new_tokens == 30:
        assert {r.stop_reason for r, _ in kept} == {"eos", "max_new_tokens"}  # rows end at different steps
    for result, feats in kept:
        seq = list(result.prompt_ids) + list(result.output_ids)
        assert feats.shape == (len(seq), tiny_pair.target.model.config.hidden_size) and feats.dtype == torch.float32
        # every position, the last token's included, as one teacher-forced forward computes it
        torch.testing.assert_close(feats, target_features(tiny_pair.target, seq), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_plain_generate_batch_samples_as_one_by_one(tiny_pair, batch_size):
    hot = SamplingConfig(temperature=1.5, top_p=0.9)
    alone = [plain_generate(tiny_pair.target, p, max_new_tokens=12, config=hot, seed=7 + i, stop_at_eos=False)
             for i, p in enumerate(PROMPTS)]
    together = plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=12, batch_size=batch_size,
                                    config=hot, seed=7, stop_at_eos=False)
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert all(r.config == hot for r in together)
    seeds = [3, 1, 4, 1, 5]  # one seed per prompt; equal seeds draw equal random numbers
    listed = plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=12, batch_size=batch_size,
                                  config=hot, seed=seeds, stop_at_eos=False)
    assert [r.output_ids for r in listed] == [
        plain_generate(tiny_pair.target, p, max_new_tokens=12, config=hot, seed=s, stop_at_eos=False).output_ids
        for p, s in zip(PROMPTS, seeds)]
    greedy = plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=12, batch_size=batch_size,
                                  stop_at_eos=False)
    assert [r.output_ids for r in together] != [r.output_ids for r in greedy]  # it does sample


def test_plain_generate_batch_rejects_bad_input(tiny_pair):
    with pytest.raises(ValueError, match="non-empty list"):
        plain_generate_batch(tiny_pair.target, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty list"):
        plain_generate_batch(tiny_pair.target, "one string", max_new_tokens=4)
    with pytest.raises(ValueError, match="batch_size"):
        plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=4, batch_size=0)
    with pytest.raises(TypeError, match="SamplingConfig"):
        plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=4, config=0.7)
    with pytest.raises(ValueError, match="seed lists 2 seeds for 5 prompts"):
        plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=4, seed=[1, 2])
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        plain_generate_batch(tiny_pair.target, PROMPTS, max_new_tokens=4, seed=-1)


def test_replay_dynamic_batch_equals_one_by_one(tiny_pair):
    refs = [plain_generate(tiny_pair.target, p, max_new_tokens=20, stop_at_eos=False) for p in PROMPTS]
    alone = [replay_dynamic(tiny_pair.draft, r, [2, 4, 8], topk=3, depth=4, target=tiny_pair.target) for r in refs]
    together = replay_dynamic_batch(tiny_pair.draft, refs, [8, 2, 4], topk=3, depth=4, target=tiny_pair.target)
    assert together == alone
    assert all(sum(s.committed for s in steps) == 20 for result in together for steps in result.values())
    with pytest.raises(ValueError, match="non-empty list"):
        replay_dynamic_batch(tiny_pair.draft, refs[0], [2])
    with pytest.raises(ValueError, match="budgets"):
        replay_dynamic_batch(tiny_pair.draft, refs, [])


def test_batched_reference_units_read_back_like_one_by_one(tmp_path):
    work = Work(SPEC, out_dir=tmp_path)
    store = ResultStore.open(tmp_path, "references")
    units = reference_units(SPEC, TEXTS, 12, batch_size=3)
    assert len(units) == 2 and all("/b3/batch-" in u.id for u in units)
    work.run(store, units)
    batched = references_from(store, SPEC, TEXTS, 12, batch_size=3)
    single_store = ResultStore(None)
    work.run(single_store, reference_units(SPEC, TEXTS, 12))
    single = references_from(single_store, SPEC, TEXTS, 12)
    assert {q: r.output_ids for q, r in batched.items()} == {q: r.output_ids for q, r in single.items()}
    assert reference_id(SPEC, TEXTS[0], 12, 3) != reference_id(SPEC, TEXTS[0], 12)
    # a rerun finds every batch done
    again = Work(SPEC, out_dir=tmp_path)
    again.run(ResultStore.open(tmp_path, "references"), units)
    assert again.executed == 0
    with pytest.raises(KeyError, match="no batched reference"):
        references_from(store, SPEC, TEXTS, 12, batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        reference_units(SPEC, TEXTS, 12, batch_size=0)


def test_dynamic_batch_units_store_the_rows_of_one_by_one_units():
    work = Work(SPEC)
    ref_store = ResultStore(None)
    work.run(ref_store, reference_units(SPEC, TEXTS, 16))
    refs = references_from(ref_store, SPEC, TEXTS, 16)
    labels = [{"question_id": p.question_id, "category": p.category} for p in TEXTS]
    single = ResultStore(None)
    ids = work.run(single, [u for p, lab in zip(TEXTS, labels)
                            for u in dynamic_units(SPEC, refs[p.question_id], [2, 6], topk=3, depth=3, pair="p",
                                                   labels=lab)])
    batched = ResultStore(None)
    batch_ids = work.run(batched, dynamic_batch_units(SPEC, [refs[p.question_id] for p in TEXTS], [6, 2], topk=3,
                                                      depth=3, pair="p", labels=labels, batch_size=3))
    assert len(batch_ids) == 2

    def rows(store, unit_ids):
        frame = store.frame(unit_ids).drop(columns="unit")
        return frame.sort_values(["question_id", "budget", "step"]).reset_index(drop=True)

    one, many = rows(single, ids), rows(batched, batch_ids)
    assert set(one["strategy"]) == {DYNAMIC_STRATEGY} and len(one) > 0
    assert one.equals(many[one.columns])
    with pytest.raises(ValueError, match="label sets"):
        dynamic_batch_units(SPEC, [refs[1]], [2], topk=3, depth=3, pair="p", labels=[], batch_size=2)

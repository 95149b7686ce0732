"""Bootstrap intervals, tokens-per-step distributions, per-position acceptance, calibration
and the hindsight oracle."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from specviz.decode import GenerationResult, StepRecord, draft_candidates, draft_ranks, oracle_depth, replay_oracle
from specviz.decode.replay import replay_shape
from specviz.metrics import (bootstrap_ratio, bootstrap_summary, calibration_bins, candidate_outcomes,
                             expected_calibration_error, per_position_acceptance, records_table, robust_range,
                             tau_distribution)
from specviz.models import tiny_pair
from specviz.sampling import GREEDY
from specviz.tree.shapes import chain, expansion


def _steps(per_prompt: dict[int, list[int]], drafted: int = 4) -> pd.DataFrame:
    tables = []
    for q, accepted in per_prompt.items():
        records = [StepRecord(step=i, position=0, drafted=drafted, depth=drafted, accepted=a, extendable=a < drafted,
                              committed=a + 1) for i, a in enumerate(accepted)]
        tables.append(records_table(records, strategy="s", question_id=q))
    return pd.concat(tables, ignore_index=True)


def test_tau_distribution_counts_every_length_including_gaps():
    table = tau_distribution(_steps({1: [0, 0, 3], 2: [1]}), ["strategy"])
    assert table["tokens"].tolist() == [1, 2, 3, 4]
    assert table["steps"].tolist() == [2, 1, 0, 1]
    assert table["share"].sum() == pytest.approx(1.0)
    assert set(table["total_steps"]) == {4}


def test_per_position_acceptance_is_share_of_steps_reaching_k():
    table = per_position_acceptance(_steps({1: [0, 2, 3], 2: [1]}), ["strategy"])
    assert table["draft_position"].tolist() == [1, 2, 3]
    assert table["rate"].tolist() == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    capped = per_position_acceptance(_steps({1: [0, 2, 3]}), ["strategy"], max_position=2)
    assert capped["draft_position"].tolist() == [1, 2]


def test_step_table_without_columns_is_refused():
    with pytest.raises(ValueError, match="lacks columns"):
        tau_distribution(pd.DataFrame({"strategy": ["s"]}), ["strategy"])


def test_bootstrap_ratio_brackets_the_point_estimate_and_needs_two_clusters():
    rng = np.random.default_rng(1)
    steps = rng.integers(5, 20, size=12).astype(float)
    accepted = steps * rng.uniform(1.0, 3.0, size=12)
    low, high = bootstrap_ratio(accepted, steps, n_resamples=4000, seed=3)
    point = accepted.sum() / steps.sum()
    assert low < point < high
    assert (accepted / steps).min() <= low and high <= (accepted / steps).max()
    assert bootstrap_ratio(accepted, steps, seed=3) == bootstrap_ratio(accepted, steps, seed=3)  # reproducible
    assert all(math.isnan(x) for x in bootstrap_ratio([3.0], [2.0]))
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ratio(accepted, steps, confidence=1.5)


def test_identical_prompts_give_a_zero_width_interval():
    summary = bootstrap_summary(_steps({1: [2, 2], 2: [2, 2], 3: [2, 2]}), ["strategy"], min_steps=1)
    row = summary.iloc[0]
    assert row["tau"] == row["tau_low"] == row["tau_high"] == 3.0
    assert row["acceptance_rate_low"] == row["acceptance_rate_high"] == 0.5
    assert not row["small"]


def test_bootstrap_summary_marks_small_cells_and_keeps_the_point_estimates():
    steps = _steps({1: [0, 1, 2], 2: [4, 4, 3, 3], 3: [1, 1]})
    summary = bootstrap_summary(steps, ["strategy"], min_prompts=3, min_steps=10)
    row = summary.iloc[0]
    assert row["sequences"] == 3 and row["steps"] == 9
    assert row["tau"] == pytest.approx(1 + 19 / 9)
    assert row["tau_low"] < row["tau"] < row["tau_high"]
    assert bool(row["small"])  # 9 steps < 10
    one = bootstrap_summary(_steps({7: [1, 2, 3]}), ["strategy"])
    assert math.isnan(one.iloc[0]["tau_low"]) and bool(one.iloc[0]["small"])
    with pytest.raises(ValueError, match="cluster"):
        bootstrap_summary(steps.drop(columns="question_id"), ["strategy"])


def test_robust_range_ignores_small_cells_unless_all_are_small():
    values = pd.Series([2.0, 3.0, 16.0])
    assert robust_range(values, pd.Series([False, False, True])) == (2.0, 3.0)
    assert robust_range(values, pd.Series([True, True, True])) == (2.0, 16.0)


def test_calibration_of_a_perfectly_calibrated_source_is_near_zero():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0, 1, size=(20000, 1))
    hit = rng.uniform(0, 1, size=20000) < conf[:, 0]
    ranks = torch.tensor(np.where(hit, 0, 5))
    outcomes = candidate_outcomes(torch.tensor(conf, dtype=torch.float32), ranks, pair="p")
    bins = calibration_bins(outcomes, ["pair"], bins=10)
    assert bins["count"].sum() == 20000
    assert bins["share"].sum() == pytest.approx(1.0)
    assert expected_calibration_error(bins) < 0.03
    # an over-confident source: always 0.9 sure, right half the time
    over = candidate_outcomes(torch.full((1000, 1), 0.9), torch.tensor([0, 3] * 500))
    assert expected_calibration_error(calibration_bins(over)) == pytest.approx(0.4, abs=1e-6)


def test_candidate_outcomes_mark_the_target_token_rank():
    outcomes = candidate_outcomes(torch.tensor([[0.7, 0.2], [0.5, 0.4]]), torch.tensor([1, 9]), question_id=3)
    assert outcomes.columns[0] == "question_id"
    assert outcomes["accepted"].tolist() == [False, True, False, False]
    assert outcomes["rank"].tolist() == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="probs"):
        candidate_outcomes(torch.zeros(3), torch.zeros(3))


def test_oracle_depth_pays_rank_plus_one_per_level():
    assert oracle_depth([0, 1, 0, 0, 5], budget=4, limit=10) == (3, 4)
    assert oracle_depth([0, 0, 0], budget=8, limit=2) == (2, 2)
    assert oracle_depth([0, 64, 0], budget=10, limit=5, max_rank=64) == (1, 1)
    assert oracle_depth([3], budget=3, limit=5) == (0, 0)


def _reference(n: int) -> GenerationResult:
    return GenerationResult(prompt_ids=(1, 2), output_ids=tuple(range(10, 10 + n)), text="", steps=(), wall_s=0.0,
                            stop_reason="max_new_tokens", drafter="none", verifier="greedy", config=GREEDY,
                            max_new_tokens=n)


def test_oracle_bounds_every_rank_ordered_shape():
    gen = torch.Generator().manual_seed(0)
    ranks = torch.randint(0, 4, (40,), generator=gen) * (torch.rand(40, generator=gen) < 0.5)
    ref = _reference(40)
    oracle = replay_oracle(ranks, ref, 6)
    tau_oracle = sum(r.accepted + 1 for r in oracle) / len(oracle)
    assert sum(r.committed for r in oracle) == 40
    for shape in (chain(6), expansion([2, 2, 1]), expansion([3, 1, 1])):
        records = replay_shape(shape, ranks, ref)
        assert sum(r.accepted + 1 for r in records) / len(records) <= tau_oracle + 1e-9
    # an all-top-1 continuation: the oracle accepts budget tokens every step
    full = replay_oracle(torch.zeros(40, dtype=torch.long), ref, 4)
    assert [r.accepted for r in full] == [4] * 8


def test_draft_candidates_match_draft_ranks_on_the_tiny_pair():
    pair = tiny_pair()
    prompt, cont = [1, 5, 9, 3], [7, 2, 11, 4, 8]
    probs, ranks = draft_candidates(pair.draft, prompt, cont, k=4)
    assert probs.shape == (5, 4)
    assert torch.equal(ranks, draft_ranks(pair.draft, prompt, cont))
    assert bool((probs[:, :-1] >= probs[:, 1:]).all())  # sorted candidates
    assert float(probs.sum(dim=1).max()) <= 1.0 + 1e-5


def test_budget_fill_counts_only_steps_with_room_for_the_whole_budget():
    from specviz.metrics import budget_fill

    records = [StepRecord(step=i, position=p, drafted=d, depth=2, accepted=0, extendable=True, committed=1)
               for i, (p, d) in enumerate([(0, 3), (1, 3), (8, 1)])]  # the last step was trimmed at the end
    steps = records_table(records, strategy="dyn", budget=4, question_id=1)
    table = budget_fill(steps, ["strategy"], max_new_tokens=10)
    row = table.iloc[0]
    assert row["eligible_steps"] == 2 and row["mean_drafted"] == 3.0 and row["fill"] == 0.75
    assert budget_fill(steps, ["strategy"]).iloc[0]["eligible_steps"] == 3  # no limit: every step counts
    assert math.isnan(budget_fill(steps, ["strategy"], max_new_tokens=3).iloc[0]["fill"])

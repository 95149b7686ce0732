"""End-to-end speed on this machine: what a step costs, and the speedup that predicts.

A speculative step costs the drafter's forwards plus one target forward over the tree;
plain decoding costs one target forward per token. With ``tau`` tokens committed per
step, the speedup a cost model predicts is

    speedup = tau * t_target(1) / (t_draft_step + t_target(N)),

with ``N`` the tree's nodes (root included). :func:`forward_cost_curve` measures
``t(n)``, the time of one forward of ``n`` new tokens after a fixed prefix, for the
target and the draft; :class:`CostModel` interpolates the curves;
:func:`tree_step_cost` prices one step of a static shape the way
:class:`~specviz.draft.model.TreeDrafter` runs it (one draft forward to catch up on the
bonus token, then one per level of nodes that have children);
:func:`sequoia_plan` scores Sequoia's optimal tree at every (budget, depth limit)
with it, which answers "which tree size is best on this hardware";
:func:`timed_run` measures one generation, plain or speculative;
:func:`compare_runs`, :func:`run_counts` and :func:`speed_summary` turn a table of timed
runs into what they counted, their speed and the speedup the cost model predicts.

Dimension legend: n = new tokens fed to one forward, N = tree nodes including the root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch

from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft.base import Drafter
from specviz.metrics.acceptance import acceptance_numbers, summarize_steps
from specviz.models.device import synchronize
from specviz.models.kvcache import crop_cache, forward_tokens, new_cache
from specviz.models.types import LoadedModel
from specviz.sampling import GREEDY, make_generator
from specviz.tree.sequoia import expected_tokens, sequoia_tree
from specviz.tree.core import children_lists
from specviz.tree.shapes import TreeShape
from specviz.validate import check_int, check_ints
from specviz.bench.attention import time_call

__all__ = [
    "forward_cost_curve",
    "interpolate",
    "CostModel",
    "StepCost",
    "tree_step_cost",
    "predicted_speedup",
    "predicted_wall_s",
    "sequoia_plan",
    "SpeedRun",
    "timed_run",
    "compare_runs",
    "run_counts",
    "speed_summary",
]


@torch.no_grad()
def forward_cost_curve(model: LoadedModel, sizes: Sequence[int], *, prefix_len: int = 200, warmup: int = 1,
                       repeats: int = 3, seed: int = 0, rows: int = 1) -> pd.DataFrame:
    """Time one forward of ``n`` new tokens after a ``prefix_len``-token KV cache, for each ``n``,
    in a batch of ``rows`` sequences (each feeding ``n`` tokens, as a batched step does).

    The new tokens attend causally to the cache and to each other, through an explicit mask
    as the engine's verification passes one (so the forward takes the engine's path,
    :func:`~specviz.models.kvcache.forward_tokens`' layer loop); a tree mask costs the
    same (the attention is one dense call either way, notebook 05), so this is the cost
    of verifying ``n`` tree nodes, or of drafting one level of ``n`` nodes.

    Args:
        model: the model to time.
        sizes: new-token counts, each >= 1.
        prefix_len: tokens already in the cache; 0 times a prefill of ``n`` prompt tokens
            into an empty cache.
        warmup, repeats: as in :func:`specviz.bench.attention.time_call` (one call per repeat).
        seed: seeds the random token ids.
        rows: sequences in the batch (:mod:`specviz.bench.serving` measures the target over
            rows x tokens).

    Returns:
        Columns ``model, dtype, threads, rows, n_tokens, prefix_len, median_ms, min_ms``.
    """
    sizes = check_ints("sizes", sizes)
    check_int("prefix_len", prefix_len, 0)
    check_int("rows", rows)
    gen = make_generator(seed)
    vocab = model.vocab_size
    cache = new_cache(model.model)
    if prefix_len:
        prefix = torch.randint(0, vocab, (rows, prefix_len), generator=gen)  # (R, P)
        forward_tokens(model.model, cache, prefix, torch.arange(prefix_len).repeat(rows, 1), None, logits_to_keep=1)
    table = []
    for n in sizes:
        ids = torch.randint(0, vocab, (rows, n), generator=gen)  # (R, n)
        pos = torch.arange(prefix_len, prefix_len + n).repeat(rows, 1)  # (R, n)
        # causal over cache + new tokens; a prefill (no cache) and one token need no mask
        allowed = None
        if prefix_len and n > 1:
            allowed = torch.ones(rows, n, prefix_len + n, dtype=torch.bool).tril(prefix_len)  # (R, n, P + n)

        def step() -> None:
            # a prefill keeps only its last position's logits, as the engine's does
            forward_tokens(model.model, cache, ids, pos, allowed, **({} if prefix_len else {"logits_to_keep": 1}))
            synchronize(model.device)
            crop_cache(cache, prefix_len)

        t = time_call(step, warmup=warmup, repeats=repeats, min_time_s=0.0)
        table.append({"model": model.name, "dtype": str(model.dtype).removeprefix("torch."),
                      "threads": torch.get_num_threads(), "rows": rows, "n_tokens": n, "prefix_len": prefix_len,
                      "median_ms": 1e3 * t.median_s, "min_ms": 1e3 * t.min_s})
    return pd.DataFrame(table)


def interpolate(points: Sequence[tuple[float, float]], n: float) -> float:
    """Piecewise-linear through ``points`` (``(x, y)``, increasing ``x``), extended linearly
    beyond the ends (never below 0)."""
    if len(points) == 1:
        return points[0][1]
    i = next((j for j in range(1, len(points)) if n <= points[j][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (n - x0) * (y1 - y0) / (x1 - x0))


@dataclass(frozen=True)
class CostModel:
    """Forward times of the target and the draft as functions of the tokens fed.

    Attributes:
        target_ms: ``((n, ms), ...)`` measured points of the target, increasing ``n``.
        draft_ms: the same for the draft model.
    """

    target_ms: tuple[tuple[int, float], ...]
    draft_ms: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        for name in ("target_ms", "draft_ms"):
            points = tuple((int(n), float(ms)) for n, ms in getattr(self, name))
            if not points or [n for n, _ in points] != sorted({n for n, _ in points}):
                raise ValueError(f"{name} must list (n, ms) points with distinct increasing n, got {points}")
            object.__setattr__(self, name, points)

    @classmethod
    def from_curves(cls, target: pd.DataFrame, draft: pd.DataFrame, column: str = "min_ms") -> "CostModel":
        """From two :func:`forward_cost_curve` tables (``column``: ``min_ms``, the steadier
        estimate on a busy machine, or ``median_ms``)."""
        def points(df: pd.DataFrame) -> tuple[tuple[int, float], ...]:
            df = df.sort_values("n_tokens")
            return tuple(zip(df["n_tokens"].astype(int).tolist(), df[column].astype(float).tolist()))
        return cls(points(target), points(draft))

    def target_s(self, n: float) -> float:
        """Seconds for one target forward of ``n`` tokens (linear between measured points)."""
        return 1e-3 * interpolate(self.target_ms, n)

    def draft_s(self, n: float) -> float:
        """Seconds for one draft forward of ``n`` tokens."""
        return 1e-3 * interpolate(self.draft_ms, n)


@dataclass(frozen=True)
class StepCost:
    """Predicted cost of one speculative step.

    Attributes:
        draft_s: the drafter's forwards.
        verify_s: the target forward over the tree (root included).
        draft_forwards: number of draft forwards.
    """

    draft_s: float
    verify_s: float
    draft_forwards: int

    @property
    def step_s(self) -> float:
        return self.draft_s + self.verify_s


def tree_step_cost(shape: TreeShape, costs: CostModel) -> StepCost:
    """Cost of one step of ``TreeDrafter(draft, shape)``: one draft forward of the bonus
    token, one per depth level holding nodes with children (those nodes in one batch),
    and one target forward of the whole tree."""
    if not isinstance(shape, TreeShape):
        raise TypeError(f"shape must be a TreeShape, got {type(shape).__name__}")
    children = children_lists(shape)
    fed: dict[int, int] = {}
    for i, d in enumerate(shape.depths()):
        if i > 0 and children[i]:
            fed[d] = fed.get(d, 0) + 1
    draft = costs.draft_s(1) + sum(costs.draft_s(n) for n in fed.values())
    return StepCost(draft, costs.target_s(shape.n_nodes), 1 + len(fed))


def predicted_speedup(tau: float, step_s: float, costs: CostModel) -> float:
    """``tau * t_target(1) / step_s``: plain decoding's time for ``tau`` tokens over one
    speculative step's (``step_s`` = draft + verify seconds, e.g. :attr:`StepCost.step_s`)."""
    return tau * costs.target_s(1) / step_s if step_s > 0 else math.nan


def predicted_wall_s(rows: pd.DataFrame, costs: CostModel, prefill_ms: Sequence[tuple[int, float]]) -> pd.Series:
    """The wall time the cost model gives each benchmark row (``python -m specviz.bench``'s
    CSV) of a specviz strategy: the target's prefill of the prompt, plus the row's measured
    draft time, plus one target forward per step over the step's mean tree size.

    ``prefill = t_prefill(prompt_tokens - 1)`` (the engine feeds the prompt's last token
    with the first tree), ``verify = steps * t_target(1 + drafted / steps)``. What the
    model leaves out (the verification rule, cache bookkeeping, Python between forwards)
    is what the measured time has more.

    Args:
        rows: benchmark rows (``prompt_tokens, steps, drafted, draft_s``).
        costs: the target's cost curve (:meth:`CostModel.from_curves`; the draft's is not used).
        prefill_ms: ``(prompt tokens, ms)`` points of the target's prefill
            (:func:`forward_cost_curve` with ``prefix_len=0``), increasing.

    Returns:
        Seconds per row, aligned with ``rows``; NaN where the row has no step timings
        (transformers' and llama.cpp's peers, the baselines).
    """
    points = tuple((int(n), float(ms)) for n, ms in prefill_ms)
    if not points or [n for n, _ in points] != sorted({n for n, _ in points}):
        raise ValueError(f"prefill_ms must list (n, ms) points with distinct increasing n, got {points}")
    out = []
    for p, steps, drafted, draft in zip(rows["prompt_tokens"], rows["steps"], rows["drafted"], rows["draft_s"]):
        if not (steps > 0 and draft == draft):  # no steps or no measured draft time (NaN)
            out.append(math.nan)
            continue
        prefill = 1e-3 * interpolate(points, max(int(p) - 1, 1))
        out.append(prefill + float(draft) + float(steps) * costs.target_s(1 + float(drafted) / float(steps)))
    return pd.Series(out, index=rows.index, dtype=float)


def sequoia_plan(acceptance: Sequence[float], budgets: Sequence[int], max_depths: Sequence[int],
                 costs: CostModel) -> pd.DataFrame:
    """Sequoia's optimal tree for every (budget, depth limit), priced on this machine.

    Returns:
        One row per feasible pair: ``budget, max_depth, depth, draft_forwards,
        expected_tau`` (positional model), ``draft_ms, verify_ms, step_ms``,
        ``ms_per_token`` (step / tau) and ``predicted_speedup``; sorted by
        ``ms_per_token`` (best first).
    """
    k = len(acceptance)
    rows = []
    for n in budgets:
        for d in max_depths:
            if sum(k ** j for j in range(1, d + 1)) < n:
                continue
            shape = sequoia_tree(acceptance, n, d).shape
            tau = expected_tokens(shape, acceptance)
            cost = tree_step_cost(shape, costs)
            rows.append({"budget": n, "max_depth": d, "depth": shape.depth, "draft_forwards": cost.draft_forwards,
                         "expected_tau": tau, "draft_ms": 1e3 * cost.draft_s, "verify_ms": 1e3 * cost.verify_s,
                         "step_ms": 1e3 * cost.step_s, "ms_per_token": 1e3 * cost.step_s / tau,
                         "predicted_speedup": predicted_speedup(tau, cost.step_s, costs)})
    if not rows:
        raise ValueError(f"no budget in {list(budgets)} fits any depth limit in {list(max_depths)}")
    return pd.DataFrame(rows).sort_values(["ms_per_token", "budget"], kind="stable").reset_index(drop=True)


@dataclass(frozen=True)
class SpeedRun:
    """One timed greedy generation.

    Attributes:
        method: a label.
        new_tokens: tokens generated.
        wall_s: wall time of the call (prefill included).
        steps: target calls after the prefill (plain decoding: one per token).
        drafted: draft tokens proposed.
        accepted: draft tokens accepted.
        draft_s: time spent drafting (0 for plain decoding).
        verify_s: time spent in target forwards over trees (0 for plain decoding).
        mean_nodes: mean tokens the target processed per step: tree nodes, root included, plus
            any side branch (lookahead's window); 1 for plain decoding.
        output_ids: the generated ids.
    """

    method: str
    new_tokens: int
    wall_s: float
    steps: int
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    mean_nodes: float
    output_ids: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def tau(self) -> float:
        """Tokens committed per target call."""
        return self.new_tokens / self.steps if self.steps else math.nan


def timed_run(target: LoadedModel, drafter: Drafter | None, prompt: str | Sequence[int], *, max_new_tokens: int,
              method: str | None = None) -> SpeedRun:
    """One greedy generation, timed: plain decoding when ``drafter`` is None, otherwise
    :func:`~specviz.decode.speculative_generate` with the greedy verifier (``analyze``
    off, so no time goes to analysis)."""
    if drafter is None:
        r = plain_generate(target, prompt, max_new_tokens=max_new_tokens, config=GREEDY)
        return SpeedRun(method or "plain", r.n_new_tokens, r.wall_s, r.n_new_tokens, 0, 0, 0.0, 0.0, 1.0,
                        r.output_ids)
    r = speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, config=GREEDY,
                             verifier="greedy", analyze=False)
    stats = summarize_steps(r.steps, new_tokens=r.n_new_tokens)
    return SpeedRun(
        method or drafter.name, r.n_new_tokens, r.wall_s, stats.n_steps, stats.drafted_tokens,
        stats.accepted_tokens, stats.draft_time_s, stats.verify_time_s,
        sum(s.fed_tokens for s in r.steps) / max(1, stats.n_steps), r.output_ids)


_RUN_COLUMNS = ("method", "question_id", "new_tokens", "wall_s", "steps", "drafted", "accepted", "draft_s",
                "verify_s", "mean_nodes", "output_ids")


def compare_runs(runs: pd.DataFrame, baseline: str = "plain") -> pd.DataFrame:
    """Timed runs (one row per :class:`SpeedRun` of a method on a prompt, with
    ``question_id``) compared with the ``baseline`` method's run of the same prompt.

    Returns:
        A copy with ``matches_plain`` (same output ids as the baseline), ``tokens_per_s``
        (new tokens / wall time) and ``speedup`` (over the baseline's tokens/s) added.

    Raises:
        ValueError: if a column is missing or a prompt has no baseline run.
    """
    missing = [c for c in _RUN_COLUMNS if c not in runs.columns]
    if missing:
        raise ValueError(f"the runs table lacks columns {missing}")
    plain = runs[runs["method"] == baseline]
    lacking = sorted(set(runs["question_id"]) - set(plain["question_id"]))
    if lacking:
        raise ValueError(f"no {baseline!r} run for question ids {lacking}")
    plain_ids = dict(zip(plain["question_id"], plain["output_ids"]))
    out = runs.copy()
    out["matches_plain"] = [r.output_ids == plain_ids[r.question_id] for r in out.itertuples()]
    out["tokens_per_s"] = out["new_tokens"] / out["wall_s"]
    plain_tps = out[out["method"] == baseline].set_index("question_id")["tokens_per_s"]
    out["speedup"] = out["tokens_per_s"] / out["question_id"].map(plain_tps)
    return out


def run_counts(runs: pd.DataFrame) -> pd.DataFrame:
    """What each method counted over its runs (a :func:`compare_runs` table), nothing timed.

    Returns:
        One row per method, in order of first appearance: ``method, prompts, new_tokens,
        steps, tau`` (new tokens per target call, as the output realises it), ``drafted,
        accepted, acceptance_rate`` (:func:`specviz.metrics.acceptance_numbers`) and
        ``matches_plain`` (share of prompts whose output equals the baseline's).
    """
    counts = runs.groupby("method", sort=False).agg(
        prompts=("question_id", "size"), new_tokens=("new_tokens", "sum"), steps=("steps", "sum"),
        drafted=("drafted", "sum"), accepted=("accepted", "sum"), matches_plain=("matches_plain", "mean")).reset_index()
    counts["tau"] = counts["new_tokens"] / counts["steps"]
    counts["acceptance_rate"] = pd.Series(
        [acceptance_numbers(int(d), int(a), int(n))[0]
         for d, a, n in zip(counts["drafted"], counts["accepted"], counts["steps"])], index=counts.index, dtype=float)
    return counts[["method", "prompts", "new_tokens", "steps", "tau", "drafted", "accepted", "acceptance_rate",
                   "matches_plain"]]


def speed_summary(runs: pd.DataFrame, costs: CostModel, baseline: str = "plain") -> pd.DataFrame:
    """Measured and predicted speed of each method (a :func:`compare_runs` table).

    Returns:
        One row per method, in order of first appearance: ``method, tokens_per_s,
        speedup`` (means over prompts), ``new_tokens, steps, draft_s, verify_s`` (sums),
        ``mean_nodes`` (mean), ``tau`` (new tokens per step), ``draft_ms, verify_ms``
        (per step), ``verify_curve_ms`` (the target's cost curve at ``mean_nodes``) and
        ``predicted`` (:func:`predicted_speedup` with the run's tau and draft time per
        step and the curve's verification time; 1 for the baseline).
    """
    speed = runs.groupby("method", sort=False).agg(
        tokens_per_s=("tokens_per_s", "mean"), speedup=("speedup", "mean"), new_tokens=("new_tokens", "sum"),
        steps=("steps", "sum"), draft_s=("draft_s", "sum"), verify_s=("verify_s", "sum"),
        mean_nodes=("mean_nodes", "mean")).reset_index()
    speed["tau"] = speed["new_tokens"] / speed["steps"]
    speed["draft_ms"] = 1e3 * speed["draft_s"] / speed["steps"]
    speed["verify_ms"] = 1e3 * speed["verify_s"] / speed["steps"]
    speed["verify_curve_ms"] = [1e3 * costs.target_s(n) for n in speed["mean_nodes"]]
    speed["predicted"] = [predicted_speedup(tau, d / 1e3 + costs.target_s(n), costs) if m != baseline else 1.0
                          for m, tau, d, n in zip(speed["method"], speed["tau"], speed["draft_ms"], speed["mean_nodes"])]
    return speed

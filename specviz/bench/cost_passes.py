"""The target's measured costs beside a benchmark CSV (``<out>.costs.csv``): its cost curve
and prefills timed before the rounds and once more after each round, and the cost model's
predicted wall time of the rows from them (:mod:`specviz.bench.cost` holds the model)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

__all__ = ["CURVE_SIZES", "CURVE_PREFIX", "BEFORE_ROUNDS", "costs_path", "append_costs", "measure_costs", "measure_round_costs", "predicted_wall", "curve_spread"]


#: tree sizes (nodes, root included) of the target's cost curve the predictions interpolate
CURVE_SIZES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
#: tokens in the cache before each forward of the curve
CURVE_PREFIX = 200


def costs_path(out: Path) -> Path:
    """Where a benchmark CSV keeps the target's measured costs (resumed with it)."""
    return out.with_name(out.stem + ".costs.csv")


#: the ``pass`` of the costs timed before the rounds (each round's pass is named after it)
BEFORE_ROUNDS = "before"


def append_costs(pair, todo, path: Path, label: str) -> None:
    """Time ``todo`` = ``[(prefix_len, sizes, warmup, repeats), ...]`` of the target with
    :func:`~specviz.bench.cost.forward_cost_curve` and append the rows to ``path``, with
    ``pass`` = ``label``."""
    from specviz.bench.cost import forward_cost_curve

    for prefix, sizes, warmup, repeats in todo:
        if not sizes:
            continue
        # one row per forward, as every costs file has been: the ``rows`` column stays out
        part = forward_cost_curve(pair.target, sizes, prefix_len=prefix, warmup=warmup, repeats=repeats)
        part = part.drop(columns="rows").assign(**{"pass": label})
        if path.exists() and path.stat().st_size:
            have = pd.read_csv(path, nrows=0).columns
            if list(have) != list(part.columns):  # a file begun before passes were recorded: one pass, before
                pd.concat([pd.read_csv(path).assign(**{"pass": BEFORE_ROUNDS}), part]).to_csv(path, index=False)
                continue
        part.to_csv(path, mode="a", header=not (path.exists() and path.stat().st_size), index=False)


def measure_costs(pair, lengths: Sequence[int], path: Path) -> None:
    """Time the target's cost curve (:data:`CURVE_SIZES` after :data:`CURVE_PREFIX` tokens)
    and its prefill of each prompt length in ``lengths`` that ``path`` does not hold yet
    for this target and thread count; append them to ``path``."""
    have = pd.read_csv(path) if path.exists() and path.stat().st_size else pd.DataFrame(
        columns=["model", "threads", "n_tokens", "prefix_len"])
    mine = have[(have["model"] == pair.target.name) & (have["threads"] == torch.get_num_threads())]
    done = set(zip(mine["prefix_len"].astype(int), mine["n_tokens"].astype(int)))
    todo = [(CURVE_PREFIX, [n for n in CURVE_SIZES if (CURVE_PREFIX, n) not in done], 1, 3),
            (0, sorted({n for n in lengths if (0, n) not in done}), 1, 2)]
    t0 = time.perf_counter()
    append_costs(pair, todo, path, BEFORE_ROUNDS)
    if any(sizes for _, sizes, *_ in todo):
        print(f"cost model: the target's forward at {len(todo[0][1])} tree sizes and its prefill of "
              f"{len(todo[1][1])} prompt lengths timed in {time.perf_counter() - t0:.1f}s -> {path}")


def measure_round_costs(pair, prompt_len: int, path: Path, label: str) -> float:
    """One more pass of the target's cost curve and of the prefill of the round's prompt
    (``prompt_len`` tokens), right after the round's runs: each size timed once after one
    untimed forward of it; seconds taken.

    The curve timed before the rounds alone can miss how fast the machine runs during
    them (on a shared 2-core machine its one-token forward has measured 13% faster and
    32% slower than the rounds' own decoding steps); the passes spread over the rounds share
    the rounds' conditions, and the cost model takes the median of all passes. (Without
    the untimed forward, the first forwards after the curve's prefill measured up to
    54% slower than the rounds' decoding steps.)"""
    t0 = time.perf_counter()
    append_costs(pair, [(CURVE_PREFIX, list(CURVE_SIZES), 1, 1), (0, [prompt_len], 1, 1)], path, label)
    return time.perf_counter() - t0


def predicted_wall(rows: pd.DataFrame, path: Path) -> pd.Series | None:
    """The cost model's wall time of every row (:func:`specviz.bench.cost.predicted_wall_s`)
    from the costs in ``path``; None when they are missing or do not cover the rows."""
    from specviz.bench.cost import CostModel, predicted_wall_s

    costs = _costs_of(rows, path)
    if costs is None:
        return None
    # every pass (before the rounds and after each one): the median per size
    curve = costs[costs["prefix_len"] > 0].groupby("n_tokens", as_index=False)["median_ms"].median()
    prefill = costs[costs["prefix_len"] == 0].groupby("n_tokens", as_index=False)["median_ms"].median()
    if curve.empty or prefill.empty:
        return None
    model = CostModel.from_curves(curve, curve, column="median_ms")
    return predicted_wall_s(rows, model, list(zip(prefill["n_tokens"], prefill["median_ms"])))


def _costs_of(rows: pd.DataFrame, path: Path) -> pd.DataFrame | None:
    """The costs in ``path`` timed for ``rows``' target at their thread count (every pass);
    None when the file is missing or there are no rows."""
    if not path.exists() or rows.empty:
        return None
    costs = pd.read_csv(path)
    threads = set(rows["threads"].dropna().astype(int))
    return costs[costs["model"].isin(set(rows["target"])) & costs["threads"].isin(threads)]


def curve_spread(rows: pd.DataFrame, path: Path) -> str:
    """How much the passes of the target's one-token forward varied (the machine's noise
    during the run), e.g. ``"one-token forward 83 ms, 73-105 over 8 passes"``; "" with
    fewer than two passes."""
    costs = _costs_of(rows, path)
    if costs is None:
        return ""
    one = costs[(costs["prefix_len"] > 0) & (costs["n_tokens"] == 1)]["median_ms"]
    if len(one) < 2:
        return ""
    return f"one-token forward {one.median():.0f} ms, {one.min():.0f}-{one.max():.0f} over {len(one)} passes"

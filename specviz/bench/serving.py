"""Speculation beyond one stream: speed over batch size, the batched cost model, memory.

A server decodes many requests at once. One-token decoding of ``B`` rows reads the weights
once for all of them, so where a forward is bound by the bytes of weights it reads, plain
decoding's throughput grows with ``B``. Verifying ``N`` draft nodes per row feeds ``B x N``
tokens, and that forward stops being cheap as soon as it is bound by compute. Speculation's
speedup therefore falls as the batch grows and, at some batch size, drops below 1: the
crossover.

* :func:`timed_batch_run` - one batch of prompts decoded together (plain decoding or a
  strategy), timed: each row's tau, the time split into drafting, the target's forwards and
  the rest, the shape of every batched step and the run's peak memory (:class:`PeakMemory`);
* :class:`BatchCostModel` - forward time over (rows x tokens fed per row) for the target and
  the draft, measured (:func:`~specviz.bench.cost.forward_cost_curve` with ``rows``) or a
  roofline of another device's bandwidth and FLOP/s (:meth:`BatchCostModel.roofline`);
* :func:`predicted_batch_speedup` - a measured run's steps priced by the cost model against
  plain decoding of the same batch; :func:`modeled_speedup` - a strategy's per-step
  numbers priced at any batch size, on this machine's or another device's cost model;
* :func:`chain_budget` - the chain length per row that a batch size's cost curve pays for;
* :func:`crossover_batch`, :func:`crossover_interval` - the batch size where a strategy's
  speedup falls to 1, and its bootstrap interval over repeated timings;
* :func:`model_bytes`, :func:`drafter_bytes`, :func:`kv_bytes_per_token` - memory;
  :func:`decode_bytes` - the weight bytes one decoding step reads.

Dimension legend: B = rows in the batch, n = new tokens fed per row, N = tree nodes incl. root.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from specviz.bench.cost import CostModel, interpolate
from specviz.decode.engine import speculative_generate, speculative_generate_batch
from specviz.decode.plain import plain_generate_batch
from specviz.draft.base import Drafter
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.types import LoadedModel
from specviz.sampling import GREEDY
from specviz.validate import check_int, check_ints

__all__ = [
    "PeakMemory",
    "BatchRun",
    "timed_batch_run",
    "BatchCostModel",
    "predicted_batch_speedup",
    "modeled_speedup",
    "chain_budget",
    "depth_acceptance",
    "crossover_batch",
    "crossover_interval",
    "model_bytes",
    "decode_bytes",
    "drafter_bytes",
    "kv_bytes_per_token",
]


def _trim_free_memory() -> None:
    """Return glibc's free heap memory to the system (Linux; nothing elsewhere)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PeakMemory:
    """Peak memory while the ``with`` block runs, above what was in use when it began.

    On CUDA, PyTorch's peak allocated bytes (:func:`torch.cuda.max_memory_allocated`); on
    any other device the process's resident set size, sampled every ``interval_s`` by a
    thread (psutil), which sees every allocation, PyTorch's, the libraries' and Python's.
    Resident memory only grows by pages the allocator did not hold already, so on Linux the
    block first hands glibc's free memory back to the system (``malloc_trim``); elsewhere
    memory freed by earlier work and reused is not counted.

    Attributes (after the block): ``peak_bytes`` and ``kind`` (``"cuda"`` or ``"rss"``).
    """

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.002) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.kind = "cuda" if self.device.type == "cuda" else "rss"

    def __enter__(self) -> "PeakMemory":
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        import psutil

        _trim_free_memory()
        process = psutil.Process()
        self._base = self._peak = process.memory_info().rss
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.is_set():
                self._peak = max(self._peak, process.memory_info().rss)
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        self._stop.set()
        self._thread.join()
        import psutil

        self._peak = max(self._peak, psutil.Process().memory_info().rss)
        self.peak_bytes = max(0, self._peak - self._base)


@dataclass(frozen=True)
class BatchRun:
    """One batch of prompts decoded together, greedy, timed.

    Attributes:
        method: a label (``plain`` for plain decoding).
        rows: prompts in the batch.
        wall_s: wall time of the call, prefill included.
        new_tokens: tokens each row generated.
        steps: target calls each row took part in after the prefill (plain decoding: its
            tokens, the first one coming from the prefill).
        draft_s: time spent drafting, all rows together (0 for plain decoding).
        forward_s: time of the target's forwards over the trees (NaN for plain decoding,
            whose loop is not split).
        shape: per batched step, ``(rows still decoding, tokens fed per row)``: the padded
            tree (plus any side branch) of the largest row; ``1`` for plain decoding.
        step_draft_s: drafting time of each batched step.
        accepted: per row, the draft tokens accepted at each of its steps.
        drafted: per row, the draft tokens proposed at each of its steps (the longest path's
            depth, which bounds what a step can accept).
        output_ids: each row's generated ids.
        peak_bytes: peak memory of the call above what was in use before it
            (:class:`PeakMemory`); ``memory`` says which kind.
    """

    method: str
    rows: int
    wall_s: float
    new_tokens: tuple[int, ...]
    steps: tuple[int, ...]
    draft_s: float
    forward_s: float
    shape: tuple[tuple[int, int], ...]
    step_draft_s: tuple[float, ...]
    accepted: tuple[tuple[int, ...], ...]
    drafted: tuple[tuple[int, ...], ...]
    output_ids: tuple[tuple[int, ...], ...]
    peak_bytes: int
    memory: str

    @property
    def tokens_per_s(self) -> float:
        """Tokens of the whole batch per second of wall time."""
        return sum(self.new_tokens) / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def taus(self) -> tuple[float, ...]:
        """Each row's tokens per target call."""
        return tuple(t / s if s else math.nan for t, s in zip(self.new_tokens, self.steps))

    @property
    def tau(self) -> float:
        """The batch's tokens per row per target call (all rows' tokens over all their steps)."""
        return sum(self.new_tokens) / sum(self.steps) if sum(self.steps) else math.nan

    @property
    def other_s(self) -> float:
        """Wall time outside drafting and the target's tree forwards: prefill, verification
        rule, committing, moving the cache (NaN for plain decoding)."""
        return self.wall_s - self.draft_s - self.forward_s


def timed_batch_run(target: LoadedModel, drafter: Drafter | None, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int, method: str | None = None) -> BatchRun:
    """Decode ``prompts`` (token ids) as one batch, greedy, timed and with peak memory:
    :func:`~specviz.decode.plain.plain_generate_batch` when ``drafter`` is None (every
    prompt in one batch), else :func:`~specviz.decode.speculative_generate_batch` with
    the greedy verifier and no analysis (one prompt: :func:`~specviz.decode.speculative_generate`
    on ``drafter`` itself, which then holds what the run built). Both stop a row at
    end-of-sequence."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        raise ValueError("timed_batch_run needs at least one prompt")
    check_int("max_new_tokens", max_new_tokens)
    with PeakMemory(target.device) as memory:
        start = time.perf_counter()
        if drafter is None:
            results = plain_generate_batch(target, prompts, max_new_tokens=max_new_tokens,
                                           batch_size=len(prompts), config=GREEDY)
        else:  # one row runs on ``drafter`` itself, so drafter_bytes sees what the run built
            decode = speculative_generate_batch if len(prompts) > 1 else (
                lambda t, d, p, **kw: [speculative_generate(t, d, p[0], **kw)])
            results = decode(target, drafter, prompts, max_new_tokens=max_new_tokens, config=GREEDY,
                             verifier="greedy", analyze=False)
        wall = time.perf_counter() - start
    new = tuple(r.n_new_tokens for r in results)
    outputs = tuple(tuple(r.output_ids) for r in results)
    if drafter is None:
        shape = tuple((sum(n > s for n in new), 1) for s in range(1, max(new)))
        return BatchRun(method or "plain", len(prompts), wall, new, new, 0.0, math.nan, shape,
                        (0.0,) * len(shape), ((),) * len(new), ((),) * len(new), outputs, memory.peak_bytes,
                        memory.kind)
    n_steps = max(len(r.steps) for r in results)
    shape, step_draft, forward = [], [], 0.0
    for s in range(n_steps):
        traces = [r.steps[s] for r in results if len(r.steps) > s]
        shape.append((len(traces), max(t.fed_tokens for t in traces)))
        step_draft.append(traces[0].draft_time_s)  # shared by the rows of the step
        forward += traces[0].verify_time_s
    accepted = tuple(tuple(len(t.acceptance.accepted_nodes) for t in r.steps) for r in results)
    drafted = tuple(tuple(int(t.tree.depth) for t in r.steps) for r in results)
    return BatchRun(method or drafter.name, len(prompts), wall, new, tuple(len(r.steps) for r in results),
                    sum(step_draft), forward, tuple(shape), tuple(step_draft), accepted, drafted, outputs,
                    memory.peak_bytes, memory.kind)


def _points(df: pd.DataFrame, column: str) -> tuple[tuple[int, int, float], ...]:
    rows = df["rows"] if "rows" in df.columns else pd.Series(1, index=df.index)
    return tuple(sorted(zip(rows.astype(int), df["n_tokens"].astype(int), df[column].astype(float))))


@dataclass(frozen=True)
class BatchCostModel:
    """Forward times of the target and the draft over (rows, tokens fed per row).

    Between measured points the time is linear in the tokens per row at each measured row
    count, then linear in the rows; beyond the largest measured batch it extends the last
    two batch sizes' line.

    Attributes:
        target_ms: ``((rows, n, ms), ...)`` points of the target.
        draft_ms: the same for the draft model.
        source: where the points come from (``measured``, or the roofline's parameters).
    """

    target_ms: tuple[tuple[int, int, float], ...]
    draft_ms: tuple[tuple[int, int, float], ...]
    source: str = "measured"

    def __post_init__(self) -> None:
        for name in ("target_ms", "draft_ms"):
            points = tuple(sorted((int(r), int(n), float(ms)) for r, n, ms in getattr(self, name)))
            if not points or len({(r, n) for r, n, _ in points}) != len(points):
                raise ValueError(f"{name} must list distinct (rows, n, ms) points, got {points[:6]}")
            object.__setattr__(self, name, points)

    @classmethod
    def from_curves(cls, target: pd.DataFrame, draft: pd.DataFrame, column: str = "min_ms") -> "BatchCostModel":
        """From :func:`~specviz.bench.cost.forward_cost_curve` tables (a table without a
        ``rows`` column is one row)."""
        return cls(_points(target, column), _points(draft, column))

    @classmethod
    def roofline(cls, *, bandwidth_gb_s: float, tflop_s: float, target_bytes: float, draft_bytes: float,
                 target_params: float, draft_params: float, rows: Sequence[int], sizes: Sequence[int],
                 overhead_ms: float = 0.0) -> "BatchCostModel":
        """A device that reads the weights once per forward at ``bandwidth_gb_s`` and
        multiplies at ``tflop_s`` (2 FLOP per weight per token), whichever takes longer,
        plus ``overhead_ms`` per forward: ``t(B, n) = max(bytes / bandwidth,
        2 * params * B * n / flops) + overhead``. It leaves out attention over the cache and
        every launch or Python cost that is not the fixed overhead: a model of another
        machine, for extrapolating a crossover, never a measurement."""
        for name, value in (("bandwidth_gb_s", bandwidth_gb_s), ("tflop_s", tflop_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        rows, sizes = check_ints("rows", rows), check_ints("sizes", sizes)

        def points(nbytes: float, params: float) -> tuple[tuple[int, int, float], ...]:
            return tuple((b, n, 1e3 * max(nbytes / (bandwidth_gb_s * 1e9), 2 * params * b * n / (tflop_s * 1e12))
                          + overhead_ms) for b in rows for n in sizes)

        source = f"roofline {bandwidth_gb_s:g} GB/s, {tflop_s:g} TFLOP/s, {overhead_ms:g} ms per forward"
        return cls(points(target_bytes, target_params), points(draft_bytes, draft_params), source)

    @staticmethod
    def _time(points: tuple[tuple[int, int, float], ...], rows: float, n: float) -> float:
        by_rows: dict[int, list[tuple[int, float]]] = {}
        for r, m, ms in points:
            by_rows.setdefault(r, []).append((m, ms))
        return 1e-3 * interpolate(tuple((r, interpolate(tuple(p), n)) for r, p in sorted(by_rows.items())), rows)

    def target_s(self, rows: float, n: float) -> float:
        """Seconds of one target forward of ``rows`` rows x ``n`` new tokens each."""
        return self._time(self.target_ms, rows, n)

    def draft_s(self, rows: float, n: float) -> float:
        """Seconds of one draft forward of ``rows`` rows x ``n`` new tokens each."""
        return self._time(self.draft_ms, rows, n)

    def at(self, rows: int) -> CostModel:
        """The single-stream :class:`~specviz.bench.cost.CostModel` of a ``rows``-row batch."""
        def curve(points: tuple[tuple[int, int, float], ...], time_of) -> tuple[tuple[int, float], ...]:
            return tuple((n, 1e3 * time_of(rows, n)) for n in sorted({n for _, n, _ in points}))
        return CostModel(curve(self.target_ms, self.target_s), curve(self.draft_ms, self.draft_s))


def _decode_s(run: BatchRun, costs: BatchCostModel, draft_scale=None) -> float:
    """The cost model's time for ``run``'s batched steps: its drafting (measured, or scaled
    by ``draft_scale(rows)``) plus one target forward of each step's shape."""
    total = 0.0
    for (rows, fed), draft in zip(run.shape, run.step_draft_s):
        total += (draft if draft_scale is None else draft * draft_scale(rows)) + costs.target_s(rows, fed)
    return total


def predicted_batch_speedup(plain: BatchRun, run: BatchRun, costs: BatchCostModel) -> float:
    """What the cost model predicts ``run`` gains over ``plain`` (the same prompts decoded
    plainly in one batch): both runs' target forwards priced by ``costs`` at each step's
    (rows, tokens fed per row), ``run``'s own measured drafting time, and what plain
    decoding spends outside its forwards (the prefill, sampling) taken from its measured
    wall time and added to both."""
    plain_decode = _decode_s(plain, costs)
    rest = max(0.0, plain.wall_s - plain_decode)
    return (rest + plain_decode) / (rest + _decode_s(run, costs))


def modeled_speedup(costs: BatchCostModel, rows: float, tau: float, fed: float, draft_forwards: float) -> float:
    """The speedup a cost model gives a strategy at ``rows`` rows from what one step of it
    does per row: commits ``tau`` tokens, feeds the target ``fed`` tokens and drafts the
    equivalent of ``draft_forwards`` one-token draft forwards (a run's drafting time over the
    measured one-token draft forward at its batch size):
    ``tau * t_target(rows, 1) / (draft_forwards * t_draft(rows, 1) + t_target(rows, fed))``.
    On another device's :class:`BatchCostModel` (:meth:`BatchCostModel.roofline`) it
    extrapolates, with the acceptance measured here: a model, labelled so wherever shown."""
    step = draft_forwards * costs.draft_s(rows, 1) + costs.target_s(rows, fed)
    return tau * costs.target_s(rows, 1) / step if step > 0 else math.nan


def depth_acceptance(runs: Sequence[BatchRun], max_depth: int) -> list[float]:
    """Per depth ``d`` up to ``max_depth``, the probability that a chain's ``d``-th draft token
    is accepted given the ones before it were, from the steps of ``runs`` that drafted at
    least ``d`` tokens; the list stops at the first depth no step reached (a chain of 2
    says nothing about a third token)."""
    check_int("max_depth", max_depth)
    reached, kept = np.zeros(max_depth), np.zeros(max_depth)
    for run in runs:
        for accepted, drafted in zip(run.accepted, run.drafted):
            for a, k in zip(accepted, drafted):
                for d in range(min(k, max_depth)):
                    if a >= d:  # the d previous draft tokens were accepted
                        reached[d] += 1
                        kept[d] += a > d
    depth = int(np.argmin(reached > 0)) if (reached == 0).any() else max_depth
    return [float(kept[d] / reached[d]) for d in range(depth)]


def chain_budget(acceptance: Sequence[float], costs: BatchCostModel, rows: int, max_k: int | None = None, *,
                 step_overhead_s: float = 0.0, plain_overhead_s: float = 0.0, draft_token_s: float | None = None) -> int:
    """The draft chain length per row (0: plain decoding) with the most expected tokens per
    second for a ``rows``-row batch:
    ``E(k) / (k * t_draft(rows, 1) + t_target(rows, k + 1) + step_overhead_s)``,
    ``E(k) = 1 + sum_{j<=k} prod_{i<=j} acceptance[i-1]`` (a chain drafts ``k`` one-token
    forwards per step and the target verifies ``k + 1`` tokens per row), against plain
    decoding's ``1 / (t_target(rows, 1) + plain_overhead_s)``.

    Args:
        acceptance: per depth, the chance a draft token is accepted given those before it
            were (:func:`depth_acceptance`); no chain longer than it is considered.
        max_k: the longest chain considered (default ``len(acceptance)``).
        step_overhead_s, plain_overhead_s: what a speculative step and a plain decoding step
            cost beyond the forwards at this batch size (the prefill spread over the steps,
            committing, moving caches), e.g. measured on runs of that batch size.
        draft_token_s: what drafting one token per row costs at this batch size, where it
            was measured (the engine's draft forwards also stack and split the rows' caches);
            default ``t_draft(rows, 1)``.
    """
    check_int("rows", rows)
    max_k = len(acceptance) if max_k is None else check_int("max_k", max_k)
    best_k, best = 0, 1.0 / (costs.target_s(rows, 1) + plain_overhead_s)
    expected, reach = 1.0, 1.0
    for k in range(1, min(max_k, len(acceptance)) + 1):
        reach *= float(acceptance[k - 1])
        expected += reach
        per_token = costs.draft_s(rows, 1) if draft_token_s is None else draft_token_s
        rate = expected / (k * per_token + costs.target_s(rows, k + 1) + step_overhead_s)
        if rate > best:
            best_k, best = k, rate
    return best_k


def crossover_batch(batches: Sequence[int], speedups: Sequence[float]) -> float:
    """The batch size where the speedup first falls below 1, interpolated in log2 of the
    batch between the last size at or above 1 and the first below; ``inf`` when it stays at
    or above 1 up to the largest size measured; 0 when it is below 1 from the smallest."""
    pairs = sorted(zip(map(int, batches), map(float, speedups)))
    if not pairs:
        raise ValueError("crossover_batch needs at least one batch size")
    if pairs[0][1] < 1.0:
        return 0.0
    for (b0, s0), (b1, s1) in zip(pairs, pairs[1:]):
        if s1 < 1.0:
            x0, x1 = math.log2(b0), math.log2(b1)
            return 2 ** (x0 + (s0 - 1.0) * (x1 - x0) / (s0 - s1))
    return math.inf


def crossover_interval(table: pd.DataFrame, *, n_resamples: int = 2000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float, float]:
    """:func:`crossover_batch` of the mean speedup per batch size, with a bootstrap interval:
    each resample draws, for every batch size independently, its repeated timings with
    replacement (``table``: columns ``batch, repeat, speedup`` of one strategy).

    Returns:
        ``(estimate, low, high)``; ``inf`` where the speedup stays above 1 throughout.
    """
    missing = {"batch", "repeat", "speedup"} - set(table.columns)
    if missing:
        raise ValueError(f"the table lacks columns {sorted(missing)}")
    groups = [(int(b), g["speedup"].to_numpy(float)) for b, g in table.groupby("batch")]
    estimate = crossover_batch([b for b, _ in groups], [v.mean() for _, v in groups])
    rng = np.random.default_rng(seed)
    samples = np.array([crossover_batch([b for b, _ in groups], [rng.choice(v, v.size).mean() for _, v in groups])
                        for _ in range(n_resamples)])
    tail = (1.0 - level) / 2
    return estimate, float(np.quantile(samples, tail)), float(np.quantile(samples, 1.0 - tail))


def _tensor_storages(obj: Any, seen: dict[int, int]) -> None:
    """Add the storages of ``obj``'s tensors (a module's parameters, buffers and tensor
    attributes, in every submodule) to ``seen`` (data pointer -> bytes)."""
    modules = obj.modules() if isinstance(obj, torch.nn.Module) else ()
    for module in modules:
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, (tuple, list)):
                tensors += [v for v in value if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()


def model_bytes(model: torch.nn.Module | LoadedModel) -> int:
    """Bytes of a model's weights: every distinct tensor storage its modules hold
    (parameters, buffers and packed tensors kept as attributes). A library's opaque packed
    copy (fbgemm's prepacked int8 weights) is not visible here; a run's peak resident
    memory (:class:`PeakMemory`) sees it."""
    seen: dict[int, int] = {}
    _tensor_storages(model.model if isinstance(model, LoadedModel) else model, seen)
    return sum(seen.values())


def decode_bytes(model: torch.nn.Module | LoadedModel) -> int:
    """Bytes of weights one decoding step reads: :func:`model_bytes` less the input
    embedding table, of which a step reads one row (it counts where the LM head shares its
    storage). A memory bandwidth over these bytes bounds plain decoding's tokens per second
    (:func:`~specviz.models.device.copy_bandwidth`)."""
    module = model.model if isinstance(model, LoadedModel) else model
    seen: dict[int, int] = {}
    _tensor_storages(module, seen)
    head: dict[int, int] = {}
    _tensor_storages(module.get_output_embeddings(), head)
    for t in module.get_input_embeddings().parameters():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in head:
            seen.pop(ptr, None)
    return sum(seen.values())


def _object_bytes(obj: Any, seen: set[int], storages: dict[int, int]) -> int:
    if id(obj) in seen or obj is None or isinstance(obj, (type, str, bytes, int, float, bool)):
        return 0
    seen.add(id(obj))
    if isinstance(obj, LoadedModel):
        _tensor_storages(obj.model, storages)
        return 0
    if isinstance(obj, torch.nn.Module):
        _tensor_storages(obj, storages)
        return 0
    if isinstance(obj, torch.Tensor):
        storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        return 0
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(_object_bytes(k, seen, storages) + _object_bytes(v, seen, storages) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        return size + sum(_object_bytes(v, seen, storages) for v in obj)
    if type(obj).__module__.startswith("specviz.") and hasattr(obj, "__dict__"):
        return size + _object_bytes(vars(obj), seen, storages)
    if type(obj).__module__.startswith("specviz.") and hasattr(obj, "__slots__"):
        return size + sum(_object_bytes(getattr(obj, s, None), seen, storages) for s in obj.__slots__)
    return size


def drafter_bytes(drafter: Drafter, target: LoadedModel) -> int:
    """Bytes a drafter holds beyond the target's weights: its draft model or heads (every
    tensor storage it reaches that the target does not own), its KV caches as they stand,
    and its Python structures (n-gram tables, tries, suffix trees, pools), walked through
    specviz's own objects and the containers they hold. Call it after a run to count what
    the run built."""
    storages: dict[int, int] = {}
    python = _object_bytes(drafter, set(), storages)
    owned: dict[int, int] = {}
    _tensor_storages(target.model, owned)
    return python + sum(b for ptr, b in storages.items() if ptr not in owned)


@torch.no_grad()
def kv_bytes_per_token(model: LoadedModel) -> int:
    """Bytes the KV cache holds per token of one row: keys and values of every layer, in
    the dtype the model caches them, measured on a two-token forward."""
    cache = new_cache(model.model)
    forward_tokens(model.model, cache, torch.zeros(1, 2, dtype=torch.long, device=model.device),
                   torch.arange(2, device=model.device)[None], None, logits_to_keep=1)
    total = sum(t.numel() * t.element_size() for layer in cache.layers if layer.keys is not None
                for t in (layer.keys, layer.values))
    return total // 2

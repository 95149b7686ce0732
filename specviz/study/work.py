"""Running the study's units of work: in this process, or as tasks on a Dask cluster.

A study notebook describes its model work as :class:`Unit` objects (an id and a
module-level function with its arguments) and hands them to :meth:`Work.run` with the
:class:`~specviz.data.store.ResultStore` they belong in. Units already in the store are
skipped; the others run

* in this process, one after the other, when the notebook has no scheduler address
  (the default: the study as it always ran), or
* as Dask tasks on the cluster at ``scheduler`` (``python -m specviz.study --workers N``
  starts a local one), collected as they finish.

Either way the results are written by this process, one atomic append per unit, so an
interrupted run keeps every finished unit and a later run (with any number of workers)
only computes what is missing. The models a unit needs are named by a picklable
:class:`ModelSpec` and loaded at most once per process (:func:`models_for`): a worker
loads the pair with its first unit and keeps it.

Timing units (``timing=True``) never run beside other units: they are submitted one at
a time to one worker (or run here), and their rows carry a ``machine`` column naming the
machine that measured them. Every unit's compute time is kept in the ``unit_times``
store of the run directory (:func:`scaling_estimate` predicts wall times from it).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import pandas as pd
import torch

from specviz.models.fused import DEFAULT_DRAFT_LAYERS, DRAFT_LAYERS
from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
from specviz.models.types import LoadedModel, ModelPair
from specviz.study.cluster import PROGRESS_FILE
from specviz.data.machine import machine_label
from specviz.data.store import ResultStore, atomic_write_text
from specviz.validate import check_choice

__all__ = ["ModelSpec", "Unit", "Work", "models_for", "draft_source", "scaling_estimate",
           "UNIT_TIMES"]

#: name of the store that keeps every unit's compute time
UNIT_TIMES = "unit_times"

_KINDS = ("builtin", "tiny")


@dataclass(frozen=True)
class ModelSpec:
    """The model pair units run on, by name, so that a worker can load it itself.

    Attributes:
        kind: ``"builtin"`` (the 0.5B/1.5B pair, or ``target``/``draft`` by name or
            path) or ``"tiny"`` (the random tiny pair of the tests, seeded by ``seed``).
        dtype: weight mode (``"fp32"``, ``"bf16"``, ...).
        target, draft: model names or paths for ``"builtin"``.
        seed: seed of the tiny pair.
        draft_dtype: the draft's weight mode when it differs from the target's (None:
            ``dtype``), e.g. ``"w4a8-token"`` for a 4-bit draft of a ``w8a8-token`` target.
        draft_layers: how a ``w4a8-token`` draft on the CPU runs its decoder layers
            (:data:`~specviz.models.fused.DRAFT_LAYERS`); other drafts ignore it.
    """

    kind: str = "builtin"
    dtype: str = "fp32"
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    seed: int = 0
    draft_dtype: str | None = None
    draft_layers: str = DEFAULT_DRAFT_LAYERS

    def __post_init__(self) -> None:
        check_choice("models", self.kind, _KINDS)
        check_choice("draft_layers", self.draft_layers, DRAFT_LAYERS)
        if self.draft_dtype == self.dtype:
            object.__setattr__(self, "draft_dtype", None)  # one spelling per pair: ids and caches agree

    @property
    def draft_mode(self) -> str:
        """The draft's weight mode."""
        return self.draft_dtype or self.dtype

    @property
    def draft_tag(self) -> str:
        """What the ids of units that run the draft add for it: ``""`` for a draft in the
        target's mode running as :func:`~specviz.models.loading.load_pair` runs it by default
        (the ids of earlier runs), else ``"+draft-<mode>"`` and, for a ``w4a8-token`` draft,
        ``"-<layers>"``."""
        w4 = self.draft_mode == "w4a8-token"  # the only mode whose layers may run otherwise
        if self.draft_dtype is None and (not w4 or self.draft_layers == DEFAULT_DRAFT_LAYERS):
            return ""
        return f"+draft-{self.draft_mode}" + (f"-{self.draft_layers}" if w4 else "")

    def load(self) -> ModelPair:
        """Load the pair (uncached; :func:`models_for` caches)."""
        from specviz.models.loading import load_pair
        from specviz.models.tiny import tiny_pair

        if self.kind == "tiny":
            return tiny_pair(seed=self.seed, dtype=self.dtype, draft_dtype=self.draft_dtype,
                             draft_layers=self.draft_layers)
        return load_pair(self.target, self.draft, dtype=self.dtype, draft_dtype=self.draft_dtype,
                         draft_layers=self.draft_layers)

    @property
    def labels(self) -> tuple[str, str]:
        """Short (draft, target) labels for tables: ``("0.5B", "1.5B")`` for the built-in pair."""
        if self.kind == "tiny":
            return "tiny draft", "tiny target"
        if (self.target, self.draft) == (DEFAULT_TARGET, DEFAULT_DRAFT):
            return "0.5B", "1.5B"
        return self.draft, self.target


_LOADED: dict[str, Any] = {"spec": None, "pair": None, "derived": {}}


def models_for(spec: ModelSpec) -> ModelPair:
    """The pair ``spec`` names, loaded once per process and kept until another spec is
    asked for (then the old pair is dropped first, so a process holds one pair)."""
    if _LOADED["spec"] != spec:
        _LOADED.update(spec=None, pair=None, derived={})
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # no per-worker loading bars in the study's terminal
        pair = spec.load()
        _LOADED.update(spec=spec, pair=pair)
    return _LOADED["pair"]


def draft_source(spec: ModelSpec, source: str) -> LoadedModel:
    """A draft model of the pair by name: ``"draft"`` (the pair's draft) or
    ``"self-L<n>"`` (the target's first n layers, :func:`~specviz.draft.self_spec.self_speculative_model`),
    built once per process."""
    pair = models_for(spec)
    if source == "draft":
        return pair.draft
    if source.startswith("self-L") and source[6:].isdigit():
        derived = _LOADED["derived"]
        if source not in derived:
            from specviz.draft.self_spec import self_speculative_model

            derived[source] = self_speculative_model(pair.target, int(source[6:]))
        return derived[source]
    raise ValueError(f"unknown draft source {source!r}; use 'draft' or 'self-L<layers>'")


@dataclass(frozen=True)
class Unit:
    """One unit of work: ``fn(spec, **kwargs)`` returns its rows (a mapping or a list of
    mappings of plain values); ``id`` is its key in the store.

    ``fn`` must be a module-level function (workers import it by name) and ``kwargs``
    plain data, tensors or other picklable objects.
    """

    id: str
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"a unit id is a non-empty string, got {self.id!r}")
        object.__setattr__(self, "kwargs", MappingProxyType(dict(self.kwargs)))


def execute_unit(spec: ModelSpec, unit: Unit, threads: int | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one unit in this process: its rows and ``{"seconds", "machine", "worker"}``."""
    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    rows = unit.fn(spec, **unit.kwargs)
    seconds = time.perf_counter() - start
    rows = [dict(rows)] if isinstance(rows, Mapping) else [dict(r) for r in rows]
    try:
        from distributed import get_worker

        worker = get_worker().address
    except (ImportError, ValueError):
        worker = f"pid {os.getpid()}"
    return rows, {"seconds": seconds, "machine": machine_label(), "worker": worker}


class Work:
    """Runs units for one notebook, here or on the Dask cluster at ``scheduler``.

    Args:
        models: the pair the units run on.
        scheduler: a Dask scheduler address (``tcp://host:port``); ``""`` or None runs
            every unit in this process.
        threads: torch threads each unit runs with (None: the process's setting).
        out_dir: the run directory (unit times go to its ``unit_times`` store); ``""`` or
            None keeps them in memory.
        progress: show a progress bar over the units of each :meth:`run` (the study
            pipeline draws its own in the terminal from ``partial/progress.json``).
    """

    def __init__(self, models: ModelSpec, *, scheduler: str | None = None, threads: int | None = None,
                 out_dir: str | os.PathLike | None = None, progress: bool = False) -> None:
        self.models = models
        self.threads = threads or None
        self.progress = progress
        self.times = ResultStore.open(out_dir, UNIT_TIMES)
        self._progress_file = None if self.times.path is None else self.times.path.parent / PROGRESS_FILE
        self.executed = 0  # units computed by this object (not read back from a store)
        self.client = None
        if scheduler:
            try:
                from distributed import Client
            except ImportError as err:  # pragma: no cover - distributed is a pinned dependency
                raise RuntimeError("a scheduler address needs the 'distributed' package") from err
            self.client = Client(scheduler)

    def __repr__(self) -> str:
        where = "this process" if self.client is None else self.client.scheduler.address
        return f"Work({self.models}, on {where})"

    @property
    def where(self) -> str:
        """Where units run, in words."""
        if self.client is None:
            return "in this process"
        n = len(self.client.scheduler_info(n_workers=-1)["workers"])
        return f"on the Dask cluster at {self.client.scheduler.address} ({n} workers)"

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def run(self, store: ResultStore, units: Iterable[Unit], *, label: str = "units",
            timing: bool = False) -> tuple[str, ...]:
        """Run every unit whose id is not in ``store`` and add its rows there.

        Args:
            store: the units' store.
            units: the units (ids must be distinct).
            label: the progress bar's description and the batch name in ``unit_times``.
            timing: run the units one at a time, nothing beside them, on one worker.

        Returns:
            The ids of ``units``, in order.
        """
        units = list(units)
        ids = [u.id for u in units]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"unit ids must be distinct; repeated: {dup[:3]}")
        todo = [u for u in units if u.id not in store]
        if not todo:
            return tuple(ids)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=label, disable=not self.progress, leave=False)
        self._report(label, 0, len(todo))
        try:
            for done, (unit, (rows, info)) in enumerate(self._results(todo, timing), 1):
                store.add(unit.id, rows)
                key = f"{store.path.stem if store.path else 'memory'}:{unit.id}"
                if key not in self.times:
                    self.times.add(key, {"batch": label, "timing": timing, **info})
                self.executed += 1
                bar.update()
                self._report(label, done, len(todo))
        finally:
            bar.close()
        return tuple(ids)

    def _report(self, label: str, done: int, total: int) -> None:
        if self._progress_file is not None:
            atomic_write_text(self._progress_file, json.dumps({"label": label, "done": done, "total": total}))

    def _results(self, todo: Sequence[Unit], timing: bool):
        if self.client is None:
            for unit in todo:
                yield unit, execute_unit(self.models, unit, self.threads)
            return
        from distributed import as_completed

        keys = [f"specviz-{uuid.uuid4().hex[:12]}" for _ in todo]
        if timing:
            workers = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
            for unit, key in zip(todo, keys):
                # One worker, one unit at a time: nothing runs beside a timing.
                future = self.client.submit(execute_unit, self.models, unit, self.threads, key=key,
                                            workers=workers[:1], allow_other_workers=True, pure=False)
                yield unit, future.result()
            return
        futures = self.client.map(execute_unit, [self.models] * len(todo), todo, [self.threads] * len(todo),
                                  key=keys, pure=False)
        by_key = {f.key: u for f, u in zip(futures, todo)}
        try:
            for future in as_completed(futures):
                yield by_key[future.key], future.result()
        finally:
            # On an error or an interruption, stop what is still queued; finished units are stored.
            self.client.cancel([f for f in futures if not f.done()])


def scaling_estimate(times: pd.DataFrame, workers: Sequence[int], *, load_s: float = 0.0) -> pd.DataFrame:
    """Predicted wall time of a run's units on ``workers`` workers, from their measured
    compute times (the ``unit_times`` store's frame).

    Each batch (one :meth:`Work.run` call) is a barrier: its units are scheduled longest
    first on the least-loaded worker; timing batches run one unit at a time whatever the
    number of workers. ``load_s`` adds a model load per worker and batch group.

    Returns:
        One row per worker count: ``workers, parallel_s, timing_s, load_s, predicted_s,
        speedup`` (over one worker).
    """
    if times.empty:
        raise ValueError("no unit times to estimate from")
    rows = []
    for n in workers:
        parallel = timing_s = 0.0
        for (_, is_timing), group in times.groupby(["batch", "timing"], sort=False):
            secs = sorted(group["seconds"].astype(float), reverse=True)
            if is_timing:
                timing_s += sum(secs)
                continue
            loads = [0.0] * n
            for s in secs:
                loads[loads.index(min(loads))] += s
            parallel += max(loads)
        rows.append({"workers": n, "parallel_s": parallel, "timing_s": timing_s, "load_s": load_s,
                     "predicted_s": parallel + timing_s + load_s})
    out = pd.DataFrame(rows)
    out["speedup"] = out["predicted_s"].iloc[0] / out["predicted_s"] if workers[0] == 1 else float("nan")
    return out

"""Where the study's units run: a local Dask cluster started for one study run, or an
existing cluster by address, plus a terminal progress bar over the units.

``python -m specviz.study --workers N`` starts a :class:`distributed.LocalCluster` of N
worker processes with one task slot each and ``cores // N`` torch threads, prints its
dashboard address, and passes its scheduler address to every notebook that declares a
``scheduler`` parameter; ``--scheduler ADDRESS`` passes an existing cluster's address
instead (the notebooks connect as clients, so their results are stored by this
machine's run directory).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Callable

from specviz.validate import check_int

__all__ = ["StudyCluster", "UnitProgress", "PROGRESS_FILE"]

#: file under a run's ``partial/`` directory where :class:`~specviz.study.work.Work`
#: reports how many units of its current batch are finished
PROGRESS_FILE = "progress.json"


class StudyCluster:
    """The Dask cluster of one study run: started here (``workers``) or existing
    (``scheduler``). Use as a context manager; a cluster started here is closed on exit.

    Args:
        workers: worker processes of a new local cluster.
        scheduler: address of an existing scheduler (``tcp://host:8786``).
        log: where the dashboard address and the worker layout are reported.
    """

    #: how long an existing scheduler has to answer before the run stops with an error
    connect_timeout = "10s"

    def __init__(self, *, workers: int | None = None, scheduler: str | None = None,
                 log: Callable[[str], None] = print) -> None:
        if (workers is None) == (not scheduler):
            raise ValueError("give either workers (a local cluster) or scheduler (an existing one)")
        self.workers = None if workers is None else check_int("workers", workers)
        self.scheduler = scheduler or None
        self.log = log
        self.cluster = None
        self.client = None
        self.used = False  # some unit ran since the last restart

    @property
    def address(self) -> str:
        return self.cluster.scheduler_address if self.cluster is not None else str(self.scheduler)

    def __enter__(self) -> "StudyCluster":
        from distributed import Client, LocalCluster

        if self.workers is not None:
            cores = os.cpu_count() or 1
            threads = max(1, cores // self.workers)
            if self.workers > cores:
                self.log(f"[study] note: {self.workers} workers on {cores} cores oversubscribe this machine")
            env = {k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
            # One task at a time per worker (a model forward uses its threads); no memory
            # limit, since a worker holds a whole model pair by design.
            self.cluster = LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True,
                                        memory_limit=0, env=env, dashboard_address=":8787")
            self.client = Client(self.cluster, set_as_default=False)
            self.log(f"[study] Dask: {self.workers} local worker process(es), {threads} torch thread(s) each; "
                     f"scheduler {self.address}; dashboard {self.cluster.dashboard_link}")
        else:
            try:
                self.client = Client(self.scheduler, set_as_default=False, timeout=self.connect_timeout)
            except (OSError, TimeoutError, ValueError) as err:
                from specviz.study.presets import StudyConfigError

                raise StudyConfigError(f"no Dask scheduler answers at {self.scheduler!r} ({err}); start one "
                                       "(e.g. `dask scheduler`) or use --workers N for a local cluster") from None
            info = self.client.scheduler_info(n_workers=-1)
            link = self.client.dashboard_link
            self.log(f"[study] Dask: cluster at {self.address} with {len(info['workers'])} worker(s); "
                     f"dashboard {link}")
        return self

    def fresh_workers(self) -> None:
        """Restart the workers of a cluster started here, so that a notebook that runs its
        models in its own process does not share memory with pairs the workers hold."""
        if self.cluster is not None and self.used:
            self.client.restart()
            self.used = False

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        self.client = self.cluster = None


class UnitProgress:
    """A terminal progress bar over the units of the notebook that is running, fed by the
    ``partial/progress.json`` file :class:`~specviz.study.work.Work` keeps up to date."""

    def __init__(self, out_dir: Path, *, interval_s: float = 1.0, enabled: bool = True) -> None:
        self.path = Path(out_dir) / "partial" / PROGRESS_FILE
        self.interval_s = interval_s
        self.enabled = enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "UnitProgress":
        if self.enabled:
            self.path.unlink(missing_ok=True)
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        from tqdm import tqdm

        bar, label, last = None, None, None
        while not self._stop.wait(self.interval_s):
            try:
                state = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            if state == last:
                continue
            last = state
            if bar is None or state.get("label") != label:
                if bar is not None:
                    bar.close()
                label = state.get("label")
                bar = tqdm(total=state.get("total", 0), desc=f"units: {label}", position=1, leave=False,
                           unit="unit", dynamic_ncols=True)
            bar.n = state.get("done", 0)
            bar.refresh()
        if bar is not None:
            bar.close()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

"""The study, headless: run the notebooks in order with papermill, resumably.

One command runs the whole study with a named preset::

    python -m specviz.study                      # preset "quick"
    python -m specviz.study --preset full --out outputs/full-run
    python -m specviz.study --only 02,05 --force  # re-run two notebooks

Everything a run produces lands under its output directory (default
``outputs/<preset>/``):

* ``notebooks/`` - the executed notebooks (papermill fills in the parameters);
* ``html/`` - each executed notebook as a standalone HTML page (plotly.js inlined, so
  the figures work offline), and ``report.html`` for the preset's report notebook;
* ``tables/`` - tidy results as CSV and Parquet (:func:`specviz.data.store.save_table`);
* ``partial/`` - unit-by-unit progress of long notebooks (:class:`specviz.data.store.ResultStore`);
* ``state/`` - one done-marker per finished notebook, holding a fingerprint of the
  notebook's source and parameters; ``study.json`` - what ran, with which parameters.

Re-running the same command skips every notebook whose marker matches (same source,
same parameters, same prompt file contents) and resumes long notebooks unit by unit,
so an interrupted run loses at most the unit that was in flight. The report notebook
(``08_report``) also runs again whenever a notebook before it (whose tables it reads)
finished since the report last ran, so ``report.html`` never describes older results than
the tables.

Before the first notebook runs, the study prepares the built-in models that the
notebooks about to run will load (in the weight modes their ``dtype`` parameters name),
in its own process: the first preparation takes minutes, and its progress then shows
in the terminal rather than inside a notebook cell. When everything is cached this is a
few file checks.

Notebooks receive ``out_dir`` (the run directory) and, when they declare them,
``prompts_path`` and ``prompt_limit`` from ``--prompts`` and ``--limit``; the rest of
their parameters come from the preset (:data:`PRESETS`; resolved by
:mod:`specviz.study.parameters`). The kernel is the Jupyter ``python3`` kernel of the
interpreter running the study, so the study always uses the environment it was started
from. Inside a notebook, :func:`setup_notebook` (:mod:`specviz.study.notebook_setup`) is
the first code cell.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from specviz.locations import NOTEBOOKS_DIR, OUTPUTS_DIR
from specviz.study.cluster import UnitProgress
from specviz.study.notebook_setup import setup_notebook
from specviz.study.notebooks import clean_notebook, export_html
from specviz.study.parameters import (check_limit, check_prompts, declared_parameters, default_value,
                                      notebook_fingerprint, notebook_parameters, weight_mode_name)
from specviz.study.presets import NotebookRun, Preset, StudyConfigError, get_preset
from specviz.data.store import atomic_write_text
from specviz.validate import check_int

if TYPE_CHECKING:
    from specviz.study.cluster import StudyCluster

__all__ = [
    "NotebookFailedError",
    "NotebookOutcome",
    "StudyResult",
    "declared_parameters",
    "default_value",
    "notebook_parameters",
    "run_study",
    "refresh_committed",
    "setup_notebook",
]

KERNEL_NAME = "python3"


class NotebookFailedError(RuntimeError):
    """A notebook raised while it ran; the executed copy shows the traceback."""


@dataclass(frozen=True)
class NotebookOutcome:
    """What happened to one notebook in a run.

    Attributes:
        notebook: the notebook's stem.
        status: ``"ran"`` or ``"skipped"`` (finished earlier with the same fingerprint).
        elapsed_s: seconds it ran (for a skipped notebook: when it last ran).
        executed: the executed notebook.
        html: its HTML export.
    """

    notebook: str
    status: str
    elapsed_s: float
    executed: Path
    html: Path


@dataclass(frozen=True)
class StudyResult:
    """A finished run: where it wrote, what each notebook did, and the report."""

    out_dir: Path
    preset: str
    outcomes: tuple[NotebookOutcome, ...]
    report: Path | None


# -- running one notebook ------------------------------------------------------------------

def _check_kernel() -> None:
    """Make sure papermill's ``python3`` kernel is this interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        raise StudyConfigError(
            f"no Jupyter kernel named {KERNEL_NAME!r}; install ipykernel in this environment "
            f"({sys.executable} -m pip install ipykernel)"
        ) from None
    exe = spec.argv[0] if spec.argv else ""
    # jupyter_client runs sys.executable for a spec that just says "python"/"python3".
    if exe in {"python", "python3", f"python3.{sys.version_info.minor}"}:
        return
    if Path(exe).resolve() != Path(sys.executable).resolve():
        raise StudyConfigError(
            f"the Jupyter kernel {KERNEL_NAME!r} ({spec.resource_dir}) runs {exe}, not this "
            f"interpreter ({sys.executable}); remove or fix that kernelspec so the notebooks run "
            "in the environment that has specviz"
        )


# The kernel's own log goes to this terminal; below CRITICAL it only says that a local
# kernel talks over unencrypted TCP and that it was interrupted at shutdown. Errors in the
# notebook's cells still surface, through the executed notebook and NotebookFailedError.
_KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL"]


def _execute(src: Path, dest: Path, params: Mapping[str, Any], progress: bool) -> None:
    """Execute notebook ``src`` with papermill into ``dest``, with ``params``.

    Raises:
        NotebookFailedError: a cell raised (names the cell and the executed copy).
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        papermill.execute_notebook(str(src), str(dest), parameters=dict(params), kernel_name=KERNEL_NAME,
                                   progress_bar=progress, cwd=str(NOTEBOOKS_DIR),
                                   extra_arguments=_KERNEL_ARGUMENTS)
    except PapermillExecutionError as err:
        raise NotebookFailedError(
            f"{src.name} failed in cell [{err.exec_count}] with {err.ename}: {err.evalue}; "
            f"the executed notebook with the traceback is {dest}"
        ) from None


# -- the run -------------------------------------------------------------------------------

def _select(runs: Sequence[NotebookRun], only: Sequence[str] | None) -> list[NotebookRun]:
    """The ``runs`` that ``only`` names by number or stem, in the preset's order (all of them
    without ``only``).

    Raises:
        StudyConfigError: a name that matches no notebook.
    """
    if not only:
        return list(runs)
    chosen = []
    for key in only:
        key = key.strip().removesuffix(".ipynb")
        match = [r for r in runs if key in (r.number, r.stem)]
        if not match:
            valid = ", ".join(r.number for r in runs)
            raise StudyConfigError(f"--only {key!r} matches no notebook; valid: {valid}")
        chosen.extend(m for m in match if m not in chosen)
    return [r for r in runs if r in chosen]


@dataclass(frozen=True)
class _Plan:
    """One notebook of a run, resolved: its file, final parameters and fingerprint, and
    the parameters it declares (with their defaults)."""

    run: NotebookRun
    source: Path
    parameters: dict[str, Any]
    fingerprint: str
    declared: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def value(self, name: str) -> Any:
        """The value parameter ``name`` has in this run (the notebook's default unless set);
        None when the notebook does not declare it or its default is not a literal."""
        if name in self.parameters:
            return self.parameters[name]
        if name not in self.declared:
            return None
        return default_value(self.declared[name])


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The done-marker at ``path``, None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# -- the built-in models, prepared before the first notebook ------------------------------------

#: notebooks that load the built-in pair (in the weight mode of their ``dtype`` parameter),
#: with the parameters and values that all switch the pair on where it is optional
_BUILTIN = (("models", "builtin"),)
_BUILTIN_PAIR_NOTEBOOKS: Mapping[str, tuple[tuple[str, Any], ...]] = {
    "01_quickstart": _BUILTIN,
    "03_chain_tree_dynamic": _BUILTIN,
    "04_verification_rules": (("real_models", True),) + _BUILTIN,
    "06_end_to_end_speed": _BUILTIN,
    "09_lookahead": _BUILTIN,
    "10_draft_heads": _BUILTIN,
    "11_serving": _BUILTIN,
}
#: parameters that list further weight modes in which a notebook loads the built-in target
_TARGET_MODE_PARAMETERS: Mapping[str, str] = {"06_end_to_end_speed": "probe_dtypes"}


def _builtin_models_needed(plans: Sequence[_Plan], remote: bool = False) -> list[tuple[str, str]]:
    """(built-in model, weight mode) pairs the planned notebooks load on this machine, in
    first-use order. A weight mode that is not a literal known name (``auto``, a typo) is
    left to the notebook, which resolves or rejects it itself. With a ``remote`` Dask
    scheduler, notebooks that run their units there (they declare ``scheduler``) load
    nothing here."""
    from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
    from specviz.quant.weights import WEIGHT_MODES

    needed: list[tuple[str, str]] = []

    def add(model: str, mode: Any) -> None:
        if isinstance(mode, str) and mode in WEIGHT_MODES and (model, mode) not in needed:
            needed.append((model, mode))

    for plan in plans:
        stem = plan.run.stem
        if stem not in _BUILTIN_PAIR_NOTEBOOKS or (remote and "scheduler" in plan.declared):
            continue
        if any(plan.value(name) != value for name, value in _BUILTIN_PAIR_NOTEBOOKS[stem]):
            continue
        mode = plan.value("dtype")
        add(DEFAULT_TARGET, mode)
        add(DEFAULT_DRAFT, plan.value("draft_dtype") or mode)
        extra = plan.value(_TARGET_MODE_PARAMETERS[stem]) if stem in _TARGET_MODE_PARAMETERS else None
        for other in extra if isinstance(extra, list) else []:
            add(DEFAULT_TARGET, other)
    return needed


def _prepare_models(plans: Sequence[_Plan], log: Callable[[str], None], remote: bool = False) -> None:
    """Build the cache entries of the built-in models the plans load and that are not
    cached yet, with the loader's progress on stderr; nothing is loaded when all are cached."""
    from specviz.models.builtin import builtin_cached, prepare_builtin

    missing = [(m, mode) for m, mode in _builtin_models_needed(plans, remote) if not builtin_cached(m, mode)]
    if not missing:
        return
    names = ", ".join(f"{m} ({mode})" for m, mode in missing)
    log(f"[study] preparing the built-in models before the first notebook: {names} (converting the pair "
        "from its data packages takes about 3 minutes on a 2-core CPU, once; progress below)")
    start = time.perf_counter()
    for model, mode in missing:
        try:
            prepare_builtin(model, mode)
        except (FileNotFoundError, ValueError) as err:
            raise StudyConfigError(f"cannot prepare the built-in model {model}: {err}") from None
    log(f"[study] built-in models ready in {time.perf_counter() - start:.0f} s")


def run_study(preset: str | Preset = "quick", *, out_dir: str | Path | None = None,
              prompts: str | Path | None = None, limit: int | None = None,
              only: Sequence[str] | None = None, force: bool = False, progress: bool = True,
              workers: int | None = None, scheduler: str | None = None, dtype: str | None = None,
              draft_dtype: str | None = None, log: Callable[[str], None] | None = None) -> StudyResult:
    """Run a preset's notebooks in order, skipping those already finished.

    Args:
        preset: a name from :data:`PRESETS` or a :class:`Preset`.
        out_dir: the run directory (default ``outputs/<preset name>``).
        prompts: a Spec-Bench-format prompt file for the notebooks that read prompts.
        limit: prompts per run for those notebooks.
        only: notebook numbers or stems to run (e.g. ``["02", "05"]``), default all.
        force: re-run notebooks even if they finished with the same fingerprint.
        progress: show papermill's per-cell progress bar.
        workers: run the notebooks' units on a local Dask cluster of this many worker
            processes (:class:`~specviz.study.cluster.StudyCluster`).
        scheduler: run them on the existing Dask cluster at this address instead.
            Without either, every unit runs in its notebook's process.
        dtype: weight mode of the real models (``fp32``, ``bf16``, ``w8a8-token``, ...)
            for every notebook that has a ``dtype`` parameter; default: the preset's
            (:attr:`Preset.dtype`; ``quick``: ``auto``), else each notebook's own. ``auto``
            is resolved once, before the first notebook (:mod:`specviz.bench.auto`).
        draft_dtype: the draft's weight mode (e.g. ``w4a8-token``) for every notebook that
            has a ``draft_dtype`` parameter (the speed notebook, 06); default: the preset's
            for the target's mode (:attr:`Preset.draft_dtypes`), else the target's mode.
        log: where progress lines go.

    Before the first notebook, the built-in models that the notebooks about to run load
    are converted into the cache if they are not there yet (progress on stderr).

    Raises:
        StudyConfigError: before anything runs, on a bad preset, selection, prompt file,
            limit, preset parameter or kernel, or built-in models that cannot be prepared
            (missing or corrupted data packages).
        NotebookFailedError: when a notebook raises (earlier notebooks stay finished).
    """
    log = log or log_line
    _check_workers(workers, scheduler)
    spec = get_preset(preset)
    dtype, draft_dtype = _named_modes(spec, dtype, draft_dtype)
    runs = _select(spec.runs, only)
    prompts_path = check_prompts(prompts)
    limit = check_limit(limit)
    out = (Path(out_dir) if out_dir is not None else OUTPUTS_DIR / spec.name).expanduser().resolve()
    for run in runs:
        if not (NOTEBOOKS_DIR / run.notebook).is_file():
            raise StudyConfigError(f"notebook {NOTEBOOKS_DIR / run.notebook} does not exist")
    _check_kernel()
    with contextlib.ExitStack() as stack:
        cluster = None
        if workers is not None or scheduler:  # before auto's probe: a scheduler that does not answer fails fast
            from specviz.study.cluster import StudyCluster

            cluster = stack.enter_context(StudyCluster(workers=workers, scheduler=scheduler, log=log))
        dtype, draft_dtype = _chosen_modes(spec, dtype, draft_dtype, log)
        plans = _plan(runs, out, prompts_path, limit, dtype, draft_dtype, log)
        out.mkdir(parents=True, exist_ok=True)
        log(f"[study] preset {spec.name!r}: {len(plans)} notebook(s) -> {out}")
        _prepare_models([p for p in plans if force or not _finished(p, out, None)], log, remote=bool(scheduler))
        outcomes = _run_plans(plans, spec, out, force=force, progress=progress, cluster=cluster, log=log)
    return _finish_study(spec, out, outcomes, plans, log)


def _check_workers(workers: int | None, scheduler: str | None) -> None:
    """Check ``run_study``'s ``workers`` and ``scheduler``: at most one of them, a positive count.

    Raises:
        StudyConfigError: both given, or a bad count.
    """
    if workers is not None and scheduler:
        raise StudyConfigError("give --workers (start a local cluster) or --scheduler (use one), not both")
    if workers is not None:
        check_int("workers", workers, error=StudyConfigError)


def _named_modes(spec: Preset, dtype: str | None, draft_dtype: str | None) -> tuple[str | None, str | None]:
    """The run's weight modes by their canonical names: ``dtype`` (default: the preset's;
    ``auto`` is kept, to be resolved later) and ``draft_dtype``.

    Raises:
        StudyConfigError: an unknown mode.
    """
    if dtype is None:
        dtype = spec.dtype
    from specviz.bench.auto import is_auto

    if dtype is not None and not is_auto(dtype):
        dtype = weight_mode_name("dtype", dtype)
    if draft_dtype is not None:
        draft_dtype = weight_mode_name("draft_dtype", draft_dtype)
    return dtype, draft_dtype


def _chosen_modes(spec: Preset, dtype: str | None, draft_dtype: str | None,
                  log: Callable[[str], None]) -> tuple[str | None, str | None]:
    """The weight modes the notebooks get: ``auto`` resolved once for the whole study, from
    the built-in target's probe (:mod:`specviz.bench.auto`), and the draft's mode from the
    preset's :attr:`Preset.draft_dtypes` where the run names none.

    Raises:
        StudyConfigError: ``auto`` finds no mode, or the preset names an unknown draft mode.
    """
    from specviz.bench.auto import is_auto

    if is_auto(dtype):  # one choice for the whole study, from the built-in target's probe (after every cheap check)
        from specviz.bench.auto import resolve_auto
        from specviz.models.builtin import DEFAULT_TARGET

        try:
            dtype = resolve_auto(DEFAULT_TARGET, log=log)
        except ValueError as exc:
            raise StudyConfigError(f"dtype: {exc}") from None
    if draft_dtype is None and dtype in spec.draft_dtypes:
        draft_dtype = weight_mode_name(f"preset {spec.name!r}'s draft_dtypes", spec.draft_dtypes[dtype])
        log(f"[study] the draft runs in {draft_dtype} beside the {dtype} target (--draft-dtype {dtype} keeps "
            "it in the target's mode)")
    return dtype, draft_dtype


def _plan(runs: Sequence[NotebookRun], out: Path, prompts_path: Path | None, limit: int | None,
          dtype: str | None, draft_dtype: str | None, log: Callable[[str], None]) -> list[_Plan]:
    """Resolve every selected notebook: its parameters for this run and their fingerprint.

    Raises:
        StudyConfigError: a notebook that does not exist, or a preset parameter it does not declare.
    """
    plans = []
    for run in runs:
        src = NOTEBOOKS_DIR / run.notebook
        if not src.is_file():
            raise StudyConfigError(f"notebook {src} does not exist")
        declared = declared_parameters(src)
        params = notebook_parameters(run, declared, out, prompts=prompts_path, limit=limit, dtype=dtype,
                                     draft_dtype=draft_dtype)
        plans.append(_Plan(run, src, params, notebook_fingerprint(src, params, prompts_path), declared))
    if (prompts_path is not None or limit is not None) and not any(
            "prompts_path" in p.parameters or "prompt_limit" in p.parameters for p in plans):
        log("[study] note: no selected notebook reads prompts, so --prompts/--limit change nothing")
    return plans


def _finish_study(spec: Preset, out: Path, outcomes: Sequence[NotebookOutcome], plans: Sequence[_Plan],
                  log: Callable[[str], None]) -> StudyResult:
    """After the last notebook: export the report, write the manifest and say what ran."""
    manifest_path = out / "study.json"

    report = None
    if spec.report is not None:
        outcome = next((o for o in outcomes if o.notebook == spec.report), None)
        if outcome is not None:
            report = export_html(outcome.executed, out / "report.html", hide_code=True)
            log(f"[study] report: {report}")
    _write_manifest(manifest_path, spec, outcomes, plans)
    total = sum(o.elapsed_s for o in outcomes if o.status == "ran")
    log(f"[study] finished: {sum(o.status == 'ran' for o in outcomes)} ran ({total:.0f} s), "
        f"{sum(o.status == 'skipped' for o in outcomes)} skipped; results in {out}")
    return StudyResult(out, spec.name, tuple(outcomes), report)


def _run_plans(plans: Sequence[_Plan], spec: Preset, out: Path, *, force: bool, progress: bool,
               cluster: "StudyCluster | None", log: Callable[[str], None]) -> list[NotebookOutcome]:
    """Run (or skip) each planned notebook in order; the manifest is rewritten after each."""
    manifest_path = out / "study.json"
    outcomes: list[NotebookOutcome] = []
    for i, plan in enumerate(plans, 1):
        run, params = plan.run, plan.parameters
        executed = out / "notebooks" / run.notebook
        html = out / "html" / f"{run.stem}.html"
        marker = out / "state" / f"{run.stem}.done.json"
        inputs = _report_inputs(out, spec) if run.stem == spec.report else None
        done = None if force else _finished(plan, out, inputs)
        if done is not None:
            log(f"[study {i}/{len(plans)}] {run.stem}: finished earlier with the same inputs "
                f"({done.get('elapsed_s', 0):.0f} s then), skipped")
            outcomes.append(NotebookOutcome(run.stem, "skipped", float(done.get("elapsed_s", 0.0)), executed, html))
            continue
        shown = {k: v for k, v in params.items() if k != "out_dir"}
        log(f"[study {i}/{len(plans)}] {run.stem}: running with {shown or 'its defaults'}")
        marker.unlink(missing_ok=True)
        start = time.perf_counter()
        run_params = params
        if cluster is not None and "scheduler" in declared_parameters(plan.source):
            run_params = {**params, "scheduler": cluster.address}  # not part of the fingerprint or marker
            cluster.used = True
        elif cluster is not None:
            cluster.fresh_workers()  # the notebook loads its models itself: free the workers' memory
        with UnitProgress(out, enabled=progress):
            _execute(plan.source, executed, run_params, progress)
        export_html(executed, html)
        elapsed = time.perf_counter() - start
        atomic_write_text(marker, json.dumps({
            "notebook": run.notebook, "fingerprint": plan.fingerprint, "parameters": params, "elapsed_s": elapsed,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "inputs": inputs,
        }, indent=2, default=str) + "\n")
        log(f"[study {i}/{len(plans)}] {run.stem}: done in {elapsed:.0f} s")
        outcomes.append(NotebookOutcome(run.stem, "ran", elapsed, executed, html))
        _write_manifest(manifest_path, spec, outcomes, plans)
    return outcomes


def _finished(plan: _Plan, out: Path, inputs: list[list[str]] | None) -> dict[str, Any] | None:
    """The done-marker of ``plan`` when it finished earlier with the same fingerprint and
    report ``inputs`` and its outputs are still there (it is skipped then), else None."""
    run = plan.run
    done = _read_marker(out / "state" / f"{run.stem}.done.json")
    if (done is not None and done.get("fingerprint") == plan.fingerprint and done.get("inputs") == inputs
            and (out / "notebooks" / run.notebook).is_file() and (out / "html" / f"{run.stem}.html").is_file()):
        return done
    return None


def _report_inputs(out: Path, spec: Preset) -> list[list[str]] | None:
    """What the report notebook reads: the done-markers of the notebooks that run before it
    in the preset (fingerprint and finishing time). A report whose recorded inputs differ is
    stale and runs again, even when its own source and parameters did not change."""
    inputs = []
    for run in spec.runs:
        if run.stem == spec.report:
            break
        done = _read_marker(out / "state" / f"{run.stem}.done.json") or {}
        inputs.append([run.stem, str(done.get("fingerprint", "")), str(done.get("finished", ""))])
    return inputs


def _write_manifest(path: Path, spec: Preset, outcomes: Sequence[NotebookOutcome], plans: Sequence[_Plan]) -> None:
    """Write ``study.json``: the preset, and every planned notebook's parameters and status."""
    status = {o.notebook: o for o in outcomes}
    atomic_write_text(path, json.dumps({
        "preset": spec.name,
        "description": spec.description,
        "notebooks": [{
            "notebook": p.run.notebook,
            "parameters": {k: v for k, v in p.parameters.items() if k != "out_dir"},
            "status": status[p.run.stem].status if p.run.stem in status else "pending",
            "elapsed_s": status[p.run.stem].elapsed_s if p.run.stem in status else None,
        } for p in plans],
    }, indent=2, default=str) + "\n")


def refresh_committed(only: Sequence[str] | None = None, *, progress: bool = True,
                      log: Callable[[str], None] | None = None) -> list[Path]:
    """Re-execute the committed notebooks in ``notebooks/`` with their own defaults and
    save them in place, cleaned (:func:`clean_notebook`): what nbval compares against.

    Args:
        only: notebook numbers or stems (default: every ``NN_*.ipynb`` in ``notebooks/``).
    """
    log = log or log_line
    present = sorted(p.name for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    runs = _select([NotebookRun(name) for name in present], only)
    _check_kernel()
    written = []
    for run in runs:
        src = NOTEBOOKS_DIR / run.notebook
        tmp = src.with_name(f".{src.stem}.refresh.ipynb")
        log(f"[refresh] {run.notebook}")
        start = time.perf_counter()
        try:
            _execute(src, tmp, {}, progress)
            clean_notebook(tmp)
            tmp.replace(src)
        finally:
            tmp.unlink(missing_ok=True)
        log(f"[refresh] {run.notebook}: {time.perf_counter() - start:.0f} s")
        written.append(src)
    return written


def log_line(message: str) -> None:
    """Print a progress line, flushed, so that it and papermill's progress bar (stderr)
    interleave in order."""
    print(message, flush=True)

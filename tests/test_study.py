"""Tests for specviz.study: presets, notebook conventions, the command line, and every
notebook run through papermill with its smallest parameters (the ``tiny`` preset: ``smoke`` on the
random tiny pair wherever a notebook can use it)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import nbformat
import pytest

import specviz.study.runner as study
from specviz.locations import NOTEBOOKS_DIR
from specviz.study.__main__ import main
from specviz.study.notebooks import clean_notebook, export_html
from specviz.study.parameters import notebook_fingerprint
from specviz.study.presets import PRESETS, NotebookRun, Preset, StudyConfigError, get_preset
from specviz.study.runner import declared_parameters, notebook_parameters, run_study

ALL_NOTEBOOKS = sorted(p.name for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
STUDY_NOTEBOOKS = sorted({run.notebook for preset in PRESETS.values() for run in preset.runs})
SMOKE_RUNS = PRESETS["tiny"].runs


def _parameters_cell(nb) -> nbformat.NotebookNode:
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "a study notebook has exactly one cell tagged 'parameters'"
    return cells[0]


# -- presets and notebooks -----------------------------------------------------------------

def test_every_preset_runs_the_same_notebooks_in_the_same_order():
    orders = {name: [r.notebook for r in p.runs] for name, p in PRESETS.items()}
    assert orders["smoke"] == orders["tiny"] == orders["quick"] == orders["standard"] == orders["full"]
    assert orders["quick"][-1] == "08_report.ipynb"  # the report reads every other notebook's tables
    assert orders["quick"][:-1] == sorted(orders["quick"][:-1])


def test_a_report_that_does_not_run_last_is_refused():
    quick = PRESETS["quick"]
    runs = (quick.runs[-1],) + quick.runs[:-1]
    with pytest.raises(ValueError, match="must run last"):
        Preset("early-report", "the report first", runs, report="08_report")


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_parameters_are_declared_by_their_notebooks(preset):
    for run in PRESETS[preset].runs:
        declared = declared_parameters(NOTEBOOKS_DIR / run.notebook)
        assert "out_dir" in declared, run.notebook
        assert set(run.parameters) <= set(declared), run.notebook
        for name, value in run.parameters.items():
            default = ast.literal_eval(declared[name]["default"])
            assert type(value) is type(default), (run.notebook, name)


def test_preset_objects_validate_themselves():
    with pytest.raises(ValueError, match="no notebooks"):
        Preset("empty", "", ())
    with pytest.raises(ValueError, match="twice"):
        Preset("dup", "", (NotebookRun("02_a.ipynb"), NotebookRun("02_a.ipynb")))
    with pytest.raises(ValueError, match="report"):
        Preset("r", "", (NotebookRun("02_a.ipynb"),), report="08_report")
    with pytest.raises(ValueError, match="pipeline"):
        NotebookRun("02_a.ipynb", {"out_dir": "x"})
    with pytest.raises(ValueError, match="ipynb"):
        NotebookRun("02_a.py")
    with pytest.raises(StudyConfigError, match="unknown preset 'huge'"):
        get_preset("huge")
    assert get_preset("quick") is PRESETS["quick"]


@pytest.mark.parametrize("name", ALL_NOTEBOOKS)
def test_notebook_conventions(name):
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    cell = _parameters_cell(nb)
    statements = ast.parse(cell.source).body
    lines = cell.source.splitlines()
    for stmt in statements:
        assert isinstance(stmt, ast.AnnAssign), f"{name}: parameters are typed assignments"
        ast.literal_eval(stmt.value)  # literals only
        assert "#" in lines[stmt.lineno - 1], f"{name}: parameter on line {stmt.lineno} needs a comment"
    # papermill must parse every one of them (e.g. a '=' inside a comment hides a parameter)
    assert len(declared_parameters(NOTEBOOKS_DIR / name)) == len(statements)
    for c in nb.cells:
        assert "papermill" not in c.metadata and "execution" not in c.metadata
    assert "papermill" not in nb.metadata


@pytest.mark.parametrize("name", STUDY_NOTEBOOKS)
def test_study_notebooks_are_committed_executed_without_errors(name):
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "commit notebooks executed with their defaults"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]


def test_committed_report_reads_complete_reference_results():
    """The report notebook, run on its own, reads outputs/reference/: every table it
    looks for and the benchmark CSV must be committed there."""
    nb = nbformat.read(NOTEBOOKS_DIR / "08_report.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream")
    found = re.search(r"results: outputs/reference; tables found: (\d+) of (\d+)", text)
    assert found, "08_report.ipynb must be committed executed on outputs/reference"
    assert found[1] == found[2], f"reference results lack tables: {found[0]}"
    assert "benchmark: outputs/reference/bench-greedy.csv" in text


# -- parameters and fingerprints -----------------------------------------------------------

DECLARED = {"out_dir": {}, "prompts_path": {}, "prompt_limit": {}, "trials": {}}


def test_notebook_parameters_adds_what_the_notebook_declares(tmp_path):
    run = NotebookRun("03_x.ipynb", {"trials": 5})
    params = notebook_parameters(run, DECLARED, tmp_path, prompts=tmp_path / "p.jsonl", limit=3)
    assert params == {"trials": 5, "out_dir": str(tmp_path), "prompts_path": str(tmp_path / "p.jsonl"),
                      "prompt_limit": 3}
    assert notebook_parameters(run, {"trials": {}}, tmp_path, limit=3) == {"trials": 5}
    # --dtype reaches the notebooks that declare a dtype parameter, and only those.
    assert notebook_parameters(run, {"trials": {}, "dtype": {}}, tmp_path, dtype="w8a8-token") == {
        "trials": 5, "dtype": "w8a8-token"}
    assert notebook_parameters(run, {"trials": {}}, tmp_path, dtype="w8a8-token") == {"trials": 5}
    # --draft-dtype likewise, to the notebooks that declare draft_dtype
    assert notebook_parameters(run, {"trials": {}, "draft_dtype": {}}, tmp_path,
                               draft_dtype="w4a8-token") == {"trials": 5, "draft_dtype": "w4a8-token"}
    assert notebook_parameters(run, {"trials": {}}, tmp_path, draft_dtype="w4a8-token") == {"trials": 5}
    with pytest.raises(StudyConfigError, match="draft_dtype: unknown weight mode 'int3'"):
        run_study("quick", draft_dtype="int3", out_dir=tmp_path)
    with pytest.raises(StudyConfigError, match="dtype: unknown weight mode 'int3'"):
        run_study("quick", dtype="int3", out_dir=tmp_path)
    with pytest.raises(StudyConfigError, match="no parameter"):
        notebook_parameters(NotebookRun("03_x.ipynb", {"nope": 1}), DECLARED, tmp_path)


def test_fingerprint_ignores_out_dir_but_not_parameters():
    nb = NOTEBOOKS_DIR / STUDY_NOTEBOOKS[0]
    base = notebook_fingerprint(nb, {"out_dir": "/a", "x": 1}, None)
    assert base == notebook_fingerprint(nb, {"out_dir": "/b", "x": 1}, None)
    assert base != notebook_fingerprint(nb, {"out_dir": "/a", "x": 2}, None)


def test_clean_notebook_strips_run_metadata(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["papermill"] = {"duration": 1.0}
    cell = nbformat.v4.new_code_cell("1 + 1", metadata={
        "tags": ["parameters"], "papermill": {"status": "completed"},
        "execution": {"iopub.status.busy": "2024-01-01T00:00:00"}})
    cell.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"}, execution_count=1)]
    nb.cells = [cell]
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    clean_notebook(path)
    cleaned = nbformat.read(path, as_version=4)
    assert "papermill" not in cleaned.metadata
    assert cleaned.cells[0].metadata == {"tags": ["parameters"]}
    assert cleaned.cells[0].outputs[0]["data"]["text/plain"] == "2"


def test_setup_notebook(monkeypatch):
    import pandas as pd
    import plotly.io as pio
    import torch

    monkeypatch.setattr(pio.renderers, "default", pio.renderers.default)
    try:
        g = study.setup_notebook(7)
        assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=torch.Generator().manual_seed(7)))
        assert pio.renderers.default == "plotly_mimetype"
        assert pd.get_option("display.precision") == 3
    finally:
        from transformers.utils import logging as transformers_logging

        transformers_logging.enable_progress_bar()
        pd.reset_option("display.precision")
        pd.reset_option("display.width")
        pd.reset_option("display.max_columns")
        torch.set_printoptions(profile="default")
    with pytest.raises(ValueError, match="threads"):
        study.setup_notebook(0, threads=0)


# -- command line ----------------------------------------------------------------------------

def test_cli_unknown_preset(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--preset", "huge"])
    assert exc.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_cli_missing_prompts_file(tmp_path, capsys):
    assert main(["--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "run")]) == 2
    assert "prompts file not found" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_cli_bad_prompts_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "code"}\n')
    assert main(["--prompts", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "cannot use the prompts file" in err and "line 1" in err


def test_cli_bad_limit_and_selection(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--limit", "0"])
    assert exc.value.code == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
    assert main(["--only", "99", "--out", str(tmp_path)]) == 2
    assert "matches no notebook" in capsys.readouterr().err


def test_cli_list(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}:" in out for name in PRESETS)


# -- every notebook through papermill, then a resumed run ------------------------------------

@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    lines: list[str] = []
    result = run_study("tiny", out_dir=out, progress=False, log=lines.append)
    return result, lines


@pytest.mark.parametrize("run", SMOKE_RUNS, ids=[r.stem for r in SMOKE_RUNS])
def test_notebook_runs_with_its_smallest_parameters(smoke_run, run):
    result, lines = smoke_run
    outcome = next(o for o in result.outcomes if o.notebook == run.stem)
    assert outcome.status == "ran"
    nb = nbformat.read(outcome.executed, as_version=4)
    params = _parameters_cell(nb)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and str(result.out_dir) in injected[0].source
    assert nb.cells.index(injected[0]) == nb.cells.index(params) + 1
    html = outcome.html.read_text()
    remote = re.findall(r'<script[^>]*\ssrc="(https?://[^"]*)"', html)
    assert all("mathjax" in url for url in remote), remote  # only MathJax may come from the network
    if any("application/vnd.plotly.v1+json" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])):
        assert "plotly.js v" in html  # the library itself is inlined, once
        assert html.count("plotly.js v") == 1
    marker = json.loads((result.out_dir / "state" / f"{run.stem}.done.json").read_text())
    assert marker["notebook"] == run.notebook and marker["parameters"]["out_dir"] == str(result.out_dir)
    assert any(run.stem in line and "done in" in line for line in lines)


REPORTED_TABLES = ("acceptance_by_budget", "acceptance_by_category", "acceptance_per_depth", "positional_acceptance",
                   "expected_vs_realised", "verification_distribution_checks", "verification_real",
                   "attention_timing", "cost_curves", "speed_summary", "tree_size_plan", "tokens_per_step",
                   "per_position_acceptance", "oracle_bound", "calibration_bins", "calibration_ece",
                   "engine_cross_check")


def test_smoke_run_writes_tables_and_manifest(smoke_run):
    result, _ = smoke_run
    tables = sorted(p.name for p in (result.out_dir / "tables").iterdir())
    for name in ("attention_work", "acceptance_steps", "speed_runs", "quickstart_acceptance", "lookahead_runs",
                 "lookahead_sweep") + REPORTED_TABLES:
        assert f"{name}.csv" in tables and f"{name}.parquet" in tables, name
    manifest = json.loads((result.out_dir / "study.json").read_text())
    assert manifest["preset"] == "tiny"
    assert [n["status"] for n in manifest["notebooks"]] == ["ran"] * len(SMOKE_RUNS)


def test_smoke_report_reads_every_table(smoke_run):
    result, _ = smoke_run
    assert result.report == result.out_dir / "report.html" and result.report.is_file()
    report = nbformat.read(result.out_dir / "notebooks" / "08_report.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in report.cells if c.cell_type == "code" for o in c.outputs)
    not_found = next((line for line in text.splitlines() if line.startswith("not found")), "")
    assert not [name for name in REPORTED_TABLES if name in not_found], not_found
    html = result.report.read_text()
    assert "setup_notebook" not in html and "Method" in html
    assert "<title>08 · Report" in html
    assert "Lossless rules that reproduce the target distribution" in html  # findings written from the tables
    assert "cross_check" in html  # the smoke preset switches the engine cross-check off, and the report says so


def test_rerun_skips_finished_notebooks(smoke_run):
    result, _ = smoke_run
    lines: list[str] = []
    again = run_study("tiny", out_dir=result.out_dir, progress=False, log=lines.append)
    assert [o.status for o in again.outcomes] == ["skipped"] * len(SMOKE_RUNS)
    assert sum(line.startswith("[study ") and "skipped" in line for line in lines) == len(SMOKE_RUNS)


def test_report_reruns_when_a_notebook_it_reads_reran(smoke_run):
    result, _ = smoke_run
    run_study("tiny", out_dir=result.out_dir, only=["02"], force=True, progress=False, log=lambda _: None)
    again = run_study("tiny", out_dir=result.out_dir, progress=False, log=lambda _: None)
    status = {o.notebook: o.status for o in again.outcomes}
    assert status.pop("08_report") == "ran"
    assert set(status.values()) == {"skipped"}
    third = run_study("tiny", out_dir=result.out_dir, progress=False, log=lambda _: None)
    assert {o.status for o in third.outcomes} == {"skipped"}


def test_kernel_is_this_interpreter():
    study._check_kernel()  # raises StudyConfigError if papermill would use another Python


def test_missing_notebook_is_a_config_error(tmp_path):
    preset = Preset("custom", "", (NotebookRun("00_absent.ipynb"),))
    with pytest.raises(StudyConfigError, match="does not exist"):
        run_study(preset, out_dir=tmp_path, progress=False, log=lambda _: None)
    assert not any(Path(tmp_path).iterdir())


def test_a_preset_names_the_weight_mode_its_notebooks_run_in(tmp_path, monkeypatch):
    from specviz.bench import auto

    assert PRESETS["quick"].dtype == "auto"  # the default study runs in this machine's fastest accurate mode
    assert dict(PRESETS["quick"].draft_dtypes) == {"w8a8-token": "w4a8-token"}  # with a 4-bit draft beside w8a8-token
    assert not PRESETS["standard"].draft_dtypes and not PRESETS["smoke"].draft_dtypes
    assert PRESETS["smoke"].dtype is None and PRESETS["standard"].dtype is None  # fp32: the references
    bad = Preset("custom", "", (NotebookRun("00_absent.ipynb"),), dtype="int3")
    with pytest.raises(StudyConfigError, match="dtype: unknown weight mode 'int3'"):
        run_study(bad, out_dir=tmp_path, progress=False, log=lambda _: None)
    with pytest.raises(StudyConfigError, match="does not exist"):  # the command's --dtype wins
        run_study(bad, out_dir=tmp_path, progress=False, log=lambda _: None, dtype="fp32")
    asked = []

    def probe(name, log=print):
        asked.append(name)
        raise ValueError("no probe in this test")

    monkeypatch.setattr(auto, "resolve_auto", probe)
    # auto probes the machine only after every cheap check has passed
    with pytest.raises(StudyConfigError, match="does not exist"):
        run_study(dataclasses.replace(bad, dtype="auto"), out_dir=tmp_path, progress=False, log=lambda _: None)
    assert asked == []
    with pytest.raises(StudyConfigError, match="dtype: no probe in this test"):
        run_study("quick", out_dir=tmp_path, progress=False, log=lambda _: None)
    assert asked == ["qwen2.5-coder-1.5b-instruct"]
    assert main(["--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "run")]) == 2
    assert asked == ["qwen2.5-coder-1.5b-instruct"]  # a bad prompt file stops quick before its probe


def test_every_dtype_parameter_is_a_weight_mode():
    # --dtype (and a preset's dtype) reaches every notebook that declares ``dtype``: in each
    # one it must name the weight mode of the real models, whatever mode is passed
    from specviz.quant.weights import parse_weight_mode
    from specviz.study.runner import default_value

    declaring = []
    for name in ALL_NOTEBOOKS:
        declared = declared_parameters(NOTEBOOKS_DIR / name)
        if "dtype" in declared:
            declaring.append(name[:2])
            default = default_value(declared["dtype"])
            if default:  # "" leaves the choice to the notebook (the explorer's)
                parse_weight_mode(default)
            assert "weight mode" in str(declared["dtype"].get("help", "")), name
    assert {"01", "03", "06", "09", "10"} <= set(declaring) and "05" not in declaring
    # --draft-dtype reaches the speed notebook and the explorer; "" keeps the target's mode
    drafts = {name[:2]: declared_parameters(NOTEBOOKS_DIR / name).get("draft_dtype") for name in ALL_NOTEBOOKS}
    drafts = {k: v for k, v in drafts.items() if v is not None}
    assert set(drafts) == {"06", "07"}
    for spec in drafts.values():
        assert default_value(spec) == "" and "weight mode" in str(spec.get("help", ""))


def test_report_export_hides_code(smoke_run, tmp_path):
    result, _ = smoke_run
    executed = result.outcomes[0].executed
    shown = export_html(executed, tmp_path / "with_code.html").read_text()
    hidden = export_html(executed, tmp_path / "report.html", hide_code=True).read_text()
    assert "setup_notebook" in shown and "setup_notebook" not in hidden
    assert "<title>01 · " in hidden  # the page is titled by the notebook's heading, not "Notebook"
    assert "<title>a chosen title</title>" in export_html(executed, tmp_path / "t.html", title="a chosen title").read_text()


@pytest.mark.browser
def test_exported_html_draws_its_figures_offline(smoke_run):
    """Open an exported notebook in headless Chromium with every network request refused:
    the plotly figures must still be drawn (plotly.js is inlined, nothing comes from a CDN)."""
    import os
    import shutil

    chromium = os.environ.get("SPECVIZ_CHROMIUM") or shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        chromium = None
    if chromium is None:
        reason = "needs playwright and Chromium (Debian's chromium or $SPECVIZ_CHROMIUM)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but the offline HTML test cannot run: {reason}")
        pytest.skip(reason)
    result, _ = smoke_run
    html = next(o.html for o in result.outcomes if o.notebook.startswith("02_"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else route.abort())
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(html.as_uri(), wait_until="load")
            page.wait_for_selector(".plotly-graph-div .main-svg", timeout=30_000)
            figures = page.locator(".plotly-graph-div").count()
            drawn = page.evaluate("() => [...document.querySelectorAll('.plotly-graph-div')]"
                                  ".filter(d => d.querySelector('.main-svg')).length")
        finally:
            browser.close()
    assert figures >= 1 and drawn == figures
    assert not errors

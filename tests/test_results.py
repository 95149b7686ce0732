"""The README's results table and outputs/reference/RESULTS.md agree with the CSVs they cite
(specviz.study.results), and the README stays a front door."""

import json
import re
import shutil

import pandas as pd
import pytest

from specviz.locations import REPO_ROOT
from specviz.study import results
from specviz.study.results import BEGIN, END, README, REFERENCE_DIR, cited_files, main, replace_block, sync_results


def test_readme_and_results_page_agree_with_the_csvs():
    problems = sync_results(REFERENCE_DIR, README)
    assert problems == [], "run python -m specviz.study.results:\n" + "\n".join(problems)


def test_the_check_command_agrees(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_readme_is_at_most_300_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    assert sum(BEGIN in line for line in lines) == 1 and sum(END in line for line in lines) == 1


def test_every_cited_file_exists():
    files = cited_files(REFERENCE_DIR)
    assert files, "the manifest cites no file"
    assert [str(f) for f in files if not f.is_file()] == []


def test_every_repository_path_the_readme_names_exists():
    paths = set(re.findall(r"(?:outputs|data|notebooks)/[\w./-]+\.\w+", README.read_text()))
    assert paths and [p for p in sorted(paths) if not (REPO_ROOT / p).exists()] == []


@pytest.fixture
def reference_copy(tmp_path):
    """The manifest, the results page and every cited file in a scratch directory, with the README beside it."""
    reference = tmp_path / "reference"
    for path in [REFERENCE_DIR / "manifest.json", REFERENCE_DIR / "RESULTS.md", *cited_files(REFERENCE_DIR)]:
        target = reference / path.relative_to(REFERENCE_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    readme = tmp_path / "README.md"
    shutil.copy(README, readme)
    return reference, readme


def _headline_run(reference):
    manifest = json.loads((reference / "manifest.json").read_text())
    setup = manifest["headline"]["benchmark"]
    return reference / next(b for b in manifest["benchmarks"] if b["setup"] == setup)["runs"][0]


def test_a_changed_csv_value_fails_the_check(reference_copy):
    reference, readme = reference_copy
    assert sync_results(reference, readme) == []
    path = _headline_run(reference)
    rows = pd.read_csv(path)
    rows.loc[rows["method"] == "plain", "tokens_per_s"] *= 1.5
    rows.to_csv(path, index=False)
    problems = sync_results(reference, readme)
    assert len(problems) == 2
    assert "README.md (committed)" in problems[1] and "RESULTS.md (committed)" in problems[0]
    # writing brings both back in line with the CSVs
    sync_results(reference, readme, write=True)
    assert sync_results(reference, readme) == []


def test_the_check_command_names_the_difference(reference_copy, monkeypatch, capsys):
    reference, readme = reference_copy
    monkeypatch.setattr(results, "REFERENCE_DIR", reference)
    monkeypatch.setattr(results, "README", readme)
    path = _headline_run(reference)
    rows = pd.read_csv(path)
    rows.loc[rows["method"] == "hf-assisted", "speedup"] += 0.5
    rows.to_csv(path, index=False)
    assert main(["--check"]) == 1
    err = capsys.readouterr().err
    assert f"{readme} (committed)" in err and "hf-assisted" in err
    path.unlink()
    assert main(["--check"]) == 2 and path.name in capsys.readouterr().err


def test_a_missing_csv_is_named(reference_copy):
    reference, readme = reference_copy
    path = _headline_run(reference)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(path.name)):
        sync_results(reference, readme)


def test_a_missing_column_is_named(reference_copy):
    reference, readme = reference_copy
    path = _headline_run(reference)
    pd.read_csv(path).drop(columns="speedup").to_csv(path, index=False)
    with pytest.raises(ValueError, match=re.escape(path.name) + r".*speedup"):
        sync_results(reference, readme)


def test_a_readme_without_markers_is_refused():
    with pytest.raises(ValueError, match="results:begin"):
        replace_block("# a README without its results table\n", f"{BEGIN}\n{END}")

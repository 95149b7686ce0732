"""Tests for specviz.study.work and specviz.study.cluster: the study's units in this process
and on a local Dask cluster (tiny random pair)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pandas as pd
import pytest

from specviz.study.cluster import StudyCluster
from specviz.study.__main__ import main
from specviz.study.presets import NotebookRun, Preset, StudyConfigError
from specviz.study.runner import run_study
from specviz.data.store import ResultStore
from specviz.study.units import reference_units, references_from
from specviz.study.work import ModelSpec, Work, scaling_estimate

SPEC = ModelSpec("tiny", "fp32")
PRESET_03_ONLY = Preset("tiny-03", "notebook 03 only", (NotebookRun("03_chain_tree_dynamic.ipynb"),))
PROMPTS = [
    '{"question_id": 1, "category": "code", "turns": ["def add(a, b):"]}',
    '{"question_id": 2, "category": "writing", "turns": ["Write a haiku about rain."]}',
    '{"question_id": 3, "category": "qa", "turns": ["What is the capital of France?"]}',
]


@pytest.fixture(scope="module")
def cluster():
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=0,
                      dashboard_address=None) as c:
        yield c


def _prompts(n):
    from specviz.data.prompts import Prompt

    return [Prompt(i, "code", (f"def f{i}(x):\n    return x * {i}",)) for i in range(1, n + 1)]


def test_cluster_results_equal_this_process(cluster, tmp_path):
    prompts = _prompts(4)
    here, there = ResultStore(None), ResultStore.open(tmp_path, "refs")
    Work(SPEC).run(here, reference_units(SPEC, prompts, 12))
    work = Work(SPEC, scheduler=cluster.scheduler_address, threads=1, out_dir=tmp_path)
    try:
        ids = work.run(there, reference_units(SPEC, prompts, 12), label="references")
        assert work.executed == 4
        assert here.frame(ids).drop(columns="wall_s").equals(there.frame(ids).drop(columns="wall_s"))
        # timing units run one at a time, all on one worker
        times_store = ResultStore(None)
        work.run(times_store, reference_units(SPEC, prompts, 6), label="timed", timing=True)
        times = work.times.frame()
        assert times[times["batch"] == "timed"]["worker"].nunique() == 1
        assert set(times[times["batch"] == "references"]["worker"]) <= set(cluster.scheduler_info["workers"])
    finally:
        work.close()


def test_killed_worker_loses_no_unit_and_a_rerun_does_nothing(cluster, tmp_path):
    prompts = _prompts(10)
    units = reference_units(SPEC, prompts, 48)
    store = ResultStore.open(tmp_path, "refs")
    work = Work(SPEC, scheduler=cluster.scheduler_address, threads=1, out_dir=tmp_path)
    pids = work.client.run(os.getpid)
    killed = []

    def kill_one():
        deadline = time.monotonic() + 60
        while len(store) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(sorted(pids.values())[0], signal.SIGKILL)
        killed.append(len(store))

    killer = threading.Thread(target=kill_one)
    killer.start()
    try:
        work.run(store, units)
    finally:
        killer.join()
    assert killed and killed[0] < 10  # the kill came while units were still running
    reloaded = ResultStore.open(tmp_path, "refs")  # a unit stored twice would be an error here
    assert sorted(reloaded.units) == sorted(u.id for u in units)
    assert work.executed == 10
    again = Work(SPEC, scheduler=cluster.scheduler_address, threads=1, out_dir=tmp_path)
    try:
        again.run(reloaded, units)
        assert again.executed == 0
    finally:
        again.close()
        work.close()
    serial = _serial(units)
    for qid, ref in references_from(reloaded, SPEC, prompts, 48).items():
        assert ref.output_ids == references_from(serial, SPEC, prompts, 48)[qid].output_ids


def _serial(units):
    store = ResultStore(None)
    Work(SPEC).run(store, units)
    return store


def test_study_on_two_workers_gives_the_serial_tables(tmp_path):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    params = dict(models="tiny", self_spec_layers=1, layer_sweep=[1], max_new_tokens=8, budgets=[4],
                  sampled_budget=4, sampled_prompts=2, cross_check=True)
    preset = Preset("tiny", "notebook 03 on the tiny pair", (NotebookRun("03_chain_tree_dynamic.ipynb", params),))
    serial = run_study(preset, out_dir=tmp_path / "serial", prompts=prompt_file, progress=False, log=lambda m: None)
    lines = []
    two = run_study(preset, out_dir=tmp_path / "two", prompts=prompt_file, progress=False, workers=2,
                    log=lines.append)
    assert any("dashboard" in line for line in lines)
    tables = sorted(p.name for p in (serial.out_dir / "tables").glob("*.csv"))
    assert "acceptance_steps.csv" in tables and "expected_vs_realised.csv" in tables
    for name in tables:
        a = pd.read_csv(serial.out_dir / "tables" / name)
        b = pd.read_csv(two.out_dir / "tables" / name)
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=name)
    times = ResultStore.open(two.out_dir, "unit_times").frame()
    assert times["worker"].nunique() == 2  # the units really ran on both workers
    # the same command again finds the notebook finished and starts nothing
    again = run_study(preset, out_dir=tmp_path / "two", prompts=prompt_file, progress=False, workers=2,
                      log=lambda m: None)
    assert [o.status for o in again.outcomes] == ["skipped"]


def test_scaling_estimate_schedules_longest_first():
    times = pd.DataFrame({"batch": ["a"] * 4 + ["t"] * 2, "timing": [False] * 4 + [True] * 2,
                          "seconds": [4.0, 3.0, 2.0, 1.0, 5.0, 5.0]})
    est = scaling_estimate(times, [1, 2, 8], load_s=1.0).set_index("workers")
    assert est.loc[1, "predicted_s"] == 10 + 10 + 1
    assert est.loc[2, "parallel_s"] == 5.0 and est.loc[8, "parallel_s"] == 4.0
    assert est.loc[8, "timing_s"] == 10.0  # timing units never run in parallel
    assert est.loc[2, "speedup"] == pytest.approx(21 / 16)
    with pytest.raises(ValueError, match="no unit times"):
        scaling_estimate(times.iloc[:0], [1])


def test_workers_and_scheduler_are_checked(tmp_path, capsys, monkeypatch):
    import specviz.bench.auto as auto

    def no_probe(*args, **kwargs):
        raise AssertionError("auto was resolved (a probe of this machine) before the scheduler was checked")

    monkeypatch.setattr(auto, "resolve_auto", no_probe)
    monkeypatch.setattr(StudyCluster, "connect_timeout", "1s")  # nothing listens there: no need to wait 10 s
    with pytest.raises(StudyConfigError, match="not both"):
        run_study("smoke", out_dir=tmp_path, workers=2, scheduler="tcp://127.0.0.1:1")
    with pytest.raises(StudyConfigError, match="workers"):
        run_study("smoke", out_dir=tmp_path, workers=0)
    with pytest.raises(StudyConfigError, match="no Dask scheduler answers"):
        run_study(PRESET_03_ONLY, out_dir=tmp_path, scheduler="tcp://127.0.0.1:9")
    assert main(["--only", "03", "--out", str(tmp_path), "--scheduler", "tcp://127.0.0.1:9"]) == 2
    assert "no Dask scheduler answers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workers", "0"])
    assert "--workers must be >= 1" in capsys.readouterr().err

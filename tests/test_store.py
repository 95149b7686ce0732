"""Tests for specviz.data.store: tables written atomically, and a unit store that resumes."""

from __future__ import annotations

import json
import os
import stat

import pandas as pd
import pytest

from specviz.data.store import ResultFileError, ResultStore, atomic_write_text, load_table, save_table, table_paths


def test_save_and_load_table_round_trip(tmp_path):
    df = pd.DataFrame({"strategy": ["chain", "tree"], "budget": [4, 8], "tau": [2.5, 3.25]})
    paths = save_table(df, "acceptance", tmp_path)
    assert paths == table_paths("acceptance", tmp_path)
    assert paths.csv == tmp_path / "tables" / "acceptance.csv"
    pd.testing.assert_frame_equal(load_table("acceptance", tmp_path), df)
    pd.testing.assert_frame_equal(pd.read_csv(paths.csv), df)
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == ["acceptance.csv", "acceptance.parquet"]


def test_saved_files_get_normal_permissions(tmp_path):
    paths = save_table(pd.DataFrame({"a": [1]}), "t", tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    for p in (paths.csv, paths.parquet):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("name", ["", "a/b", "../x", "t.csv", " spaced"])
def test_bad_table_names_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="name"):
        save_table(pd.DataFrame({"a": [1]}), name, tmp_path)


def test_save_table_checks_its_arguments(tmp_path):
    with pytest.raises(TypeError, match="DataFrame"):
        save_table([1, 2], "t", tmp_path)
    with pytest.raises(ValueError, match="out_dir"):
        save_table(pd.DataFrame({"a": [1]}), "t", "")
    with pytest.raises(FileNotFoundError, match="missing"):
        load_table("absent", tmp_path)


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "sub" / "f.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["f.txt"]


def test_store_resumes_from_disk(tmp_path):
    store = ResultStore.open(tmp_path, "units")
    assert store.path == tmp_path / "partial" / "units.jsonl"
    store.add("chain/q1", {"accepted": 3, "drafted": 8})
    store.add("chain/q2", [{"accepted": 1, "drafted": 8}, {"accepted": 2, "drafted": 8}])
    again = ResultStore.open(tmp_path, "units")
    assert again.units == ("chain/q1", "chain/q2")
    assert "chain/q1" in again and "tree/q1" not in again
    assert again.rows_of("chain/q2") == [{"accepted": 1, "drafted": 8}, {"accepted": 2, "drafted": 8}]
    frame = again.frame()
    assert list(frame["unit"]) == ["chain/q1", "chain/q2", "chain/q2"]
    assert frame["accepted"].sum() == 6


def test_store_drops_a_line_cut_short_and_overwrites_it(tmp_path):
    store = ResultStore.open(tmp_path, "units")
    store.add("u1", {"x": 1})
    with open(store.path, "ab") as fh:  # an append interrupted mid-line
        fh.write(b'{"unit": "u2", "rows": [{"x"')
    resumed = ResultStore.open(tmp_path, "units")
    assert resumed.units == ("u1",)
    resumed.add("u2", {"x": 2})
    lines = store.path.read_text().splitlines()
    assert [json.loads(line)["unit"] for line in lines] == ["u1", "u2"]
    assert ResultStore.open(tmp_path, "units").units == ("u1", "u2")


def test_store_rejects_corruption_and_duplicates(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"unit": "a", "rows": []}\nnot json\n{"unit": "b", "rows": []}\n')
    with pytest.raises(ResultFileError, match="line 2"):
        ResultStore(path)
    path.write_text('{"unit": "a", "rows": []}\n{"unit": "a", "rows": []}\n')
    with pytest.raises(ResultFileError, match="twice"):
        ResultStore(path)


def test_store_add_checks_its_arguments(tmp_path):
    store = ResultStore(None)
    store.add("u", {"x": 1})
    with pytest.raises(ValueError, match="already finished"):
        store.add("u", {"x": 2})
    with pytest.raises(ValueError, match="empty"):
        store.add("", {"x": 2})
    with pytest.raises(TypeError, match="strings"):
        store.add(3, {"x": 2})
    with pytest.raises(TypeError, match="scalars"):
        store.add("v", {"x": object()})
    with pytest.raises(KeyError, match="not in the store"):
        store.rows_of("w")


def test_in_memory_store_writes_nothing(tmp_path):
    store = ResultStore.open("", "units")
    assert store.path is None
    store.add("u", {"x": 1})
    assert len(store) == 1 and list(store) == ["u"]
    assert store.frame().shape == (1, 2)
    assert ResultStore.open(None, "units").frame().columns.tolist() == ["unit"]


def test_store_accepts_numpy_and_torch_scalars(tmp_path):
    import numpy as np
    import torch

    store = ResultStore.open(tmp_path, "units")
    store.add("u", {"a": np.float64(0.5), "b": torch.tensor(3), "c": np.int64(2), "d": [np.float32(1.5)]})
    assert ResultStore.open(tmp_path, "units").rows_of("u") == [{"a": 0.5, "b": 3, "c": 2, "d": [1.5]}]

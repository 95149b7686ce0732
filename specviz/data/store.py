"""Study results on disk: tidy tables, and unit-by-unit progress that survives interruption.

The study notebooks (:mod:`specviz.study`) write everything they measure through this
module, under the run's output directory ``out_dir``:

* :func:`save_table` - a finished tidy table as ``tables/<name>.csv`` and
  ``tables/<name>.parquet``, each written to a temporary file and renamed into place,
  so a reader never sees half a table; :func:`load_table` reads it back;
* :class:`ResultStore` - an append-only JSON Lines file ``partial/<name>.jsonl`` with
  one line per finished *unit* of work (e.g. one strategy on one prompt). A long
  notebook asks the store which units are done, runs only the others and adds each
  as it finishes; an interrupted run loses at most the unit in flight, and re-running
  the notebook picks up where it stopped.

A notebook run without an output directory (``out_dir=""``, the committed notebooks'
default) gets an in-memory store and writes no tables.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import pandas as pd

__all__ = [
    "TablePaths",
    "ResultStore",
    "ResultFileError",
    "save_table",
    "load_table",
    "table_paths",
    "atomic_write_text",
    "atomic_write_bytes",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name.endswith((".csv", ".parquet", ".jsonl")):
        raise ValueError(
            f"{kind} name must be letters, digits, '_', '-' or '.' (no extension, no path), got {name!r}"
        )
    return name


def _check_out_dir(out_dir: str | os.PathLike) -> Path:
    if not str(out_dir).strip():
        raise ValueError("out_dir must name a directory, got an empty string")
    return Path(out_dir)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a
    rename, so the file is either the old one or the complete new one."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`atomic_write_text` for bytes (e.g. a gzip'd file)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        _give_file_mode(Path(tmp), dest)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def _give_file_mode(tmp: Path, dest: Path) -> None:
    """Give ``tmp`` the permissions ``dest`` has (or a new file would get): temporary
    files are created owner-only, which a rename would otherwise carry over."""
    if dest.exists():
        mode = dest.stat().st_mode & 0o777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(tmp, mode)


@dataclass(frozen=True)
class TablePaths:
    """Where one saved table lives."""

    csv: Path
    parquet: Path


def table_paths(name: str, out_dir: str | os.PathLike) -> TablePaths:
    """The two files :func:`save_table` writes for ``name`` under ``out_dir/tables``."""
    _check_name("table", name)
    base = _check_out_dir(out_dir) / "tables"
    return TablePaths(base / f"{name}.csv", base / f"{name}.parquet")


def save_table(df: pd.DataFrame, name: str, out_dir: str | os.PathLike) -> TablePaths:
    """Write a tidy table as CSV and Parquet under ``out_dir/tables``, each atomically.

    Args:
        df: the table; one row per observation, one column per variable.
        name: file stem, e.g. ``"acceptance_by_budget"``.
        out_dir: the run's output directory.

    Raises:
        TypeError: if ``df`` is not a DataFrame.
        ValueError: on a bad name or an empty ``out_dir``.
    """
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"save_table needs a pandas DataFrame, got {type(df).__name__}")
    paths = table_paths(name, out_dir)
    paths.csv.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.csv, df.to_csv(index=False))
    fd, tmp = tempfile.mkstemp(dir=paths.parquet.parent, prefix=f".{paths.parquet.name}.", suffix=".tmp")
    os.close(fd)
    try:
        df.to_parquet(tmp, index=False)
        _give_file_mode(Path(tmp), paths.parquet)
        os.replace(tmp, paths.parquet)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return paths


def load_table(name: str, out_dir: str | os.PathLike) -> pd.DataFrame:
    """Read a table written by :func:`save_table` (from its Parquet file).

    Raises:
        FileNotFoundError: naming the missing file and the notebook run that should
            have written it.
    """
    path = table_paths(name, out_dir).parquet
    if not path.exists():
        raise FileNotFoundError(
            f"no table {name!r} in {Path(out_dir)}: {path} is missing (run the notebook that writes it first)"
        )
    return pd.read_parquet(path)


class ResultFileError(ValueError):
    """A result store file that is not a valid sequence of unit records."""


def _plain(value: Any) -> Any:
    """JSON-ready version of a cell value: numpy/torch scalars become Python numbers."""
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"result values must be scalars or lists of scalars, got {type(value).__name__}: {value!r}")


class ResultStore:
    """Finished units of work, appended one JSON line per unit, keyed by a unit id.

    Each line is ``{"unit": <id>, "rows": [{column: value, ...}, ...]}``: everything a
    unit produced, written with one ``write`` and flushed to disk before :meth:`add`
    returns. A line cut short by an interruption (the last one, without its newline)
    is ignored on loading and overwritten by the next :meth:`add`; any other
    unreadable line is an error, as is the same unit twice.

    Args:
        path: the ``.jsonl`` file (created with its directory on the first ``add``);
            None keeps everything in memory (nothing survives the process).

    Example::

        store = ResultStore.open(out_dir, "acceptance_units")
        for prompt in prompts:
            unit = f"chain/k=4/q{prompt.question_id}"
            if unit in store:
                continue
            store.add(unit, run_one(prompt))      # a row dict or a list of row dicts
        table = store.frame()
    """

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = None if path is None else Path(path)
        self._units: dict[str, list[dict[str, Any]]] = {}
        self._valid_bytes = 0  # length of the file's intact prefix
        if self.path is not None and self.path.exists():
            self._load()

    @classmethod
    def open(cls, out_dir: str | os.PathLike | None, name: str) -> "ResultStore":
        """The store ``out_dir/partial/<name>.jsonl``, or an in-memory one when
        ``out_dir`` is None or empty (a notebook run outside the study pipeline)."""
        _check_name("result store", name)
        if out_dir is None or not str(out_dir).strip():
            return cls(None)
        return cls(Path(out_dir) / "partial" / f"{name}.jsonl")

    def _load(self) -> None:
        assert self.path is not None
        data = self.path.read_bytes()
        offset = 0
        lineno = 0
        while offset < len(data):
            lineno += 1
            end = data.find(b"\n", offset)
            if end == -1:
                # An unterminated last line is an append cut short: not a finished unit.
                break
            line = data[offset:end]
            if line.strip():
                try:
                    record = json.loads(line)
                    unit, rows = record["unit"], record["rows"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ResultFileError(f"{self.path}, line {lineno}: not a unit record ({err})") from None
                if not isinstance(unit, str) or not isinstance(rows, list):
                    raise ResultFileError(f"{self.path}, line {lineno}: not a unit record")
                if unit in self._units:
                    raise ResultFileError(f"{self.path}, line {lineno}: unit {unit!r} appears twice")
                self._units[unit] = rows
            offset = end + 1
        self._valid_bytes = offset

    def __contains__(self, unit: object) -> bool:
        return unit in self._units

    def __len__(self) -> int:
        return len(self._units)

    def __iter__(self) -> Iterator[str]:
        return iter(self._units)

    @property
    def units(self) -> tuple[str, ...]:
        """Ids of the finished units, in the order they finished."""
        return tuple(self._units)

    def rows_of(self, unit: str) -> list[dict[str, Any]]:
        """The rows one finished unit produced.

        Raises:
            KeyError: naming the unit if it is not finished.
        """
        if unit not in self._units:
            raise KeyError(f"unit {unit!r} is not in the store ({len(self._units)} units finished)")
        return [dict(r) for r in self._units[unit]]

    def add(self, unit: str, rows: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> None:
        """Record ``unit`` as finished with its rows (one mapping or several).

        Raises:
            TypeError: on a non-string unit id or a value that is not a scalar.
            ValueError: on an empty unit id or a unit that is already finished.
        """
        if not isinstance(unit, str):
            raise TypeError(f"unit ids are strings, got {type(unit).__name__}: {unit!r}")
        if not unit:
            raise ValueError("unit id must not be empty")
        if unit in self._units:
            raise ValueError(f"unit {unit!r} is already finished; check `unit in store` before running it")
        batch = [rows] if isinstance(rows, Mapping) else list(rows)
        clean = []
        for row in batch:
            if not isinstance(row, Mapping):
                raise TypeError(f"rows must be mappings of column -> value, got {type(row).__name__}")
            clean.append({str(k): _plain(v) for k, v in row.items()})
        if self.path is not None:
            line = json.dumps({"unit": unit, "rows": clean}, allow_nan=True) + "\n"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "r+b" if self.path.exists() else "wb") as fh:
                # Drop a line an earlier interruption cut short, then append in one write.
                fh.truncate(self._valid_bytes)
                fh.seek(self._valid_bytes)
                fh.write(line.encode("utf-8"))
                fh.flush()
                os.fsync(fh.fileno())
                self._valid_bytes = fh.tell()
        self._units[unit] = clean

    def rows(self, units: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every row of every finished unit with a ``unit`` column: in finishing order, or
        of ``units`` only, in that order (a result that does not depend on which unit of a
        parallel run finished first).

        Raises:
            KeyError: naming the first of ``units`` that is not finished.
        """
        order = self._units if units is None else list(units)
        for unit in order:
            if unit not in self._units:
                raise KeyError(f"unit {unit!r} is not in the store ({len(self._units)} units finished)")
        return [{"unit": unit, **row} for unit in order for row in self._units[unit]]

    def frame(self, units: Iterable[str] | None = None) -> pd.DataFrame:
        """:meth:`rows` as a DataFrame (NaN where a unit's rows lack a column)."""
        rows = self.rows(units)
        if not rows:
            return pd.DataFrame({"unit": pd.Series(dtype=str)})
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        where = "memory" if self.path is None else str(self.path)
        return f"ResultStore({where}, {len(self._units)} units)"

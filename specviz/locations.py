"""Paths anchored at the repository root, so notebooks and scripts never depend on the
working directory they were started from.

* ``DATA_DIR`` - committed inputs (prompt sets, reference tables, README pictures);
* ``OUTPUTS_DIR`` - what runs write (figures, tables, screenshots); created on demand;
* ``NOTEBOOKS_DIR`` - the study notebooks.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO_ROOT", "DATA_DIR", "OUTPUTS_DIR", "NOTEBOOKS_DIR", "outputs_dir", "output_path"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
OUTPUTS_DIR = REPO_ROOT / "outputs"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"


def outputs_dir(*parts: str) -> Path:
    """``OUTPUTS_DIR`` (or a sub-directory of it), created if missing."""
    path = OUTPUTS_DIR.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def output_path(name: str | Path) -> Path:
    """Where a run output called ``name`` goes: a relative name lands under ``OUTPUTS_DIR``
    (parent directories created), an absolute path is used as it is (its parent created).

    Raises:
        ValueError: on an empty name.
    """
    if not str(name).strip():
        raise ValueError("an output file name must not be empty")
    path = Path(name)
    if not path.is_absolute():
        path = OUTPUTS_DIR / path
    path.parent.mkdir(parents=True, exist_ok=True)
    return path

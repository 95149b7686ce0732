"""A study notebook's parameters: what it declares, what a run gives it, and its fingerprint.

:func:`declared_parameters` reads a notebook's ``parameters`` cell (through papermill),
:func:`notebook_parameters` gives a notebook of a preset its parameters for a run (the
preset's plus the run's directory, prompts, limit and weight modes), and
:func:`notebook_fingerprint` hashes what decides its results, so the runner
(:mod:`specviz.study.runner`) can skip a notebook that finished with the same inputs. The
checks of the run's own options (:func:`check_prompts`, :func:`check_limit`,
:func:`weight_mode_name`) raise :class:`~specviz.study.presets.StudyConfigError`.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from specviz.study.presets import NotebookRun, StudyConfigError
from specviz.validate import check_int

__all__ = [
    "declared_parameters",
    "default_value",
    "notebook_parameters",
    "notebook_fingerprint",
    "check_prompts",
    "check_limit",
    "weight_mode_name",
]


def declared_parameters(notebook: str | Path) -> dict[str, dict[str, Any]]:
    """The parameters a notebook's ``parameters`` cell declares: name -> papermill's
    description (``inferred_type_name``, ``default``, ``help``)."""
    import papermill

    return {name: dict(info) for name, info in papermill.inspect_notebook(str(notebook)).items()}


def default_value(info: Mapping[str, Any]) -> Any:
    """The value of a declared parameter's default (an entry of :func:`declared_parameters`),
    or None when the default is not a Python literal."""
    try:
        return ast.literal_eval(str(info.get("default")))
    except (ValueError, SyntaxError):
        return None


def check_prompts(prompts: str | Path | None) -> Path | None:
    """The resolved path of a Spec-Bench-format prompt file that loads (None for None).

    Raises:
        StudyConfigError: no such file, or one :func:`~specviz.data.prompts.load_prompts` rejects.
    """
    if prompts is None:
        return None
    from specviz.data.prompts import PromptFileError, load_prompts

    path = Path(prompts).expanduser().resolve()
    if not path.is_file():
        raise StudyConfigError(f"prompts file not found: {path} (pass a Spec-Bench-format .jsonl file)")
    try:
        load_prompts(path)
    except PromptFileError as err:
        raise StudyConfigError(f"cannot use the prompts file: {err}") from None
    return path


def check_limit(limit: int | None) -> int | None:
    """``limit`` (prompts per run) checked to be a positive int, or None.

    Raises:
        StudyConfigError: anything else.
    """
    if limit is None:
        return None
    return check_int("limit", limit, error=StudyConfigError, note="(prompts per run)")


def notebook_parameters(run: NotebookRun, declared: Mapping[str, Any], out_dir: Path, *,
                        prompts: Path | None = None, limit: int | None = None,
                        dtype: str | None = None, draft_dtype: str | None = None) -> dict[str, Any]:
    """The papermill parameters for ``run``: the preset's, plus ``out_dir`` and (for
    notebooks that declare them) ``prompts_path``, ``prompt_limit``, ``dtype`` (the
    weight mode of the real models) and ``draft_dtype`` (the draft's, where it differs).

    Raises:
        StudyConfigError: if the preset sets a parameter the notebook does not declare.
    """
    unknown = sorted(set(run.parameters) - set(declared))
    if unknown:
        raise StudyConfigError(
            f"{run.notebook} has no parameter(s) {unknown}; it declares {sorted(declared)}"
        )
    params = dict(run.parameters)
    if "out_dir" in declared:
        params["out_dir"] = str(out_dir)
    if prompts is not None and "prompts_path" in declared:
        params["prompts_path"] = str(prompts)
    if limit is not None and "prompt_limit" in declared:
        params["prompt_limit"] = limit
    if dtype is not None and "dtype" in declared:
        params["dtype"] = dtype
    if draft_dtype is not None and "draft_dtype" in declared:
        params["draft_dtype"] = draft_dtype
    return params


def notebook_fingerprint(notebook: Path, params: Mapping[str, Any], prompts: Path | None) -> str:
    """Hash of what decides a notebook's results: its cells' source, its parameters
    (not where it writes) and the contents of the prompt file it reads."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    h = hashlib.sha256()
    for cell in nb.cells:
        h.update(cell.cell_type.encode())
        h.update(b"\0" + cell.source.encode() + b"\0")
    payload = {k: v for k, v in params.items() if k not in ("out_dir", "scheduler")}
    h.update(json.dumps(payload, sort_keys=True, default=str).encode())
    if prompts is not None and "prompts_path" in params:
        h.update(hashlib.sha256(prompts.read_bytes()).digest())
    return h.hexdigest()


def weight_mode_name(name: str, value: str) -> str:
    """The canonical name of weight mode ``value``, given as ``name``.

    Raises:
        StudyConfigError: an unknown mode, named with ``name``.
    """
    from specviz.quant.weights import parse_weight_mode

    try:
        return parse_weight_mode(value).name
    except ValueError as exc:
        raise StudyConfigError(f"{name}: {exc}") from None

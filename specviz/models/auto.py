"""``dtype="auto"``: the fastest weight mode that passes the accuracy bar, on this machine.

Which mode is fastest depends on the CPU (bf16 units or not, AVX2's integer kernels) and the
model; which modes are accurate enough depends on the model. :func:`probe_weight_modes`
measures both once per machine and model and keeps them in the cache
(``<cache>/auto/<machine>.json``, written after every mode, so an interrupted probe resumes;
a ``w8a8-token`` entry records whether its compiled operator ran and is measured again when
that changes):

* **cost**: one forward of 1 and of 4 new tokens after a short prefix
  (:func:`specviz.bench.cost.forward_cost_curve`): a decode step and a small verification;
* **accuracy**: teacher-forced greedy top-1 agreement with fp32 on the continuations of a few
  of the project's prompts, fed 4 tokens per forward (:mod:`specviz.checks.accuracy`), and the
  bar: bf16's agreement minus :data:`~specviz.checks.accuracy.LOSSY_MARGIN`.

:func:`choose_weight_mode` then picks the mode with the smallest cost of a decode step plus a
4-token verification among those not labelled lossy (fp32, the reference, always qualifies).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import torch

__all__ = ["AUTO_CANDIDATES", "machine_key", "probe_weight_modes", "recorded_probes", "choose_weight_mode",
           "is_auto", "resolve_auto"]

#: the modes ``auto`` considers, where their kernels exist on the device
AUTO_CANDIDATES: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "w8a8", "w8a8-token")


def machine_key() -> str:
    """This machine's probe file: CPU model, core count and torch version (a file-name-safe
    slug; the host name is left out, so identical CI machines share it). Each probe in it
    also records the torch thread count it ran with."""
    from specviz.study.work import cpu_label

    raw = f"{cpu_label()}-torch{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9.]+", "-", raw).strip("-")


def _probe_path(cache) -> Path:
    from specviz.models.loading import cache_dir

    return cache_dir(cache) / "auto" / f"{machine_key()}.json"


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save(path: Path, data: dict) -> None:
    from specviz.study.store import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1))


def _kernel(mode: str) -> str:
    """The code a mode's products run where it can differ between processes on one machine:
    for ``w8a8-token``, "compiled operator" or "PyTorch code" (as
    :func:`specviz.models.extension.fused_op_status` says); "" for every other mode. A probe
    recorded with other code is measured again."""
    if mode != "w8a8-token":
        return ""
    from specviz.models.extension import fused_op_status

    return "compiled operator" if fused_op_status() == "compiled operator" else "PyTorch code"


def probe_weight_modes(name, modes: Sequence[str] | None = None, *, cache: str | os.PathLike | None = None,
                       prompts: int = 7, tokens: int = 64, prefix_len: int = 200, repeats: int = 3,
                       log: Callable[[str], None] = print) -> pd.DataFrame:
    """Cost and accuracy of each weight mode of model ``name`` on this machine (CPU), measured
    the first time and read from the cache afterwards.

    Args:
        name: a built-in name, a local directory or a Hub id (as :func:`load_model` takes it).
        modes: the modes to probe (default :data:`AUTO_CANDIDATES`); fp32 and bf16 are always
            probed, as the reference and the bar.
        cache: cache directory (as in :func:`load_model`).
        prompts, tokens: the accuracy measurement: the first ``prompts`` prompts of the shipped
            set (one per category at 7), ``tokens`` fp32 greedy tokens each.
        prefix_len, repeats: the cost measurement (prefix tokens in the cache, timed repeats).
        log: progress messages.

    Returns:
        One row per mode: ``weight_mode, t1_ms, t4_ms, step_ms`` (t1 + t4), ``agreement``,
        ``bar``, ``lossy``, ``machine``, sorted by ``step_ms``. A probe is kept per torch
        thread count (costs depend on it).

    Raises:
        ValueError: an unknown mode, or a name :func:`load_model` cannot load.
    """
    from specviz.bench.cost import forward_cost_curve
    from specviz.checks.accuracy import (
        accuracy_bar,
        agreement_by_category,
        agreement_table,
        reference_texts,
    )
    from specviz.models.loading import load_model
    from specviz.models.weights import WEIGHT_MODES
    from specviz.study.prompts import load_prompts

    wanted = list(dict.fromkeys(["fp32", "bf16", *(modes if modes is not None else AUTO_CANDIDATES)]))
    unknown = [m for m in wanted if m not in WEIGHT_MODES]
    if unknown:
        raise ValueError(f"unknown weight modes {unknown}; choose from {', '.join(WEIGHT_MODES)}")
    path = _probe_path(cache)
    data = _load(path)
    key = f"{name}|threads={torch.get_num_threads()}|prompts={prompts}|tokens={tokens}|prefix={prefix_len}"
    entry = data.setdefault(key, {})
    texts = None
    for mode in wanted:
        kernel = _kernel(mode)
        if mode in entry and entry[mode].get("kernel", "") == kernel:
            continue
        if mode in entry:
            log(f"auto: {mode} was probed with {entry[mode].get('kernel') or 'its PyTorch code'}, it now runs "
                f"{kernel or 'its PyTorch code'}: probing it again")
        if texts is None:
            log(f"auto: fp32 reference continuations of {prompts} prompts x {tokens} tokens ({name})")
            reference = load_model(name, "fp32", cache, device="cpu")
            texts = reference_texts(reference, load_prompts(limit=prompts), max_new_tokens=tokens)
            del reference
        log(f"auto: probing {mode} (cost of 1 and 4 new tokens, agreement with fp32)")
        try:
            model = load_model(name, mode, cache, device="cpu")
        except (RuntimeError, NotImplementedError) as exc:  # a kernel this build lacks
            entry[mode] = {"error": str(exc).splitlines()[0], **({"kernel": kernel} if kernel else {})}
            _save(path, data)
            continue
        curve = forward_cost_curve(model, [1, 4], prefix_len=prefix_len, repeats=repeats)
        table = agreement_table(model, texts, chunk=4)
        agreement = agreement_by_category(table)
        overall = agreement[agreement.category == "all"]["continuation_agreement"]
        entry[mode] = {"t1_ms": float(curve.median_ms.iloc[0]), "t4_ms": float(curve.median_ms.iloc[1]),
                       "agreement": float(overall.iloc[0])}
        if kernel:
            entry[mode]["kernel"] = kernel
        del model
        _save(path, data)
    rows = [{"weight_mode": m, **entry[m]} for m in wanted if "error" not in entry[m]]
    summary = pd.DataFrame([{"weight_mode": r["weight_mode"], "category": "all",
                             "continuation_agreement": r["agreement"]} for r in rows])
    bar = accuracy_bar(summary).set_index("weight_mode")
    out = pd.DataFrame(rows)
    out["step_ms"] = out["t1_ms"] + out["t4_ms"]
    out["bar"] = float(bar["bar"].iloc[0])
    out["lossy"] = [bool(bar.loc[m, "lossy"]) for m in out.weight_mode]
    out["machine"] = machine_key()
    cols = ["weight_mode", "t1_ms", "t4_ms", "step_ms", "agreement", "bar", "lossy", "machine"]
    return out[cols].sort_values("step_ms", ignore_index=True)


def recorded_probes(cache: str | os.PathLike | None = None) -> pd.DataFrame:
    """What this machine's probes recorded, without measuring anything: one row per (model
    and probe settings, mode) with ``probe, weight_mode, t1_ms, t4_ms, step_ms, agreement``
    (empty when nothing was probed here yet)."""
    rows = [{"probe": key, "weight_mode": mode, **values}
            for key, entry in _load(_probe_path(cache)).items() for mode, values in entry.items()
            if "error" not in values]
    out = pd.DataFrame(rows, columns=["probe", "weight_mode", "t1_ms", "t4_ms", "agreement"])
    out["step_ms"] = out["t1_ms"] + out["t4_ms"]
    return out


def choose_weight_mode(name, *, cache: str | os.PathLike | None = None, log: Callable[[str], None] = print,
                       **probe_kwargs) -> str:
    """The fastest mode of :func:`probe_weight_modes` that is not lossy (probing first if this
    machine has no record for ``name``)."""
    table = probe_weight_modes(name, cache=cache, log=log, **probe_kwargs)
    ok = table[~table.lossy]
    choice = str(ok.weight_mode.iloc[0])
    log(f"auto: {choice} for {name} (decode step + 4-token verification {ok.step_ms.iloc[0]:.1f} ms; "
        f"lossy here: {', '.join(table[table.lossy].weight_mode) or 'none'})")
    return choice


def is_auto(dtype) -> bool:
    """Whether ``dtype`` asks for :func:`choose_weight_mode` (the string ``"auto"``)."""
    return isinstance(dtype, str) and dtype.strip().lower() == "auto"


def resolve_auto(name, device=None, cache: str | os.PathLike | None = None,
                 log: Callable[[str], None] = print) -> str:
    """The weight mode ``"auto"`` means for model ``name`` on ``device``: bf16 on an
    accelerator (the integer modes are CPU kernels), else :func:`choose_weight_mode`.

    Raises:
        ValueError: ``name`` is not a name or path (``auto`` probes by loading the model).
    """
    from specviz.models.device import resolve_device

    if not isinstance(name, (str, os.PathLike)):
        raise ValueError("dtype='auto' needs a model name or path (it probes each weight mode by loading the "
                         f"model); got a {type(name).__name__}: pass a weight mode instead")
    if resolve_device(device).type != "cpu":
        return "bf16"
    return choose_weight_mode(str(name), cache=cache, log=log)

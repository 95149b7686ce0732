"""``dtype="auto"``: the fastest weight mode that passes the accuracy bar, on this machine.

Which mode is fastest depends on the CPU (bf16 units or not, AVX2's integer kernels) and the
model; which modes are accurate enough depends on the model. :func:`candidate_modes` reads
the instruction set and keeps the modes that can win on it (fp32, the reference, always);
:func:`probe_weight_modes` measures them once per machine and model and keeps them in the
cache (``<cache>/auto/<machine>.json``, written after every mode, so an interrupted probe
resumes; a ``w8a8-token`` entry records whether its compiled operator ran and is measured
again when that changes):

* **cost**: one forward of 1 and of 4 new tokens after a short prefix
  (:func:`specviz.bench.cost.forward_cost_curve`): a decode step and a small verification;
* **accuracy**: teacher-forced greedy top-1 agreement with fp32 on the continuations of a few
  of the project's prompts, fed 4 tokens per forward (:mod:`specviz.checks.accuracy`), and the
  bar: bf16's agreement minus :data:`~specviz.checks.accuracy.LOSSY_MARGIN`. Where bf16 is
  not a candidate its agreement is still measured (the fp32 reference cast to bf16,
  not timed), so the bar means the same on every machine. fp32's own agreement is 1 by
  definition and not measured (its choices fed 4 at a time measured 1.000 in every probe
  recorded).

The probe loads the fp32 reference once (its continuations and its own cost, then cast to
bf16 in place for bf16's agreement) and every other mode by name through
:func:`~specviz.models.loading.load_model`, so a built-in model's conversion lands in the
model cache and the study's own load of the chosen mode reads it. The reference's
continuations are decoded all prompts together (one forward a token for every prompt: on a
CPU, where a one-token forward is bound by reading the weights, several times faster than
one prompt at a time). Every stage logs lines with the time left (every 16 tokens of the
continuations, every prompt of an agreement), and a step that runs longer than
:data:`_BEAT_S` seconds without a line (a conversion, a slow prompt) says that it is still
running.

:func:`choose_weight_mode` then picks the mode with the smallest cost of a decode step plus a
4-token verification among those not labelled lossy (fp32, the reference, always qualifies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pandas as pd
import torch

from specviz.data.machine import cpu_flags, machine_key
from specviz.quant.weights import is_auto

__all__ = ["AUTO_CANDIDATES", "candidate_modes", "fallback_modes", "probe_weight_modes", "recorded_probes",
           "choose_weight_mode", "is_auto", "machine_key", "resolve_auto"]

#: every mode ``auto`` can pick on a CPU: fp32, and bf16 and w8a8-token where the instruction
#: set runs them fast (:func:`candidate_modes` says where)
AUTO_CANDIDATES: tuple[str, ...] = ("fp32", "bf16", "w8a8-token")

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # native bf16 dot products
_AVX2_FLAGS = ("avx2", "avx512f")  # fbgemm's x86 int8 kernels


def candidate_modes(flags: Iterable[str] | None = None) -> tuple[tuple[str, ...], str]:
    """The weight modes ``auto`` measures on a CPU with instruction-set ``flags`` (default
    :func:`~specviz.data.machine.cpu_flags`), and why, in one line for the probe's log.

    * **fp32**, always: the reference. Its greedy continuations are what every agreement is
      measured on, and it qualifies whatever the bar.
    * **bf16**, only with native bf16 arithmetic (``avx512_bf16`` or ``amx_bf16``), and
      where ``avx512_vnni`` runs w8a8-token's VNNI kernel too, only if w8a8-token misses the
      bar (:func:`fallback_modes`): there w8a8-token's decode step plus 4-token verification
      cost about a third of bf16's on both such CPUs probed (a 2-core AVX512-BF16 EPYC: 131
      against 368 ms for the 1.5B; a 2-core AMX Xeon: 82 against 256 ms a decode step). Without
      it each bf16 product converts to fp32 and back, and a forward of 4 tokens costs 2.4
      one-token forwards (the AVX2 and the VNNI machines' probes): its decode step plus
      4-token verification cost 4 times w8a8-token's there, so it cannot win where
      w8a8-token runs and passes the bar (where w8a8-token is lossy, as for the 0.5B on the
      VNNI machine, bf16 and fp32 were within 10% of each other). Its agreement is
      measured anyway, untimed, because it sets the bar.
    * **w8a8-token**, with AVX2 or better (``avx2``, ``avx512f``): its products run fbgemm's
      x86 int8 kernels, and specviz's VNNI kernel where ``avx512_vnni`` exists. It was the
      fastest mode within the bar for the 1.5B target on every machine probed.
    * **fp16**, never: no fast CPU kernels. **w4a8-token**, never: a draft's mode, below the
      bar for a target (0.938 for the 1.5B).
    * int8, int4, w8a8 and fp32-wx are retired (:data:`~specviz.quant.weights.RETIRED_MODES`
      says why: slower than w8a8-token wherever both ran, or below the bar).

    With no flags (no ``flags`` line in ``/proc/cpuinfo``: not Linux on x86) the instruction
    set is unknown, and fp32, bf16 and w8a8-token are all measured (a mode whose kernel is
    missing is recorded as failed). ``probe_weight_modes(modes=...)`` measures any modes.

    Raises:
        ValueError: ``flags`` is one string instead of a collection of flag names.
    """
    if isinstance(flags, (str, bytes)):
        raise ValueError(f"flags must be a collection of flag names such as {{'avx2'}}, not the string {flags!r}")
    flags = frozenset(cpu_flags() if flags is None else flags)
    if not flags:
        return ("fp32", "bf16", "w8a8-token"), "instruction set unknown (no CPU flags): measuring fp32, bf16 and w8a8-token"
    modes, why = ["fp32"], ["fp32: the reference"]
    native = [f for f in _BF16_FLAGS if f in flags]
    if native and fallback_modes(flags):
        why.append(f"bf16: native bf16 ({', '.join(native)}), timed only if w8a8-token misses the bar "
                   "(the VNNI kernel's step costs about a third of bf16's)")
    elif native:
        modes.append("bf16")
        why.append(f"bf16: native bf16 ({', '.join(native)})")
    else:
        why.append("bf16 untimed: no avx512_bf16/amx_bf16, its products emulated (its agreement sets the bar)")
    if any(f in flags for f in _AVX2_FLAGS):
        modes.append("w8a8-token")
        why.append(f"w8a8-token: {'the VNNI kernel' if 'avx512_vnni' in flags else 'fbgemm AVX2 kernels'}")
    else:
        why.append("no w8a8-token: no AVX2 for fbgemm's int8 kernels")
    why.append("fp16, w4a8-token: never (no fast CPU kernels; a draft's mode)")
    return tuple(modes), "; ".join(why)


def fallback_modes(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """The modes ``auto`` times on a CPU with ``flags`` only where w8a8-token misses the
    accuracy bar (or cannot run): bf16 where the CPU has both native bf16 and AVX-512 VNNI
    (:func:`candidate_modes` says why)."""
    flags = frozenset(cpu_flags() if flags is None else flags)
    native = any(f in flags for f in _BF16_FLAGS)
    return ("bf16",) if native and "avx512_vnni" in flags and any(f in flags for f in _AVX2_FLAGS) else ()


def _w8a8_misses(entry: dict) -> bool:
    """Whether the probe's w8a8-token record fails (an error, or agreement below the bar)."""
    got = entry.get("w8a8-token", {})
    if "error" in got:
        return True
    return "t1_ms" in got and bool(_verdict(entry, ["w8a8-token"]).lossy.iloc[0])


def _probe_path(cache) -> Path:
    from specviz.models.loading import cache_dir

    return cache_dir(cache) / "auto" / f"{machine_key()}.json"


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save(path: Path, data: dict) -> None:
    from specviz.data.store import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1))


def _kernel(mode: str) -> str:
    """The code a mode's products run where it can differ between processes on one machine:
    for ``w8a8-token``, "compiled operator" or "PyTorch code" (as
    :func:`specviz.quant.extension.fused_op_status` says); "" for every other mode. A probe
    recorded with other code is measured again."""
    if mode != "w8a8-token":
        return ""
    from specviz.quant.extension import fused_op_status

    return "compiled operator" if fused_op_status() == "compiled operator" else "PyTorch code"


def _stale(entry: dict, mode: str) -> bool:
    """Whether ``mode`` must be measured: not recorded, recorded for the bar only (no
    cost), or recorded with other code (:func:`_kernel`)."""
    got = entry.get(mode)
    if got is None or ("t1_ms" not in got and "error" not in got):
        return True
    return got.get("kernel", "") != _kernel(mode)


#: seconds of silence after which a long step (a prompt's continuation, a conversion) says it still runs
_BEAT_S = 20.0


@contextlib.contextmanager
def _beat(log: Callable[[str], None], what: str, pace: float | Callable[[], float | None] | None = None):
    """Log ``auto: <what>: still running after <s> s`` every :data:`_BEAT_S` seconds while
    the block runs (with the seconds left when ``pace``, this step's expected length or a
    function that says the seconds left, is known), so that no step leaves the terminal
    silent for long."""
    stop, start = threading.Event(), time.perf_counter()

    def beat():
        while not stop.wait(_BEAT_S):
            spent = time.perf_counter() - start
            rest = pace() if callable(pace) else None if pace is None else max(pace - spent, 0)
            left = "" if rest is None else f", about {rest:.0f} s left at the pace so far"
            log(f"auto: {what}: still running after {spent:.0f} s{left}")

    thread = threading.Thread(target=beat, name="auto-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _seconds_left(done: int, total: int, start: float) -> float:
    """Seconds the ``total - done`` items left take at the pace of the ``done`` (at least one)
    since ``start``."""
    return (time.perf_counter() - start) / done * (total - done)


def _progress(what: str, done: int, total: int, start: float) -> str:
    """``auto: <what> <done>/<total>: <s> s, about <s> s left`` (the rest at the pace so far)."""
    spent = time.perf_counter() - start
    return f"auto: {what} {done}/{total}: {spent:.0f} s, about {_seconds_left(done, total, start):.0f} s left"


class _Run:
    """One probe's measurements. The fp32 reference is loaded once, for the continuations,
    its own cost and bf16's agreement (cast in place), and let go before any other mode
    loads."""

    def __init__(self, name, cache, settings: dict, log, entry: dict, save: Callable[[], None]):
        self.name, self.cache, self.log, self.entry, self.save = name, cache, log, entry, save
        self.prompts, self.tokens = settings["prompts"], settings["tokens"]
        self.prefix_len, self.repeats = settings["prefix_len"], settings["repeats"]
        self.reference = self.texts = None

    def reference_texts(self) -> list:
        """The fp32 reference's greedy continuations (loading it), every prompt in one batch, a
        progress line every 16 tokens."""
        if self.texts is not None:
            return self.texts
        from specviz.checks.accuracy import reference_texts
        from specviz.data.prompts import load_prompts
        from specviz.models.loading import load_model

        start = time.perf_counter()
        self.log(f"auto: fp32 reference: loading {self.name}")
        with _beat(self.log, "fp32 reference: loading"):
            self.reference = load_model(self.name, "fp32", self.cache, device="cpu")
        chosen = load_prompts(limit=self.prompts)
        together = len(chosen) > 1
        what = (f"fp32 reference continuations ({len(chosen)} prompts decoded together)" if together
                else "fp32 reference continuation (1 prompt)")
        self.log(f"auto: fp32 reference: loaded in {time.perf_counter() - start:.0f} s; greedy continuations of "
                 f"{len(chosen)} prompts x {self.tokens} tokens{', decoded together' if together else ''}")
        start, done = time.perf_counter(), [0]

        def left() -> float | None:  # seconds left at the pace so far (None before the first token, after the last)
            return _seconds_left(done[0], self.tokens, start) if 0 < done[0] < self.tokens else None

        def progress(step: int, steps: int) -> None:
            done[0] = step
            if step % 16 == 0 or step == steps:
                self.log(_progress(f"{what}: token", step, steps, start))

        with _beat(self.log, what, left):
            texts = reference_texts(self.reference, chosen, max_new_tokens=self.tokens, batch_size=len(chosen),
                                    progress=progress)
        self.texts = texts
        return texts

    def agreement(self, model, what: str) -> float:
        """``model``'s pooled continuation agreement with the reference, a line a prompt."""
        from specviz.checks.accuracy import agreement_by_category, agreement_table

        texts = self.reference_texts()
        self.log(f"auto: {what}: agreement with fp32 on {len(texts)} prompts (4 tokens per forward)")
        start, tables = time.perf_counter(), []
        for i, text in enumerate(texts, 1):
            pace = (time.perf_counter() - start) / (i - 1) if i > 1 else None
            with _beat(self.log, f"{what}: agreement, prompt {i}/{len(texts)}", pace):
                tables.append(agreement_table(model, [text], chunk=4))
            self.log(_progress(f"{what}: agreement, prompt", i, len(texts), start))
        summary = agreement_by_category(pd.concat(tables, ignore_index=True))
        return float(summary[summary.category == "all"]["continuation_agreement"].iloc[0])

    def bar_agreement(self) -> None:
        """bf16's agreement, for the bar, from the reference cast to bf16 in place (untimed:
        bf16 is not a candidate here). fp32 is measured before, and the continuations are
        kept, so the fp32 model is not needed afterwards, and no copy is made."""
        self.reference_texts()
        self.log("auto: bf16 (the bar only, untimed): casting the fp32 reference to bf16")
        ref, self.reference = self.reference, None
        model = dataclasses.replace(ref, model=ref.model.to(torch.bfloat16), dtype=torch.bfloat16, weight_mode="bf16")
        self.entry["bf16"] = {"agreement": self.agreement(model, "bf16 (the bar)")}
        del ref, model
        gc.collect()
        self.save()

    def release(self) -> None:
        """Let the reference go (the continuations stay) before another mode is loaded."""
        if self.reference is not None:
            self.reference = None
            gc.collect()

    def load(self, mode: str, label: str):
        """``mode`` loaded by name (a built-in's conversion goes to the model cache, which
        the run's later loads read), or None after recording why it cannot run here."""
        from specviz.models.loading import load_model

        start = time.perf_counter()
        self.log(f"auto: {label}: loading (a converted mode's first load on this machine calibrates and converts "
                 "it, minutes for a 1.5B model; it is cached for every later load)")
        try:
            with _beat(self.log, f"{label}: loading"):
                model = load_model(self.name, mode, self.cache, device="cpu")
        except (RuntimeError, NotImplementedError) as exc:  # a kernel this build lacks
            kernel = _kernel(mode)
            self.entry[mode] = {"error": str(exc).splitlines()[0], **({"kernel": kernel} if kernel else {})}
            self.save()
            self.log(f"auto: {label}: cannot run here ({self.entry[mode]['error']})")
            return None
        self.log(f"auto: {label}: loaded in {time.perf_counter() - start:.0f} s")
        return model

    def measure(self, mode: str, label: str) -> None:
        """Cost and agreement of ``mode``, saved to the cache at once."""
        from specviz.bench.cost import forward_cost_curve

        kernel, before = _kernel(mode), self.entry.get(mode, {})
        if "t1_ms" in before or "error" in before:
            self.log(f"auto: {mode} was probed with {before.get('kernel') or 'its PyTorch code'}, it now runs "
                     f"{kernel or 'its PyTorch code'}: probing it again")
        self.log(f"auto: probing {mode} (cost of 1 and 4 new tokens, agreement with fp32)")
        if mode == "fp32" and (self.reference_texts() and self.reference is not None):
            model = self.reference
        else:
            self.release()
            model = self.load(mode, label)
            if model is None:
                return
        self.log(f"auto: {label}: timing one forward of 1 and of 4 new tokens after {self.prefix_len} "
                 f"({self.repeats} repeats)")
        with _beat(self.log, f"{label}: timing"):
            curve = forward_cost_curve(model, [1, 4], prefix_len=self.prefix_len, repeats=self.repeats)
        t1, t4 = float(curve.median_ms.iloc[0]), float(curve.median_ms.iloc[1])
        self.log(f"auto: {label}: {t1:.1f} ms for 1 token, {t4:.1f} ms for 4")
        if mode == "fp32":  # the reference's own choices, fed 4 at a time: 1.000 in every probe recorded
            agreement = 1.0
            self.log(f"auto: {label}: agreement 1 (the reference, not measured)")
        else:
            agreement = self.agreement(model, label)
        self.entry[mode] = {"t1_ms": t1, "t4_ms": t4, "agreement": agreement, **({"kernel": kernel} if kernel else {})}
        self.save()


def _wanted(modes: Sequence[str] | None) -> tuple[list[str], str]:
    """The modes to measure (fp32 first) and why: :func:`candidate_modes`, or fp32 and ``modes``."""
    from specviz.quant.weights import parse_weight_mode

    if modes is None:
        found, reason = candidate_modes()
        return list(found), reason
    if isinstance(modes, (str, bytes)):
        raise ValueError(f"modes must be a list of weight modes, e.g. [{modes!r}], not the string {modes!r}")
    names = []
    for mode in modes:
        if is_auto(mode):
            raise ValueError("modes: 'auto' is what the probe decides; list weight modes to measure")
        try:
            names.append(parse_weight_mode(mode).name)
        except ValueError as exc:
            raise ValueError(f"modes: {exc}") from None
    return list(dict.fromkeys(["fp32", *names])), "the modes asked for, and fp32, the reference"


def _verdict(entry: dict, wanted: Sequence[str]) -> pd.DataFrame:
    """The table of :func:`probe_weight_modes` for the ``wanted`` modes ``entry`` holds costs of."""
    from specviz.checks.accuracy import accuracy_bar

    timed = [m for m in wanted if "t1_ms" in entry.get(m, {})]
    scored = [m for m in entry if "agreement" in entry[m] and (m in timed or m == "bf16")]
    summary = pd.DataFrame([{"weight_mode": m, "category": "all", "continuation_agreement": entry[m]["agreement"]}
                            for m in scored], columns=["weight_mode", "category", "continuation_agreement"])
    bar = accuracy_bar(summary).set_index("weight_mode")
    out = pd.DataFrame([{"weight_mode": m, **{k: entry[m][k] for k in ("t1_ms", "t4_ms", "agreement")}}
                        for m in timed], columns=["weight_mode", "t1_ms", "t4_ms", "agreement"])
    out["step_ms"] = out["t1_ms"] + out["t4_ms"]
    out["bar"] = float(bar["bar"].iloc[0]) if len(bar) else float("nan")
    out["lossy"] = [bool(bar.loc[m, "lossy"]) for m in out.weight_mode]
    out["machine"] = machine_key()
    cols = ["weight_mode", "t1_ms", "t4_ms", "step_ms", "agreement", "bar", "lossy", "machine"]
    return out[cols].sort_values("step_ms", ignore_index=True)


def probe_weight_modes(name, modes: Sequence[str] | None = None, *, cache: str | os.PathLike | None = None,
                       prompts: int = 7, tokens: int = 64, prefix_len: int = 200, repeats: int = 3,
                       log: Callable[[str], None] = print) -> pd.DataFrame:
    """Cost and accuracy of the weight modes of model ``name`` that can win on this machine
    (CPU), measured the first time and read from the cache afterwards.

    Args:
        name: a built-in name, a local directory or a Hub id (as :func:`load_model` takes it).
        modes: the modes to measure; None (default) takes :func:`candidate_modes` of this
            CPU. fp32, the reference, is always measured; bf16's agreement always is too (it
            sets the bar), its cost only where it is measured as a mode.
        cache: cache directory (as in :func:`load_model`).
        prompts, tokens: the accuracy measurement: the first ``prompts`` prompts of the shipped
            set (one per category at 7), ``tokens`` fp32 greedy tokens each, decoded together.
        prefix_len, repeats: the cost measurement (prefix tokens in the cache, timed repeats).
        log: progress messages: the modes and why, then lines per stage with the time left
            (nothing when the cache has the answer).

    Returns:
        One row per measured mode: ``weight_mode, t1_ms, t4_ms, step_ms`` (t1 + t4),
        ``agreement``, ``bar``, ``lossy``, ``machine``, sorted by ``step_ms``. A probe is kept
        per torch thread count (costs depend on it).

    Raises:
        ValueError: an unknown or retired mode (the message says which), ``modes`` given as
            one string, a setting that is not a positive int, or a name :func:`load_model`
            cannot load.
    """
    from specviz.validate import check_int

    for arg, value in (("prompts", prompts), ("tokens", tokens), ("repeats", repeats)):
        check_int(arg, value)
    check_int("prefix_len", prefix_len, 0)
    wanted, reason = _wanted(modes)
    path = _probe_path(cache)
    data = _load(path)
    key = f"{name}|threads={torch.get_num_threads()}|prompts={prompts}|tokens={tokens}|prefix={prefix_len}"
    entry = data.setdefault(key, {})
    settings = dict(prompts=prompts, tokens=tokens, prefix_len=prefix_len, repeats=repeats)
    run = _Run(name, cache, settings, log, entry, lambda: _save(path, data))
    todo = [m for m in wanted if _stale(entry, m)]
    bar = "bf16" not in wanted and not {"agreement", "error"} & set(entry.get("bf16", {}))
    if todo or bar:
        log(f"auto: probing {name} on this machine in {', '.join(wanted)} ({reason})")
    for i, mode in enumerate(todo, 1):
        if mode != "fp32" and bar:
            run.bar_agreement()
            bar = False
        run.measure(mode, f"{mode} ({i}/{len(todo)})")
    if bar:
        run.bar_agreement()
    if modes is None:  # a fallback is timed where w8a8-token misses the bar
        for mode in fallback_modes():
            if _w8a8_misses(entry):
                wanted.append(mode)
                if _stale(entry, mode):
                    log(f"auto: w8a8-token misses the bar here: timing {mode} as well")
                    run.measure(mode, f"{mode} (the fallback)")
    run.release()
    return _verdict(entry, wanted)


def recorded_probes(cache: str | os.PathLike | None = None) -> pd.DataFrame:
    """What this machine's probes recorded, without measuring anything: one row per (model
    and probe settings, mode) with ``probe, weight_mode, t1_ms, t4_ms, step_ms, agreement``
    (empty when nothing was probed here yet; a mode measured for the bar only, bf16 on a CPU
    without bf16 units, has its agreement and no costs)."""
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

"""Library int8 products against specviz's hand-written ``w8a8-token`` kernel, in one run.

specviz keeps its hand-written int8 product (``torch.ops.specviz.w8a8_token_linear``,
:mod:`specviz.quant.extension`: its own AVX-512 VNNI kernel where the CPU has AVX-512 VNNI,
fbgemm's product elsewhere) only where it beats the library int8 paths. This module times them
on one machine, in one process, the variants interleaved in rounds (rotating order; a time
is the median over rounds, so load from other processes hits every variant alike):

* ``scope=linear``: a decoder layer's products as ``w8a8-token`` runs them (query/key/value
  fused, output, gate/up fused, down) and the LM head, on the built-in target's real
  weights and on activations captured from its fp32 forward, M = 1..8 rows (every path gets
  the same fused weights); ``max_abs_diff`` and ``rel_err`` against the fp32 product.
* ``scope=linear-sum``: per variant, the per-product medians times how often one forward
  runs each product: the linear layers of a whole forward.
* ``scope=forward`` / ``decode``: whole-model forwards of 1 and 4 tokens after a 200-token
  prefix, and greedy decoding of 32 tokens for 2 prompts, for the paths that run the model
  eagerly; top-1 agreement with fp32 (teacher-forced on its tokens) and the share of
  free-running tokens equal to fp32's.

Variants: fp32 ``nn.Linear``; specviz's layer (compiled operator, its PyTorch code, one
activation pass); PyTorch's ``quantize_dynamic`` (fbgemm and oneDNN prepacking); PT2E
(``torchao.quantization.pt2e``, ``X86InductorQuantizer`` with dynamic activations, then
``torch.compile``, which lowers to oneDNN's ``qlinear_pointwise``); torchao's
``Int8DynamicActivationInt8WeightConfig`` (per-token activations), eager and compiled. A
path that cannot run here is a row with ``status=unavailable`` and the reason. The
per-product variants are built in :mod:`specviz.bench.int8_variants`.
``ratio_vs_specviz`` is a row's median over :data:`REFERENCE`'s at the same scope, shape and
M; :func:`verdict` applies the keeping rule (keep the kernel only if it is more than 10%
faster than the best library path in the run).

    python -m specviz.bench.int8_paths --out outputs/reference/int8-paths.csv

torchao is not among specviz's requirements: once installed, importing transformers' and
peft's integrations loads it, and it prints warnings on stderr (which the notebooks' checked
outputs would catch). Install it beside this command alone, e.g. ``pip install --target
/tmp/torchao torchao==0.18.0`` and ``PYTHONPATH=/tmp/torchao``; without it its rows say why
they did not run.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from specviz.bench.int8_variants import REFERENCE, Builder, Unavailable, Variant, _env, linear_variants
from specviz.models.kvcache import crop_cache, new_cache
from specviz.models.builtin import DEFAULT_TARGET
from specviz.models.loading import load_model
from specviz.quant.extension import NO_VNNI_ENV, fused_op_status, vnni_kernel
from specviz.quant.passes import prompt_positions
from specviz.quant.weights import W8A8TokenLinear

__all__ = ["machine_label", "LinearCase", "linear_cases", "linear_variants", "time_rounds", "measure_linears",
           "measure_model", "verdict", "verdict_path", "main", "REFERENCE", "Builder", "Unavailable", "Variant"]

#: a decoder layer's products as ``w8a8-token`` computes them: name -> the fp32 model's
#: member layers (concatenated along the output), under ``model.model.layers[i]``
PRODUCTS: dict[str, tuple[str, ...]] = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                        "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
                                        "down": ("mlp.down_proj",)}
#: the same products in the ``w8a8-token`` model (a shared-input group's fused layer)
SPECVIZ_PRODUCTS = {"qkv": "self_attn.q_proj_k_proj_v_proj.layer", "o": "self_attn.o_proj",
                    "gate_up": "mlp.gate_proj_up_proj.layer", "down": "mlp.down_proj"}
PROMPTS = ("Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
           "Explain in two sentences what a binary search does and when it fails.")
_NO_EXT_ENV = "SPECVIZ_NO_EXTENSION"


def machine_label() -> dict[str, str]:
    """The CPU's model name and whether it has AVX-512 VNNI / BF16 / AMX (``/proc/cpuinfo``),
    the core count, PyTorch's version, CPU capability and threads, and the load average."""
    try:
        info = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        info = []
    name = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor())
    flags = set(next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), []))
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8")
    present = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted)
    return {"machine": f"{name}, {os.cpu_count()} cores", "cpu_flags": present,
            "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": str(torch.get_num_threads()), "loadavg_at_start": " ".join(map(str, os.getloadavg()))}


@dataclass
class LinearCase:
    """One product: fp32 weight (N, K) and bias, the ``w8a8-token`` layer computing it,
    real inputs (rows, K), and how many times one forward runs it."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    specviz: W8A8TokenLinear
    inputs: torch.Tensor
    per_forward: int = 1

    @property
    def shape(self) -> str:
        return f"{self.name} N={self.weight.shape[0]} K={self.weight.shape[1]}"


def _fused(layer: nn.Module, members: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    mods = [layer.get_submodule(m) for m in members]
    bias = None if all(m.bias is None for m in mods) else torch.cat(
        [m.bias.detach().float() if m.bias is not None else torch.zeros(m.out_features) for m in mods])
    return torch.cat([m.weight.detach().float() for m in mods]).contiguous(), bias


@torch.no_grad()
def _captured_inputs(fp32_model, ids: torch.Tensor, layer: int, rows: int) -> dict[str, torch.Tensor]:
    """The inputs of each product's first member at decoder layer ``layer`` and of the LM
    head: the last ``rows`` positions of one fp32 forward over ``ids``, {product: (rows, K)}."""
    seen, hooks = {}, []
    targets = {p: fp32_model.model.layers[layer].get_submodule(m[0]) for p, m in PRODUCTS.items()}
    targets["lm_head"] = fp32_model.lm_head
    for key, mod in targets.items():
        def hook(module, args, key=key):
            seen[key] = args[0].detach().reshape(-1, args[0].shape[-1])[-rows:].float().clone()
        hooks.append(mod.register_forward_pre_hook(hook))
    try:
        fp32_model(input_ids=ids, logits_to_keep=rows)
    finally:
        [h.remove() for h in hooks]
    return seen


def linear_cases(fp32_model, w8_model, ids: torch.Tensor, layer: int, rows: int = 8) -> list[LinearCase]:
    """The products of :data:`PRODUCTS` at decoder layer ``layer`` and the LM head, with the
    fp32 model's weights, the ``w8a8-token`` model's layers and real inputs from an fp32
    forward over ``ids``."""
    inputs = _captured_inputs(fp32_model, ids, layer, rows)
    n_layers = len(fp32_model.model.layers)
    cases = []
    for product, members in PRODUCTS.items():
        w, b = _fused(fp32_model.model.layers[layer], members)
        sv = w8_model.model.layers[layer].get_submodule(SPECVIZ_PRODUCTS[product])
        cases.append(LinearCase(product, w, b, sv, inputs[product], n_layers))
    head = fp32_model.lm_head
    hb = None if head.bias is None else head.bias.detach().float()
    cases.append(LinearCase("lm_head", head.weight.detach().float().contiguous(), hb, w8_model.lm_head,
                            inputs["lm_head"], 1))
    return cases


def _per_call_s(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def time_rounds(calls: dict[str, Callable[[], object]], rounds: int = 7, batch_s: float = 0.03) -> dict:
    """Time every call in ``calls`` in ``rounds`` interleaved rounds (the order rotates
    each round): per call ``{name: (median ms, min ms)}``. Each call is repeated within a
    round until the batch takes about ``batch_s`` (the count is fixed after a first
    calibration call)."""
    for fn in calls.values():
        fn()  # warm-up
    numbers = {n: max(1, min(200, int(batch_s / max(_per_call_s(fn, 1), 1e-6)))) for n, fn in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_per_call_s(calls[name], numbers[name]) * 1e3)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def _agreement(fn, w, b, x: torch.Tensor) -> tuple[float, float]:
    """(max |y - y_fp32|, ||y - y_fp32|| / ||y_fp32||) over the rows of ``x`` (rows, K),
    fed in one forward."""
    with torch.no_grad():
        y_ref = F.linear(x, w, b)
        err = fn(x).float() - y_ref
    return err.abs().max().item(), (err.norm() / y_ref.norm().clamp(min=1e-30)).item()


def _build_all(case: LinearCase, variants: list[Variant], ms: tuple[int, ...], log) -> tuple[dict, dict]:
    """{variant: callable} for the variants that build, {variant: reason} for the rest."""
    built, failed = {}, {}
    for v in variants:
        start = time.perf_counter()
        try:
            with torch.no_grad():
                built[v.name] = v.build(case.weight, case.bias, case.specviz, ms)
        except Unavailable as exc:
            failed[v.name] = str(exc)
        except Exception as exc:  # a library path that breaks here is a result, not a crash
            failed[v.name] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        log(f"  {case.name}: {v.name}: " + (f"built in {time.perf_counter() - start:.1f} s" if v.name in built
                                           else f"unavailable ({failed[v.name][:120]})"))
    return built, failed


def measure_linears(cases: list[LinearCase], variants: list[Variant], ms: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
                    rounds: int = 7, log=print) -> pd.DataFrame:
    """Per product and row count M, every variant's median and minimum time over
    ``rounds`` interleaved rounds and its agreement with fp32 (on the last M rows of the
    case's real inputs); a variant that cannot run is one row per product with the reason."""
    rows = []
    for case in cases:
        built, failed = _build_all(case, variants, ms, log)
        family = {v.name: v.family for v in variants}
        for name, why in failed.items():
            rows.append(dict(scope="linear", shape=case.shape, variant=name, family=family[name], M=None,
                             status="unavailable", note=why))
        for m in ms:
            x = case.inputs[-m:].contiguous()
            with torch.no_grad():
                timed = time_rounds({n: (lambda f=f: f(x)) for n, f in built.items()}, rounds)
            for name, fn in built.items():
                diff, rel = _agreement(fn, case.weight, case.bias, x)
                med, low = timed[name]
                rows.append(dict(scope="linear", shape=case.shape, variant=name, family=family[name], M=m,
                                 median_ms=med, min_ms=low, rounds=rounds, max_abs_diff=diff, rel_err=rel,
                                 per_forward=case.per_forward, status="ok"))
            ref = timed.get(REFERENCE, (float("nan"),))[0]
            log(f"  {case.shape} M={m}: " + ", ".join(f"{n.split(' (')[0][:18]} {t[0]:.2f}" for n, t in timed.items())
                + f" ms (reference {ref:.2f})")
        del built
    return pd.DataFrame(rows)


def linear_sums(table: pd.DataFrame) -> pd.DataFrame:
    """``scope=linear-sum`` rows: per variant and M, the sum over products of median x
    ``per_forward`` (the linear layers of one whole forward), for the variants measured on
    every product."""
    ok = table[(table.scope == "linear") & (table.status == "ok")]
    n_shapes = ok["shape"].nunique()
    rows = []
    for (variant, m), group in ok.groupby(["variant", "M"]):
        if group["shape"].nunique() != n_shapes:
            continue
        rows.append(dict(scope="linear-sum", shape="all products of one forward", variant=variant,
                         family=group.family.iloc[0], M=m, median_ms=(group.median_ms * group.per_forward).sum(),
                         min_ms=(group.min_ms * group.per_forward).sum(), rounds=group.rounds.iloc[0],
                         status="ok", note="sum of per-product medians x products per forward"))
    return pd.DataFrame(rows)


def prefix_ids(tokenizer, length: int = 200) -> torch.Tensor:
    """(1, length) token ids of a fixed code text (the start of :mod:`heapq`'s source, not
    one of the calibration texts), the same on every machine."""
    import heapq

    ids = tokenizer(inspect.getsource(heapq), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"the prefix text has only {ids.shape[1]} tokens, {length} wanted")
    return ids


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def _forward(model, cache, ids: torch.Tensor, start: int, prompt_len: int, keep: int = 0) -> torch.Tensor:
    """Logits (n, V) (the last ``keep`` if set) of a plain transformers forward of ``ids``
    (1, n) after ``start`` cached positions; prompt positions in one activation pass."""
    n = ids.shape[1]
    pos = torch.arange(start, start + n)[None]
    with prompt_positions(prompt_len, start, n):
        out = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=keep)
    return out.logits[0].float()


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], float]:
    """Plain greedy decoding of ``new_tokens`` after ``ids`` (1, L): (tokens, seconds for
    the decoding steps after the prefill)."""
    cache, length = new_cache(model), ids.shape[1]
    logits = _forward(model, cache, ids, 0, length, keep=1)
    tokens = [int(logits[-1].argmax())]
    start = time.perf_counter()
    for step in range(new_tokens - 1):
        logits = _forward(model, cache, torch.tensor([[tokens[-1]]]), length + step, length)
        tokens.append(int(logits[-1].argmax()))
    return tokens, time.perf_counter() - start


@torch.no_grad()
def teacher_forced_top1(model, ids: torch.Tensor, tokens: list[int]) -> float:
    """Share of ``tokens`` (fp32's greedy continuation of ``ids``) that ``model`` also
    ranks first, fed them in one forward (the generated positions in their own passes)."""
    full = torch.cat([ids, torch.tensor([tokens])], dim=1)
    logits = _forward(model, new_cache(model), full, 0, ids.shape[1])
    picks = logits[ids.shape[1] - 1:-1].argmax(-1)
    return (picks == torch.tensor(tokens)).float().mean().item()


@dataclass
class ModelVariant:
    """A whole model to time: the model, its family, and the environment its forwards run in."""

    name: str
    family: str
    model: object = None
    env: tuple[str, str | None] | None = None
    why: str = ""  # non-empty: cannot run here, and why

    def context(self):
        return _env(*self.env) if self.env else contextlib.nullcontext()


def _torchao_model(name: str, log) -> ModelVariant:
    label = "torchao Int8DynamicActivationInt8WeightConfig (eager)"
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except Exception as exc:
        return ModelVariant(label, "library", why=f"torchao does not import ({type(exc).__name__}: {exc})"[:300])
    try:
        model = load_model(name, dtype="fp32", device="cpu").model
        quantize_(model, Int8DynamicActivationInt8WeightConfig())
    except Exception as exc:
        return ModelVariant(label, "library", why=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
    log(f"  {label}: quantized")
    return ModelVariant(label, "library", model)


def model_variants(name: str, fp32_model, w8_model, log=print) -> list[ModelVariant]:
    """The whole-model variants: fp32, ``w8a8-token`` (compiled operator; the other kernel
    where the VNNI kernel runs; the PyTorch code), torchao eager, and rows for the compiled
    library paths, which are measured per product only."""
    out = [ModelVariant("fp32 nn.Linear", "reference", fp32_model),
           ModelVariant(REFERENCE, "specviz", w8_model)]
    if vnni_kernel():
        with _env(NO_VNNI_ENV, "1"):
            out.append(ModelVariant("specviz w8a8-token (fbgemm product, SPECVIZ_NO_VNNI=1)", "specviz",
                                    load_model(name, dtype="w8a8-token", device="cpu").model))
    else:
        out.append(ModelVariant("specviz w8a8-token (VNNI kernel)", "specviz", why="the VNNI kernel does not "
                                "run here: the CPU has no AVX-512 VNNI (" + fused_op_status() + ")"))
    out.append(ModelVariant("specviz w8a8-token (PyTorch code)", "specviz", w8_model, env=(_NO_EXT_ENV, "1")))
    out.append(_torchao_model(name, log))
    compiled_why = ("not measured on the whole model: torch.compile / torch.export of the transformers decoder "
                    "with its growing DynamicCache recompiles per length and is not what a decoding loop here "
                    "runs; see its scope=linear and linear-sum rows")
    out += [ModelVariant("PT2E X86InductorQuantizer + torch.compile (onednn qlinear)", "library", why=compiled_why),
            ModelVariant("torchao Int8DynamicActivationInt8WeightConfig + torch.compile", "library",
                         why=compiled_why)]
    return out


def _timed_forwards(variants: list[ModelVariant], prefix: torch.Tensor, tail: torch.Tensor,
                    sizes: tuple[int, ...], rounds: int) -> tuple[dict, dict]:
    """{(variant, n): [ms per round]} for forwards of the first n tokens of ``tail`` after
    ``prefix``, the variants interleaved in rounds, and {(variant, n): logits (n, V)} of the
    first round."""
    caches, times, logits = {}, {}, {}
    plen = prefix.shape[1]
    for v in variants:
        with v.context():
            caches[v.name] = new_cache(v.model)
            _forward(v.model, caches[v.name], prefix, 0, plen, keep=1)
    new = {n: tail[:, :n] for n in sizes}
    for r in range(rounds + 1):  # round 0 warms up
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            for n in sizes:
                with v.context():
                    start = time.perf_counter()
                    out = _forward(v.model, caches[v.name], new[n], plen, plen)
                    crop_cache(caches[v.name], plen)
                    elapsed = (time.perf_counter() - start) * 1e3
                if r == 0:
                    logits[(v.name, n)] = out
                else:
                    times.setdefault((v.name, n), []).append(elapsed)
    return times, logits


def measure_model(variants: list[ModelVariant], tokenizer, sizes: tuple[int, ...] = (1, 4), rounds: int = 7,
                  new_tokens: int = 32, log=print) -> pd.DataFrame:
    """``scope=forward`` rows (a forward of each of ``sizes`` tokens after a 200-token
    prefix; top-1 agreement of its logits with fp32's, and their largest difference) and
    ``scope=decode`` rows (greedy decoding of ``new_tokens`` for each of :data:`PROMPTS`:
    ms per token, teacher-forced top-1 agreement with fp32's tokens, and the share of
    free-running tokens equal to fp32's)."""
    runnable = [v for v in variants if not v.why]
    rows = [dict(scope=s, shape="whole model", variant=v.name, family=v.family, status="unavailable", note=v.why)
            for v in variants if v.why for s in ("forward", "decode")]
    text = prefix_ids(tokenizer, 200 + max(sizes))
    prefix = text[:, :200]
    times, logits = _timed_forwards(runnable, prefix, text[:, 200:], sizes, rounds)
    for v in runnable:
        for n in sizes:
            ref, got = logits[("fp32 nn.Linear", n)], logits[(v.name, n)]
            rows.append(dict(scope="forward", shape=f"whole model, {n} tokens after {prefix.shape[1]}", variant=v.name,
                             family=v.family, M=n, median_ms=statistics.median(times[(v.name, n)]),
                             min_ms=min(times[(v.name, n)]), rounds=rounds, max_abs_diff=(got - ref).abs().max().item(),
                             top1_agreement=(got.argmax(-1) == ref.argmax(-1)).float().mean().item(), status="ok"))
        log(f"  forward {v.name}: " + ", ".join(f"{n} tok {statistics.median(times[(v.name, n)]):.1f} ms"
                                               for n in sizes))
    prompts = [_prompt_ids(tokenizer, p) for p in PROMPTS]
    decoded = {}
    for i, ids in enumerate(prompts):  # prompt by prompt, every variant in turn
        for v in runnable:
            with v.context():
                decoded[(v.name, i)] = greedy(v.model, ids, new_tokens)
    for v in runnable:
        with v.context():
            forced = [teacher_forced_top1(v.model, ids, decoded[("fp32 nn.Linear", i)][0])
                      for i, ids in enumerate(prompts)]
        same = [sum(a == b for a, b in zip(decoded[(v.name, i)][0], decoded[("fp32 nn.Linear", i)][0])) / new_tokens
                for i in range(len(prompts))]
        per_token = [decoded[(v.name, i)][1] * 1e3 / (new_tokens - 1) for i in range(len(prompts))]
        rows.append(dict(scope="decode", shape=f"greedy, {len(prompts)} prompts x {new_tokens} tokens",
                         variant=v.name, family=v.family, M=1, median_ms=statistics.median(per_token),
                         min_ms=min(per_token), rounds=len(prompts), top1_agreement=statistics.mean(forced),
                         same_tokens=statistics.mean(same), status="ok", note="ms per decoding step"))
        log(f"  decode {v.name}: {statistics.median(per_token):.1f} ms/token, teacher-forced top-1 "
            f"{statistics.mean(forced):.3f}, same tokens {statistics.mean(same):.3f}")
    return pd.DataFrame(rows)


def add_ratios(table: pd.DataFrame) -> pd.DataFrame:
    """``ratio_vs_specviz``: each row's median over the reference's at the same scope,
    shape and M (above 1: slower than specviz's operator)."""
    ref = table[(table.variant == REFERENCE) & (table.status == "ok")].set_index(["scope", "shape", "M"]).median_ms
    keys = list(zip(table.scope, table["shape"], table.M))
    table["ratio_vs_specviz"] = [row_ms / ref.get(k, float("nan")) if pd.notna(row_ms) else float("nan")
                                 for row_ms, k in zip(table.median_ms, keys)]
    return table


def _accuracy(row: pd.Series) -> float:
    """A row's error against fp32: the relative error of a product (``scope=linear``), or
    one minus the top-1 agreement of a whole model (``forward``, ``decode``)."""
    if pd.notna(row.get("rel_err", float("nan"))):
        return float(row["rel_err"])
    return 1.0 - float(row["top1_agreement"]) if pd.notna(row.get("top1_agreement", float("nan"))) else float("nan")


def verdict(table: pd.DataFrame, margin: float = 0.10) -> pd.DataFrame:
    """Per scope, shape and M where the reference and a library path ran: the best library
    path, how much faster the reference is (``best_library / reference - 1``) and whether
    that is more than ``margin`` (the rule for keeping the hand-written kernel), with each
    side's error against fp32 (relative error of a product; one minus the top-1 agreement
    of a whole model) and the fastest library path whose error is at most the reference's
    twice (``as_accurate``: per-tensor activation scales can be faster and several times
    less accurate). Rows whose metadata columns (``machine``, ``cpu_flags``) the table has
    carry them."""
    ok, rows = table[table.status == "ok"], []
    meta = {c: table[c].iloc[0] for c in ("machine", "cpu_flags") if c in table.columns and len(table)}
    for (scope, shape, m), group in ok.groupby(["scope", "shape", "M"], sort=False):
        ref, lib = group[group.variant == REFERENCE], group[group.family == "library"]
        if ref.empty or lib.empty:
            continue
        ref, best = ref.iloc[0], lib.loc[lib.median_ms.idxmin()]
        faster = best.median_ms / ref.median_ms - 1
        close = lib[[_accuracy(r) <= 2 * _accuracy(ref) for _, r in lib.iterrows()]]
        accurate = close.loc[close.median_ms.idxmin()] if len(close) else None
        rows.append(dict(scope=scope, shape=shape, M=m, reference_ms=ref.median_ms, reference_error=_accuracy(ref),
                         best_library=best.variant, best_library_ms=best.median_ms, best_library_error=_accuracy(best),
                         specviz_faster_by=faster, keep=faster > margin,
                         as_accurate=None if accurate is None else accurate.variant,
                         specviz_faster_than_as_accurate_by=(float("nan") if accurate is None
                                                             else accurate.median_ms / ref.median_ms - 1), **meta))
    return pd.DataFrame(rows)


def verdict_path(out: str | os.PathLike) -> str:
    """Where a run written to ``out`` keeps its :func:`verdict`: ``<out stem>.verdict.csv``."""
    root, _ = os.path.splitext(str(out))
    return root + ".verdict.csv"


def _side_by_side(table: pd.DataFrame, scopes: tuple[str, ...]) -> str:
    part = table[(table.status == "ok") & table.scope.isin(scopes)].copy()
    part["cell"] = [f"{ms:8.2f} ({r:4.2f})" for ms, r in zip(part.median_ms, part.ratio_vs_specviz)]
    part["where"] = part.scope + " | " + part["shape"] + " | M=" + part.M.astype(int).astype(str)
    short = {v: v.replace("Int8DynamicActivationInt8WeightConfig", "da8w8").replace("X86InductorQuantizer", "x86")
             for v in part.variant.unique()}
    part["variant"] = part.variant.map(short)
    grid = part.pivot_table(index="where", columns="variant", values="cell", aggfunc="first", sort=False)
    with pd.option_context("display.width", 400, "display.max_columns", 30, "display.max_colwidth", 60):
        return grid.to_string()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specviz.bench.int8_paths", description=__doc__.split("\n\n")[0],
                                epilog="Writes one CSV row per variant x scope x shape x M (see the module docstring).")
    p.add_argument("--out", default="outputs/reference/int8-paths.csv", help="CSV to write (default: %(default)s)")
    p.add_argument("--model", default=DEFAULT_TARGET, help="built-in name or model directory (default: %(default)s)")
    p.add_argument("--layer", type=int, default=None, help="decoder layer whose products are timed (default: middle)")
    p.add_argument("--rows", default="1,2,3,4,6,8", help="row counts M of the per-product timings (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per measurement (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model forwards and decoding")
    p.add_argument("--from", dest="source", metavar="CSV", default=None,
                   help="time nothing: read an earlier run's CSV and write its verdict beside it")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every variant (default: torch's own; 1 keeps a machine loaded by other "
                        "processes from stalling multi-threaded kernels at their barriers)")
    return p


def _torchao_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torchao")
    except PackageNotFoundError:
        return "not installed"


def _finished(table: pd.DataFrame, label: dict, layer: int, out: str, argv: list[str] | None) -> pd.DataFrame:
    """``table`` with its ratios and the run's metadata columns, written to ``out``."""
    table = add_ratios(table.copy())
    for key, value in label.items():
        table[key] = value
    table["torchao"], table["layer"] = _torchao_version(), layer
    table["reference_variant"] = f"{REFERENCE}: {'VNNI kernel' if vnni_kernel() else 'fbgemm product'}"
    table["command"] = " ".join(["python -m specviz.bench.int8_paths", *(argv if argv is not None else sys.argv[1:])])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    table.to_csv(out, index=False)
    return table


def _report(written: pd.DataFrame, out: str) -> pd.DataFrame:
    """Print the side-by-side table and the verdict, and write the verdict beside ``out``."""
    print(_side_by_side(written, ("linear-sum", "forward", "decode")))
    decided = verdict(written)
    decided.to_csv(verdict_path(out), index=False)
    with pd.option_context("display.width", 300, "display.max_columns", 20):
        print(decided.to_string(index=False))
    print(f"wrote {len(decided)} verdict rows to {verdict_path(out)}")
    return decided


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = _parser().parse_args(argv)
    if args.source:
        try:
            written = pd.read_csv(args.source)
        except (OSError, pd.errors.ParserError) as exc:
            raise SystemExit(f"--from {args.source}: {exc}") from None
        if missing := {"scope", "shape", "variant", "family", "M", "status", "median_ms"} - set(written.columns):
            raise SystemExit(f"--from {args.source}: not an int8-paths CSV (missing columns {sorted(missing)})")
        _report(written if "ratio_vs_specviz" in written.columns else add_ratios(written), args.source)
        return written
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.threads:
        torch.set_num_threads(args.threads)
    label = machine_label()
    log(f"[int8-paths] {label['machine']}; {label['cpu_flags']}; torch {label['torch']}, torchao {_torchao_version()}; "
        f"w8a8-token: {fused_op_status()}, VNNI kernel: {vnni_kernel()}")
    ms = tuple(int(m) for m in args.rows.split(","))
    fp32 = load_model(args.model, dtype="fp32", device="cpu")
    w8 = load_model(args.model, dtype="w8a8-token", device="cpu")
    layer = len(fp32.model.model.layers) // 2 if args.layer is None else args.layer
    cases = linear_cases(fp32.model, w8.model, prefix_ids(fp32.tokenizer), layer)
    log(f"[int8-paths] per product (layer {layer}): " + ", ".join(c.shape for c in cases))
    table = measure_linears(cases, linear_variants(), ms, args.rounds, log)
    del cases
    table = pd.concat([table, linear_sums(table)], ignore_index=True)
    written = _finished(table, label, layer, args.out, argv)  # the per-product rows survive a later failure
    if not args.no_model:
        log(f"[int8-paths] per-product rows written to {args.out}; whole model")
        variants = model_variants(args.model, fp32.model, w8.model, log)
        table = pd.concat([table, measure_model(variants, fp32.tokenizer, (1, 4), args.rounds, args.new_tokens, log)],
                          ignore_index=True)
        written = _finished(table, label, layer, args.out, argv)
    _report(written, args.out)
    print(f"wrote {len(written)} rows to {args.out}")
    return written


if __name__ == "__main__":
    main()

"""The benchmark command line.

``python -m specviz.bench`` times end-to-end decoding of the same prompts with
transformers' own decoding, with llama.cpp's when its programs are found
(:mod:`specviz.bench.llama`), and with specviz's strategies (:mod:`specviz.bench.e2e` says
what each method and CSV column means); ``python -m specviz.bench attention`` times tree
attention against per-path and causal attention (:mod:`specviz.bench.attention`);
``python -m specviz.bench profile`` splits runs' time by phase and kind of work
(:mod:`specviz.bench.profile`).

Rows are appended to the CSV as each (repeat, prompt) finishes; running the same
command again skips the rows already there (``--fresh`` starts over). Before the rounds,
and once more after each round, the target's cost curve and prefills are timed into
``<out>.costs.csv`` (``--no-predict`` skips it), and the summary puts the cost model's
predicted speedup of each specviz strategy beside the measured one. The last printed
line is the one-line summary of the best specviz strategy.

Usage::

    python -m specviz.bench --limit 7 --max-new-tokens 128                   # one prompt per category
    python -m specviz.bench --limit 7 --max-new-tokens 128 --temperature 0.7
    python -m specviz.bench --methods hf-assisted dynamic-w8-d6-b32 ngram-n4-k10 --out tuning.csv
    python -m specviz.bench --dtype w8a8-token --llama-cpp ~/llama.cpp/build --methods chain-k2 llama-plain llama-spec-k2
    python -m specviz.bench --dtype bf16 --limit 7 --max-new-tokens 128 --heads <medusa result> \
        --methods merged-medusa-b4+ngram-n3-k8 ngram-n3-k8 llama-ngram-n3-k8 --llama-cpp ~/llama.cpp/build
    python -m specviz.bench --device cuda --dtype bf16 --limit 7
    python -m specviz.bench --dtype w8a8-token --draft-dtype w4a8-token --limit 7 --max-new-tokens 128
    python -m specviz.bench attention --budgets 8 16 32 64 --batch-sizes 1 4 --prefix-lens 128 512 2048
    python -m specviz.bench profile --dtype w8a8-token --methods specviz-plain chain-k2 ngram-n3-k8
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from specviz.bench.cli_args import (
    UsageError,
    attention_parser,
    check_args,
    check_counts,
    e2e_parser,
    environment,
    grammar_text,
    heads_env,
    profile_parser,
)
from specviz.bench.cost_passes import (
    costs_path,
    curve_spread,
    measure_costs,
    measure_round_costs,
    predicted_wall,
)
from specviz.bench.e2e import (
    COLUMNS,
    LLAMA_METHODS,
    PLAIN_METHODS,
    BenchSummary,
    Generation,
    load_results,
    parse_method,
    run_method,
    summarize,
)
from specviz.draft.registry import MethodSpec, build_drafter, heads_kinds
from specviz.locations import output_path
from specviz.bench.auto import is_auto, resolve_auto
from specviz.models.device import resolve_device

__all__ = ["main"]


def _format(df: pd.DataFrame, index: bool = False) -> str:
    fmt = {c: "{:.3f}".format for c in df.columns if c in ("acceptance_rate", "matches_plain")}
    fmt |= {c: "{:.2f}".format for c in df.columns if c not in fmt and pd.api.types.is_float_dtype(df[c])}
    return df.to_string(index=index, formatters=fmt, na_rep="-")



# -- the end-to-end command -----------------------------------------------------------------------

def _load_models(args: argparse.Namespace):
    from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
    from specviz.models.loading import load_pair
    from specviz.models.tiny import tiny_pair

    dtype = args.dtype
    if args.models == "tiny":
        return tiny_pair(dtype=dtype, device=args.device, draft_dtype=args.draft_dtype,
                         draft_layers=args.draft_layers)
    return load_pair(args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT, dtype=dtype, device=args.device,
                     draft_dtype=args.draft_dtype, draft_layers=args.draft_layers)


def _resolve_models(args: argparse.Namespace) -> tuple[tuple[str, str], torch.device]:
    """The (target, draft) names, with ``args.dtype`` resolved to a weight mode's name
    (``auto`` probed), ``args.device`` to a device and ``--threads`` applied."""
    from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
    from specviz.quant.weights import parse_weight_mode

    if args.models == "tiny":
        names = ("tiny-qwen2-seed0", "tiny-qwen2-seed0-draft")
    else:
        names = (args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT)
    try:
        if is_auto(args.dtype):
            args.dtype = "fp32" if args.models == "tiny" else resolve_auto(names[0], args.device)
        mode = parse_weight_mode(args.dtype)
    except ValueError as exc:
        raise UsageError(f"--dtype: {exc}") from None
    try:
        draft_mode = mode if args.draft_dtype is None or is_auto(args.draft_dtype) else parse_weight_mode(
            args.draft_dtype)
    except ValueError as exc:
        raise UsageError(f"--draft-dtype: {exc}") from None
    try:
        device = resolve_device(args.device, mode)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    try:
        resolve_device(device, draft_mode)
    except ValueError as exc:
        raise UsageError(f"--draft-dtype: {exc}") from None
    args.dtype = mode.name
    args.draft_dtype = draft_mode.name
    args.device = str(device)
    args.draft_layers = _draft_layers(args, device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return names, device


def _draft_layers(args: argparse.Namespace, device: torch.device) -> str:
    """How the draft's decoder layers run (:mod:`specviz.models.fused`): ``--draft-layers``
    for a ``w4a8-token`` draft on the CPU where the compiled operator loads, else
    "modules"."""
    from specviz.models.fused import fusable

    return args.draft_layers if fusable(args.draft_dtype, device) else "modules"


def _existing_rows(out: Path, fresh: bool) -> pd.DataFrame:
    if fresh or not out.exists() or out.stat().st_size == 0:
        return pd.DataFrame(columns=list(COLUMNS))
    try:
        df = load_results(out)
    except (ValueError, pd.errors.ParserError) as exc:
        raise UsageError(f"cannot resume from {out}: {exc}; pass --fresh or another --out") from None
    for old, new in df.attrs.get("renamed_methods", {}).items():
        print(f"resuming {out}: its rows of {old!r} read as {new!r} (the name's current spelling)")
    if list(df.columns) != list(COLUMNS):
        raise UsageError(f"{out} has columns of another version of the benchmark; pass --fresh or another --out")
    with open(out) as fh:
        header = fh.readline().strip().split(",")
    if header != list(COLUMNS):  # an older file's columns, filled in as load_results reads them
        from specviz.data.store import atomic_write_text

        atomic_write_text(out, df.to_csv(index=False))
    from specviz.quant.weights import parse_weight_mode

    # Older files name float modes by their torch dtype ("bfloat16"): one name per mode.
    for col in ("dtype", "draft_dtype"):
        df[col] = [parse_weight_mode(d).name if isinstance(d, str) else d for d in df[col]]
    return df


def _heads_in_use(specs: list[MethodSpec], target: str) -> dict[str, str]:
    """Each head strategy's trained-heads result directory name (what
    :func:`specviz.bench.e2e.drafter_label` records), for the ones whose heads are found."""
    from specviz.models.saved_heads import find_heads

    found = {}
    for s in specs:
        kinds = heads_kinds(s) if s.is_strategy else ()
        if kinds:
            try:  # a merged tree is labelled by its first part's heads (MergedDrafter.heads_path)
                found[s.name] = find_heads(target, kinds[0]).name
            except FileNotFoundError:  # reported with the command that trains them when the models are loaded
                pass
    return found


def _check_resumable(existing: pd.DataFrame, expected: dict, out: Path, verifiers: dict[str, str],
                     heads: dict[str, str] | None = None) -> None:
    """Refuse to mix rows measured under other settings into one CSV: ``expected`` maps the
    run-wide columns (temperature, budget, seed, dtype, models, threads) to this run's
    values, ``verifiers`` each method to its verification rule, ``heads`` each head
    strategy to the result directory of the heads it drafts with."""
    for col, want in expected.items():
        have = set(existing[col].dropna().unique())
        if have and have != {want}:
            raise UsageError(f"{out} holds rows with {col}={sorted(map(str, have))}, this run has {col}={want}; "
                              "pass --fresh or another --out")
    for method, want in verifiers.items():
        have = set(existing.loc[existing["method"] == method, "verifier"].astype(object).fillna("").astype(str))
        if have and have != {want}:
            raise UsageError(f"{out} holds {method} rows verified with {sorted(have)}, this run uses "
                              f"{want!r}; pass --fresh or another --out")
    for method, want in (heads or {}).items():
        have = set(existing.loc[existing["method"] == method, "drafter"].fillna("").astype(str))
        other = sorted(h for h in have if not h.endswith(f" heads={want}"))
        if other:
            raise UsageError(f"{out} holds {method} rows drafted by {other}, this run's heads are {want}; "
                              "pass --fresh or another --out")


def _prefix_match(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ids_text(ids: Sequence[int]) -> str:
    return " ".join(map(str, ids))


def _row(spec: MethodSpec, gen: Generation, prompt, repeat: int, position: int, n_prompt: int, plain_tps: float,
         plain_ids: tuple[int, ...] | None, run: dict, load1: float) -> dict:
    n = gen.n_tokens
    tps = n / gen.wall_s
    greedy = run["temperature"] == 0.0
    # a method that reports a token count without the tokens has no output to compare
    compare = greedy and plain_ids is not None and (gen.new_tokens is None or bool(gen.output_ids))
    return {
        "method": spec.name, "question_id": prompt.question_id, "category": prompt.category, "repeat": repeat,
        "position": position, "prompt_tokens": n_prompt, "new_tokens": n, "wall_s": gen.wall_s,
        "tokens_per_s": tps, "speedup": tps / plain_tps, "target_calls": gen.target_calls, "steps": gen.steps,
        "tau": n / gen.steps if gen.steps else math.nan, "drafted": gen.drafted, "accepted": gen.accepted,
        "acceptance_rate": gen.accepted / gen.drafted if gen.drafted else math.nan,
        "matches_plain": (gen.output_ids == plain_ids) if compare else None,
        "prefix_match": _prefix_match(gen.output_ids, plain_ids) if compare else None,
        "stop": gen.stop, "draft_s": gen.draft_s, "verify_s": gen.verify_s, "drafter": gen.drafter,
        "verifier": gen.verifier, **run,
        "bound_tokens_per_s": run.get("bound_tokens_per_s", math.nan) if spec.name in PLAIN_METHODS else math.nan,
        "load1": load1, "output_ids": _ids_text(gen.output_ids),
    }


def _print_summary(rows: pd.DataFrame, methods: list[str], predicted_wall: pd.Series | None = None,
                   spread: str = "") -> BenchSummary:
    summary = summarize(rows, methods, predicted_wall)
    print("\nper method (speedup = mean over prompts of plain's time per token / the method's; "
          "tau = tokens per target call):")
    if predicted_wall is not None:
        print("predicted = the cost model's: the target's timed prefill and forward over each step's tree, plus "
              "the measured draft time; error = measured / predicted - 1" + (f"; {spread}" if spread else ""))
    print(_format(summary.per_method))
    print("\nmean speedup per category:")
    print(_format(summary.per_category.reset_index()))
    print()
    print(summary.line)
    return summary


def _e2e(argv: list[str]) -> int:
    parser = e2e_parser()
    args = parser.parse_args(argv)
    if args.list_methods:
        print("methods:\n" + grammar_text())
        return 0
    specs = check_args(args)
    with environment(args.heads_env):
        return _run(args, specs)


def _run(args: argparse.Namespace, specs: list[MethodSpec]) -> int:
    from specviz.data.prompts import load_prompts

    try:
        prompts = load_prompts(args.prompts, limit=args.limit)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    default_out = "bench-greedy.csv" if args.temperature == 0.0 else f"bench-t{args.temperature:g}.csv"
    out = output_path(args.out or default_out)
    existing = _existing_rows(out, args.fresh)
    if args.fresh:
        out.unlink(missing_ok=True)
    if existing.empty:  # the costs belong to the rows they price: none kept, none reused
        costs_path(out).unlink(missing_ok=True)

    names, device = _resolve_models(args)
    dtype = args.dtype
    run = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
           "dtype": dtype, "draft_dtype": args.draft_dtype, "draft_layers": args.draft_layers, "device": str(device),
           "target": names[0], "draft": names[1], "threads": torch.get_num_threads()}
    verifiers = {s.name: s.verifier(args.temperature, args.verifier) for s in specs}
    _check_resumable(existing, run, out, verifiers, _heads_in_use(specs, names[0]))

    done = set(zip(existing["method"], existing["question_id"].astype(int), existing["repeat"].astype(int)))
    rounds = []  # (repeat, prompt index, methods still to run)
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            todo = [s for s in specs if (s.name, prompt.question_id, repeat) not in done]
            if todo:
                rounds.append((repeat, i, todo))
    method_names = [s.name for s in specs]
    threads = f"{torch.get_num_threads()} (--threads)" if args.threads else f"{torch.get_num_threads()} (default)"
    print(f"specviz.bench: {len(prompts)} prompts x {len(specs)} methods x {args.repeats} repeats, "
          f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature:g}, {dtype} on {device}, "
          f"torch threads {threads}, load average {os.getloadavg()[0]:.2f}")
    print(f"rows: {out} ({len(existing)} already there, {sum(len(t) for *_, t in rounds)} to run)")
    if args.draft_dtype != dtype:
        print(f"draft model in {args.draft_dtype}")
    if args.draft_layers != "modules":
        print(f"draft decoder layers: {args.draft_layers} (one compiled call per layer, one activation pass)")
    if "w8a8-token" in (dtype, args.draft_dtype):
        from specviz.quant.extension import fused_op_status, vnni_kernel

        vnni = " (with its AVX-512 VNNI kernel)" if vnni_kernel() else ""
        print(f"w8a8-token layers: {fused_op_status()}{vnni}")
    if "w4a8-token" in (dtype, args.draft_dtype):
        from specviz.quant.extension import fused_op_status, vnni_kernel

        how = "AVX-512 VNNI kernel" if vnni_kernel() else "AVX2 kernel"
        print(f"w4a8-token layers: {fused_op_status()}, {how}")
    if rounds:
        _measure(args, specs, prompts, rounds, existing, out, run)
    rows = load_results(out) if out.exists() else existing
    keep = rows["method"].isin(method_names) & rows["question_id"].isin([p.question_id for p in prompts]) \
        & (rows["repeat"] < args.repeats)
    rows = rows[keep]
    if args.predict:
        costs = costs_path(out)
        _print_summary(rows, method_names, predicted_wall(rows, costs), curve_spread(rows, costs))
    else:
        _print_summary(rows, method_names)
    return 0


def _measure(args, specs: list[MethodSpec], prompts, rounds, existing: pd.DataFrame, out: Path, run: dict) -> None:
    """Load the models, warm every method up, then run the rounds, appending each to ``out``."""
    import transformers

    from specviz.decode.engine import encode_prompt

    sklearn = importlib.util.find_spec("sklearn") is not None
    print("transformers " + transformers.__version__ + ("" if sklearn else
          "; scikit-learn not installed: hf-assisted keeps its confidence threshold at 0.4"))
    verbosity = transformers.logging.get_verbosity()
    # generate() warns about its own internal calls of the assistant; they say nothing about the run
    transformers.logging.set_verbosity_error()
    try:
        pair = _checked_pair(args, specs)
        run = {**run, **_bandwidth_bound(pair)}
        try:
            drafters = {s.name: build_drafter(s, pair) for s in specs if s.is_strategy}
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from None
        ids = {p.question_id: encode_prompt(pair.target.tokenizer, p.text, chat=True) for p in prompts}
        if args.warmup_tokens:
            _warm_up(args, specs, pair, drafters, ids[prompts[rounds[0][1]].question_id],
                     {s.name for *_, todo in rounds for s in todo})
        predict = args.predict and any(s.is_strategy for s in specs)
        if predict:
            measure_costs(pair, [len(ids[p.question_id]) - 1 for p in prompts], costs_path(out))
        total = sum(len(t) for *_, t in rounds)
        count = 0
        for repeat, i, todo in rounds:
            count = _run_round(args, pair, drafters, ids, prompts, (repeat, i, todo), existing, out, run,
                               predict, count, total)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _bandwidth_bound(pair) -> dict:
    """The device's name and copy bandwidth, and plain decoding's bandwidth-bound tokens
    per second (the bandwidth over the weight bytes a step of the target reads), printed."""
    from specviz.bench.serving import decode_bytes
    from specviz.models.device import copy_bandwidth, device_name

    name, bandwidth, nbytes = device_name(pair.target.device), copy_bandwidth(pair.target.device), \
        decode_bytes(pair.target)
    bound = bandwidth * 1e9 / nbytes
    print(f"memory bandwidth {bandwidth:.1f} GB/s (copy) on {name}; a decoding step of the target reads "
          f"{nbytes / 1e9:.2f} GB of weights: plain decoding's bound {bound:.1f} tokens/s")
    return {"device_name": name, "bandwidth_gb_s": bandwidth, "bound_tokens_per_s": bound}


def _checked_pair(args: argparse.Namespace, specs: list[MethodSpec]):
    """The loaded models, once their draft layers run as ``--draft-layers`` says and every
    head strategy's trained heads are found (each printed)."""
    t0 = time.perf_counter()
    pair = _load_models(args)
    print(f"models: {pair.target.name} (target), {pair.draft.name} (draft), loaded in "
          f"{time.perf_counter() - t0:.1f}s")
    from specviz.models.fused import fused_support, layers_of

    if layers_of(pair.draft.model) != args.draft_layers:
        raise UsageError(f"the draft's layers cannot be fused ({fused_support(pair.draft.model)}); "
                          "pass --draft-layers modules")
    kinds = sorted(set().union(*(heads_kinds(s) for s in specs if s.is_strategy)))
    if kinds:
        from specviz.models.saved_heads import find_heads

        for kind in kinds:
            try:
                print(f"{kind} heads: {find_heads(pair.target.name, kind)}")
            except FileNotFoundError as exc:
                raise UsageError(str(exc)) from None
    return pair


def _warm_up(args: argparse.Namespace, specs: list[MethodSpec], pair, drafters: dict, first, pending: set[str]) -> None:
    """One untimed run of ``--warmup-tokens`` tokens of each method in ``pending`` on the
    prompt ``first`` (llama.cpp's methods start a fresh process per run: none)."""
    for s in specs:
        if s.name in pending and s.family not in LLAMA_METHODS:  # a fresh process per run: no warm state
            run_method(s, pair, first, max_new_tokens=args.warmup_tokens, temperature=args.temperature,
                       seed=args.seed, drafter=drafters.get(s.name),
                       verifier=s.verifier(args.temperature, args.verifier), llama_cpp=args.llama_cpp_dir)
    print(f"warm-up: {len(pending)} methods x {args.warmup_tokens} tokens (not timed)")


def _run_round(args: argparse.Namespace, pair, drafters: dict, ids: dict, prompts, round_: tuple,
               existing: pd.DataFrame, out: Path, run: dict, predict: bool, count: int, total: int) -> int:
    """Run one round ``(repeat, prompt index, methods)``, its methods in an order rotated
    per round, and append its rows to ``out``; returns ``count`` plus the runs done."""
    repeat, i, todo = round_
    prompt = prompts[i]
    qid = prompt.question_id
    seed = args.seed + 100_003 * repeat + qid
    k = (repeat * len(prompts) + i) % len(todo)
    order = todo[k:] + todo[:k]
    gens: dict[str, tuple[int, Generation, float]] = {}
    for position, spec in enumerate(order):
        gc.collect()
        load1 = os.getloadavg()[0]
        gen = run_method(spec, pair, ids[qid], max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, seed=seed, drafter=drafters.get(spec.name),
                         verifier=spec.verifier(args.temperature, args.verifier), llama_cpp=args.llama_cpp_dir)
        gens[spec.name] = (position, gen, load1)
        count += 1
        print(f"[{count:>4}/{total}] q{qid} {prompt.category:<15} {spec.name:<18} "
              f"{gen.n_tokens / gen.wall_s:7.2f} tok/s  tau {gen.n_tokens / gen.steps:5.2f}  "
              f"{gen.n_tokens:>4} tokens ({gen.stop})", flush=True)
    plain_tps, plain_ids = _plain_reference(gens, existing, qid, repeat)
    rows = [_row(spec, gens[spec.name][1], prompt, repeat, gens[spec.name][0], len(ids[qid]), plain_tps,
                 plain_ids, run, gens[spec.name][2]) for spec in todo]
    pd.DataFrame(rows, columns=list(COLUMNS)).to_csv(out, mode="a", header=not out.exists(), index=False)
    best = max(rows, key=lambda r: r["speedup"])
    timed = ""
    if predict:
        took = measure_round_costs(pair, len(ids[qid]) - 1, costs_path(out), f"q{qid}-r{repeat}")
        timed = f"; cost curve timed again ({took:.1f}s)"
    print(f"       q{qid}: plain {plain_tps:.2f} tok/s; fastest {best['method']} {best['speedup']:.2f}x{timed}")
    return count


def _plain_reference(gens: dict[str, tuple[int, Generation, float]], existing: pd.DataFrame, qid: int,
                     repeat: int) -> tuple[float, tuple[int, ...]]:
    """Plain decoding's tokens per second and output of the round: this round's run when
    it has one, else the row of it already in the CSV."""
    if "plain" in gens:
        plain = gens["plain"][1]
        return len(plain.output_ids) / plain.wall_s, plain.output_ids
    ref = existing[(existing["method"] == "plain") & (existing["question_id"] == qid)
                   & (existing["repeat"] == repeat)].iloc[0]
    return float(ref["tokens_per_s"]), tuple(int(t) for t in str(ref["output_ids"]).split())


# -- the tree attention microbenchmark ----------------------------------------------------------------


def _attention(argv: list[str]) -> int:
    import specviz.bench.attention as timing
    from specviz.tree.shapes import expansion

    args = attention_parser().parse_args(argv)
    try:
        shapes = timing.default_timing_shapes(args.budgets)
        for text in args.shapes:
            if not re.fullmatch(r"\d+(?:x\d+)*", text):
                raise ValueError(f"--shapes entries look like 2x2x1 (branching per depth), got {text!r}")
            shapes[f"tree-{text}"] = expansion([int(b) for b in text.split("x")])
        dims = timing.QWEN25_1_5B if args.layout == "1.5b" else timing.QWEN25_0_5B

        def progress(row: dict) -> None:
            print(f"{row['shape']:<14} B={row['batch_size']:<3} P={row['prefix_len']:<5} tree {row['tree_ms']:8.3f} ms"
                  f"  per-path {row['per_path_ms']:8.3f} ms  causal {row['causal_ms']:8.3f} ms", flush=True)

        table = timing.time_tree_attention(shapes, batch_sizes=args.batch_sizes, prefix_lens=args.prefix_lens,
                                           dims=dims, dtype=args.dtype, repeats=args.repeats, on_row=progress)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    out = output_path(args.out)
    table.to_csv(out, index=False)
    cols = ["shape", "budget", "batch_size", "prefix_len", "tree_ms", "per_path_ms", "causal_ms",
            "tree_vs_causal", "per_path_vs_tree"]
    print(f"\n{_format(table[cols])}\n\nrows: {out}")
    print(f"tree attention: per-path attention takes {table['per_path_vs_tree'].mean():.2f}x its time and "
          f"causal attention over the same tokens {1 / table['tree_vs_causal'].mean():.2f}x "
          f"(means over {len(table)} settings, {table['dtype'].iloc[0]}, {torch.get_num_threads()} threads)")
    return 0


# -- where the time goes --------------------------------------------------------------------------


def _profile(argv: list[str]) -> int:
    from specviz.bench.profile import check_profilable
    from specviz.data.prompts import load_prompts

    args = profile_parser().parse_args(argv)
    check_counts(args)
    try:
        specs = [parse_method(m) for m in args.methods]
    except ValueError as exc:
        raise UsageError(f"{exc}\nmethod grammar:\n{grammar_text()}") from None
    try:
        for spec in specs:
            check_profilable(spec)
        prompts = load_prompts(args.prompts, limit=args.limit)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    with environment(heads_env(args.heads)):
        return _run_profile(args, specs, prompts)


def _run_profile(args: argparse.Namespace, specs: list[MethodSpec], prompts) -> int:
    from specviz.bench.profile import KINDS, aggregate_profile, profile_methods
    from specviz.decode.engine import encode_prompt

    _resolve_models(args)
    out = output_path(args.out)
    pair = _load_models(args)
    print(f"specviz.bench profile: {len(prompts)} prompts x {len(specs)} methods, max_new_tokens="
          f"{args.max_new_tokens}, {args.dtype} on {args.device}, {torch.get_num_threads()} torch threads")
    tables = []
    for prompt in prompts:
        ids = encode_prompt(pair.target.tokenizer, prompt.text, chat=True)

        def done(table: pd.DataFrame) -> None:
            top = table.sort_values("ms_per_token", ascending=False).iloc[0]
            print(f"q{prompt.question_id} {prompt.category:<15} {table['method'].iloc[0]:<18} "
                  f"{1e3 * table['wall_s'].iloc[0] / max(int(table['tokens'].iloc[0]), 1):7.1f} ms/token "
                  f"(profiled {table['ms_per_token'].sum():.1f}); most in {top['phase']}", flush=True)

        try:
            table = profile_methods([s.name for s in specs], pair, ids, max_new_tokens=args.max_new_tokens,
                                    on_method=done)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
        table.insert(1, "question_id", prompt.question_id)
        table.insert(2, "category", prompt.category)
        tables.append(table)
    rows = pd.concat(tables, ignore_index=True)
    rows.to_csv(out, index=False)
    summary = aggregate_profile(rows)
    cols = ["method", "phase", "ms_per_token", "share", *KINDS]
    print(f"\nmilliseconds per generated token, over {len(prompts)} prompts (share of the profiled wall time):")
    print(_format(summary[cols]))
    print(f"\nrows: {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad command line or input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            if argv[:1] == ["attention"]:
                return _attention(argv[1:])
            if argv[:1] == ["profile"]:
                return _profile(argv[1:])
            return _e2e(argv)
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            return exc.code if isinstance(exc.code, int) else 2
    except UsageError as exc:
        print(f"specviz.bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; finished rounds are in the CSV: run the same command again to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

"""The command line of the slow exactness checks (:mod:`specviz.checks.identity` describes
the sections)::

    python -m specviz.checks                        # full: 10 prompts x 128 tokens, every section
    python -m specviz.checks --prompts 3 --tokens 32 --sections identity
    python -m specviz.checks --sections w8a8-token,accuracy   # identity in w8a8-token; every mode's accuracy bar

Sections: ``identity`` (fp32: speculative output must equal plain decoding), a weight mode
name (``bf16``, ``w8a8-token``, ...: the same comparison in that mode, divergences
reported with their near-tie margins), ``accuracy`` (teacher-forced greedy top-1 agreement
of each mode of ``--accuracy-modes`` with fp32, per category, against the bar of bf16's
agreement minus 0.02) and ``adaptive``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Sequence

from specviz.checks import identity
from specviz.checks.identity import (
    check_identity,
    compare_schedules,
    default_drafters,
    format_checks,
    format_schedules,
)
from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
from specviz.models.loading import load_model, load_pair
from specviz.models.device import resolve_device
from specviz.quant.weights import WEIGHT_MODES, parse_weight_mode
from specviz.data.store import ResultStore

__all__ = ["main"]


def _prompts(n: int) -> list[str]:
    from specviz.data.prompts import load_prompts

    return [p.text for p in load_prompts(limit=n)]


#: the sections that compare a weight mode with fp32, one per mode
_MODE_SECTIONS = tuple(m for m in WEIGHT_MODES if m != "fp32")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specviz.checks", description=identity.__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts from the shipped set (default 10)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--sections", default="identity,bf16,adaptive",
                        help="comma-separated: identity (fp32), a weight mode (bf16, w8a8-token, ...), accuracy, "
                             "adaptive (default identity,bf16,adaptive)")
    parser.add_argument("--accuracy-modes", default="bf16,w8a8-token,w4a8-token",
                        help="weight modes the accuracy section compares with fp32 (default bf16,w8a8-token,w4a8-token)")
    parser.add_argument("--chunk", type=int, default=4,
                        help="accuracy: continuation tokens per forward, as verification feeds them (default 4)")
    parser.add_argument("--drafters", default="",
                        help="comma-separated substrings of drafter names to keep (default: all)")
    parser.add_argument("--cost-ratio", type=float, default=0.3,
                        help="draft-forward / target-verify cost for the adaptive section (default 0.3)")
    parser.add_argument("--out", default="checks.json", help="JSON report, relative to outputs/ (default checks.json)")
    parser.add_argument("--fresh", action="store_true", help="ignore finished units of an earlier run and start over")
    parser.add_argument("--device", default="auto",
                        help="where the models run: auto (default: CUDA, then MPS, then the CPU, among those that "
                             "run the section's weight mode), cpu, cuda[:N] or mps")
    return parser


def _checked_lists(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The sections and the accuracy section's weight modes of the command line, checked
    (``parser.error`` on an unknown one or a ``--chunk`` below 1)."""
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - {"identity", "accuracy", "adaptive", *_MODE_SECTIONS})
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from identity, accuracy, adaptive, {', '.join(_MODE_SECTIONS)}")
    accuracy_modes = [m.strip() for m in args.accuracy_modes.split(",") if m.strip()]
    bad = sorted(set(accuracy_modes) - set(WEIGHT_MODES))
    if bad:
        parser.error(f"unknown --accuracy-modes {bad}; choose from {', '.join(WEIGHT_MODES)}")
    if args.chunk < 1:
        parser.error(f"--chunk must be >= 1, got {args.chunk}")
    return sections, accuracy_modes


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns 1 if the fp32 identity check found a mismatch."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        resolve_device(args.device)
    except ValueError as exc:
        parser.error(f"--device: {exc}")

    def device_for(dtype: str) -> str:
        try:
            return str(resolve_device(args.device, parse_weight_mode(dtype)))
        except ValueError as exc:
            parser.error(f"--device: {exc}")

    sections, accuracy_modes = _checked_lists(parser, args)
    prompts = _prompts(args.prompts)
    keep = [s for s in args.drafters.split(",") if s]
    report: dict[str, object] = {"prompts": args.prompts, "tokens": args.tokens, "device": args.device}
    status = 0

    def log(msg: str) -> None:
        print(msg, flush=True)

    from specviz.locations import OUTPUTS_DIR

    # One store per dtype: the fp32 and bf16 sections can run as two processes at once.
    stores: dict[str, ResultStore] = {}

    def store_for(dtype: str) -> ResultStore:
        if dtype not in stores:
            where = device_for(dtype)
            suffix = "" if where == "cpu" else "-" + where.replace(":", "")
            path = OUTPUTS_DIR / "checks" / "partial" / f"checks-{args.prompts}x{args.tokens}-{dtype}{suffix}.jsonl"
            if args.fresh:
                path.unlink(missing_ok=True)
            stores[dtype] = ResultStore(path)
            log(f"finished {dtype} units are kept in {path}")
        return stores[dtype]

    runs = [("identity", "fp32")] + [(m, m) for m in _MODE_SECTIONS]
    for section, dtype in runs:
        if section not in sections:
            continue
        store = store_for(dtype)
        pair = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, dtype=dtype, device=device_for(dtype))
        log(f"{section}: {dtype} on {pair.target.device}")
        drafters = [d for d in default_drafters(pair) if not keep or any(k in d.name for k in keep)]
        checks = check_identity(pair, prompts, drafters, args.tokens, log=log, store=store)
        log(format_checks(checks))
        report[section] = [asdict(c) | {"match_rate": c.match_rate, "token_match_rate": c.token_match_rate}
                           for c in checks]
        if section == "identity" and any(c.identical < c.n_prompts for c in checks):
            status = 1
        del pair, drafters
    if "accuracy" in sections:
        report["accuracy"] = _accuracy(args, accuracy_modes, log, device_for)
    if "adaptive" in sections:
        pair = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="bf16", device=device_for("bf16"))
        results = compare_schedules(pair, prompts, args.tokens, args.cost_ratio, log=log, store=store_for("bf16"))
        log(format_schedules(results))
        report["adaptive"] = [asdict(r) for r in results]
    from specviz.locations import output_path

    path = output_path(args.out)
    path.write_text(json.dumps(report, indent=1))
    log(f"report written to {path}")
    return status


def _accuracy(args, modes: list[str], log, device_for) -> dict:
    """The accuracy section: fp32 greedy continuations of the prompts, then each mode's
    teacher-forced agreement with them (one model in memory at a time)."""
    import pandas as pd

    from specviz.checks.accuracy import accuracy_bar, agreement_by_category, agreement_table, reference_texts
    from specviz.data.prompts import load_prompts

    prompts = load_prompts(limit=args.prompts)
    log(f"accuracy: fp32 references for {len(prompts)} prompts x {args.tokens} tokens")
    texts = reference_texts(load_model(DEFAULT_TARGET, "fp32", device=device_for("fp32")), prompts,
                            max_new_tokens=args.tokens)
    tables = []
    for mode in modes:
        log(f"accuracy: {mode} on {device_for(mode)}, continuation fed {args.chunk} tokens per forward")
        tables.append(agreement_table(load_model(DEFAULT_TARGET, mode, device=device_for(mode)), texts,
                                      chunk=args.chunk))
    summary = agreement_by_category(pd.concat(tables, ignore_index=True))
    bar = accuracy_bar(summary)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        log(summary.pivot(index="category", columns="weight_mode", values="continuation_agreement")
            .round(3).to_string())
        log(bar.round(3).to_string(index=False))
    return {"chunk": args.chunk, "by_category": summary.to_dict("records"), "bar": bar.to_dict("records")}


if __name__ == "__main__":
    raise SystemExit(main())

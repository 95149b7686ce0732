"""``python -m specviz.study``: run the study notebooks headlessly (see :mod:`specviz.study.runner`)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from specviz.study.presets import PRESETS, StudyConfigError
from specviz.study.runner import NotebookFailedError, log_line, refresh_committed, run_study

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specviz.study",
        description="Run the specviz study notebooks headlessly with papermill. Re-running the "
                    "same command skips finished notebooks and resumes interrupted ones.",
    )
    p.add_argument("--preset", choices=list(PRESETS), default="quick",
                   help="study size (default: quick); --list shows what each runs")
    p.add_argument("--prompts", metavar="FILE", help="Spec-Bench-format .jsonl prompt file "
                   "(default: the built-in data/prompts.jsonl)")
    p.add_argument("--limit", metavar="N", type=int, help="prompts per run, picked round-robin over categories")
    p.add_argument("--out", metavar="DIR", help="run directory (default: outputs/<preset>)")
    p.add_argument("--only", metavar="NN[,NN...]", help="run only these notebooks, e.g. 02,05")
    p.add_argument("--force", action="store_true", help="re-run notebooks that already finished")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", metavar="N", type=int,
                       help="run the notebooks' units on a local Dask cluster of N worker processes")
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="run them on an existing Dask cluster (e.g. tcp://10.0.0.5:8786)")
    p.add_argument("--dtype", metavar="MODE", help="weight mode of the real models in every notebook that has "
                   "a dtype parameter: fp32, bf16, fp16, w8a8-token, w4a8-token, or auto "
                   "(the fastest mode that passes the accuracy bar on this machine; default: the preset's, auto for "
                   "quick, else each notebook's, fp32)")
    p.add_argument("--draft-dtype", metavar="MODE", help="the draft's weight mode in the notebooks that have a "
                   "draft_dtype parameter (the speed notebook, 06), e.g. w4a8-token for a 4-bit draft "
                   "(default: the preset's for the target's mode, w4a8-token beside w8a8-token in quick; "
                   "else the target's mode)")
    p.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
    p.add_argument("--list", action="store_true", help="list the presets and notebooks, then exit")
    p.add_argument("--refresh-committed", action="store_true",
                   help="re-execute notebooks/ in place with their defaults (what nbval checks)")
    return p


def _list(log: Callable[[str], None]) -> None:
    for preset in PRESETS.values():
        mode = f" [weight mode: {preset.dtype}]" if preset.dtype else ""
        for target, draft in preset.draft_dtypes.items():
            mode += f" [draft: {draft} beside a {target} target]"
        log(f"{preset.name}: {preset.description}{mode}")
        for run in preset.runs:
            params = ", ".join(f"{k}={v}" for k, v in run.parameters.items()) or "defaults"
            log(f"  {run.notebook}: {params}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    only = [s for s in args.only.split(",") if s.strip()] if args.only else None
    try:
        if args.list:
            _list(log_line)
        elif args.refresh_committed:
            refresh_committed(only, progress=not args.no_progress)
        else:
            run_study(args.preset, out_dir=args.out, prompts=args.prompts, limit=args.limit, only=only,
                      force=args.force, progress=not args.no_progress, workers=args.workers,
                      scheduler=args.scheduler, dtype=args.dtype, draft_dtype=args.draft_dtype)
    except StudyConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NotebookFailedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: finished notebooks and finished units are kept; run the same "
              "command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m specviz.heads``: train draft heads into the specviz cache, or describe a result.

::

    python -m specviz.heads train --kind medusa --target qwen2.5-coder-1.5b-instruct --minutes 10
    python -m specviz.heads train --kind eagle --tiny --steps 200        # the tiny random target
    python -m specviz.heads info ~/.cache/specviz/heads/<target>/<kind>-c...-d...

``train`` builds the self-distilled corpus (cached, resumable; the target's features are
kept as it decodes), gathers the features into the training cache, trains, and prints the
result directory, which the ``medusa`` / ``eagle`` strategies of :mod:`specviz.draft.registry`
then find. Running the
same command again resumes an interrupted run. Bad arguments exit with status 2 and a
one-line error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Sequence

__all__ = ["main"]


class _UsageError(Exception):
    """Bad command-line input (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m specviz.heads", description="Train Medusa / EAGLE draft heads on a target's own "
                "features, or describe a trained result.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    t = sub.add_parser("train", help="train heads (resumes an interrupted run)")
    t.add_argument("--kind", required=True, choices=("medusa", "eagle"), help="medusa or eagle")
    t.add_argument("--target", metavar="NAME", help="target model: a built-in name, a directory or a Hub id")
    t.add_argument("--tiny", action="store_true", help="use the tiny random target (for tests)")
    t.add_argument("--minutes", type=float, metavar="N", help="training time budget")
    t.add_argument("--steps", type=int, metavar="N", help="optimizer step budget")
    t.add_argument("--out", metavar="DIR", help="result directory (default: the specviz cache)")
    t.add_argument("--vocab", type=int, metavar="N", help="draft only the N most frequent tokens of the data")
    t.add_argument("--heads", type=int, default=4, metavar="K", help="Medusa heads (default 4)")
    t.add_argument("--prompts", type=int, metavar="N", help="standard library prompts (default 32; 4 with --tiny)")
    t.add_argument("--tasks", type=int, metavar="N",
                   help="prompts of the study's task kinds: writing, questions, word problems, translation, "
                        "summaries, questions on a context, code (default 160; 4 with --tiny)")
    t.add_argument("--written", type=int, metavar="N",
                   help="prompts of those kinds written by the target itself from its chat template and a kind's "
                        "first words, sampled (default 0)")
    t.add_argument("--new-tokens", type=int, metavar="N",
                   help="continuation tokens per prompt (default 192; 32 with --tiny)")
    t.add_argument("--temperatures", default="0", metavar="T[,T...]",
                   help="one continuation per prompt and temperature; 0 is greedy, others are sampled with a seed "
                        "per prompt (default 0)")
    t.add_argument("--decode-batch", type=int, default=16, metavar="B",
                   help="prompts whose continuations are decoded together (default 16)")
    t.add_argument("--spec-bench", metavar="FILE", help="also use the prompts of this Spec-Bench-format file")
    t.add_argument("--exclude", metavar="CAT[,CAT...]",
                   help="held-out categories of --spec-bench (default: the evaluation categories)")
    t.add_argument("--batch", type=int, default=8, metavar="B", help="windows per step (default 8)")
    t.add_argument("--window", type=int, default=128, metavar="W", help="positions per window (default 128)")
    t.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    t.add_argument("--validation", type=float, default=0.1, metavar="SHARE",
                   help="share of the sequences held out to pick the best weights and measure them (default 0.1; "
                        "0 for none)")
    t.add_argument("--train-precision", default="fp32", choices=("fp32", "bf16", "auto"),
                   help="products of a training step (not the weight mode the heads draft in): fp32 (default), bf16 "
                        "(autocast), or auto: bf16 where a probe finds it faster on this machine")
    t.add_argument("--soft-labels", type=float, default=0.0, metavar="SHARE",
                   help="share of the classification loss against the target's own distributions instead of the "
                        "data's tokens (0 to 1; default 0)")
    t.add_argument("--mlp-size", type=int, metavar="N",
                   help="EAGLE: width of the head layer's MLP (default: the target's; narrower drafts cheaper)")
    t.add_argument("--rollout", type=int, default=1, metavar="D",
                   help="EAGLE: draft depths trained, the deeper ones on the head's own predicted features "
                        "(default 1: true features only)")
    t.add_argument("--rollout-decay", type=float, default=1.0, metavar="X",
                   help="EAGLE: weight of each deeper depth's loss relative to the one above (default 1)")
    t.add_argument("--seed", type=int, default=0, help="prompt choice, sampling and initialisation seed")
    t.add_argument("--dtype", default="fp32", help="weight mode of the target (default fp32)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    i = sub.add_parser("info", help="describe a training result")
    i.add_argument("dir", metavar="DIR", help="a result directory (or its checkpoint.pt)")
    return p


def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise _UsageError(f"{name} must be > 0, got {value}")


def _train(args) -> int:
    from specviz.heads.corpus import build_corpus
    from specviz.heads.training import HeadConfig, train_heads, training_precision
    from specviz.models.builtin import cache_dir
    from specviz.models.loading import load_model
    from specviz.models.tiny import tiny_pair

    if args.tiny == bool(args.target):
        raise _UsageError("give --target NAME or --tiny (exactly one)")
    if args.steps is None and args.minutes is None:
        raise _UsageError("give --steps or --minutes (or both)")
    for name in ("steps", "minutes", "vocab", "new_tokens"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    for name in ("prompts", "tasks", "written"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise _UsageError(f"--{name} must be >= 0, got {getattr(args, name)}")
    for name in ("heads", "batch", "window", "lr", "decode_batch"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name), allow_none=False)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        raise _UsageError(f"--temperatures must be numbers separated by commas, got {args.temperatures!r}") from None
    if not temperatures or min(temperatures) < 0:
        raise _UsageError(f"--temperatures must list values >= 0, got {args.temperatures!r}")
    prompts = args.prompts if args.prompts is not None else (4 if args.tiny else 32)
    tasks = args.tasks if args.tasks is not None else (4 if args.tiny else 160)
    written = args.written or 0
    if prompts + tasks + written == 0 and args.spec_bench is None:
        raise _UsageError("no training prompts: --prompts, --tasks and --written are all 0 and there is no "
                          "--spec-bench")
    if not 0 <= args.soft_labels <= 1:
        raise _UsageError(f"--soft-labels must be a share from 0 to 1, got {args.soft_labels}")
    if args.mlp_size is not None and args.mlp_size < 1:
        raise _UsageError(f"--mlp-size must be a positive integer, got {args.mlp_size}")
    if args.rollout < 1:
        raise _UsageError(f"--rollout must be a positive integer, got {args.rollout}")
    if not args.rollout_decay >= 0:
        raise _UsageError(f"--rollout-decay must be >= 0, got {args.rollout_decay}")
    target = tiny_pair(seed=0).target if args.tiny else load_model(args.target, args.dtype)
    precision = training_precision(target.device) if args.train_precision == "auto" else args.train_precision
    config = HeadConfig(n_heads=args.heads, vocab=args.vocab, lr=args.lr, batch_size=args.batch, window=args.window,
                        seed=args.seed, validation=args.validation, precision=precision,
                        soft_labels=args.soft_labels, mlp_size=args.mlp_size, rollout=args.rollout,
                        rollout_decay=args.rollout_decay)
    if args.vocab is not None and args.vocab > target.vocab_size:
        raise _UsageError(f"--vocab {args.vocab} is larger than {target.name}'s vocabulary ({target.vocab_size})")
    new_tokens = args.new_tokens if args.new_tokens is not None else (32 if args.tiny else 192)
    exclude = [c.strip() for c in args.exclude.split(",") if c.strip()] if args.exclude else None
    max_chars = 300 if args.tiny else 1500
    spec = json.dumps([target.name, target.weight_mode, prompts, new_tokens, args.seed, args.spec_bench, exclude, max_chars]
                      + ([tasks] if tasks or written else [])  # stores written before either existed keep their key
                      + ([written] if written else []))
    store = cache_dir() / "heads" / "corpus" / f"{hashlib.sha256(spec.encode()).hexdigest()[:16]}.jsonl"
    corpus = build_corpus(target, prompts=prompts, tasks=tasks, written=written, max_new_tokens=new_tokens,
                          seed=args.seed, temperatures=temperatures, spec_bench=args.spec_bench,
                          exclude_categories=exclude, max_prompt_chars=max_chars, store=store,
                          batch_size=args.decode_batch, progress=not args.no_progress)
    print(f"corpus: {len(corpus)} sequences, {corpus.tokens} tokens, sha256 {corpus.sha256[:16]}; training in "
          f"{precision}", file=sys.stderr)
    result = train_heads(args.kind, target, corpus, minutes=args.minutes, steps=args.steps, out_dir=args.out,
                         config=config, progress=not args.no_progress)
    val = result.validation
    print(f"{args.kind} heads for {target.name}: {result.step} steps, loss {result.loss:.4f}, "
          f"top-1 {result.accuracy:.3f}" + (f"; validation top-1 {val['top1']:.3f} (best step {val['best_step']})"
                                             if val else "") + f" -> {result.path}")
    return 0


def _info(args) -> int:
    from specviz.models.saved_heads import read_result_meta

    path, meta = read_result_meta(args.dir)
    print(f"path: {path}")
    for key in ("kind", "target", "hidden_size", "vocab_size", "n_heads", "step", "elapsed_s", "loss", "accuracy",
                "finished", "data_tokens", "data_sequences", "data_sha256", "config_hash"):
        if meta.get(key) is not None:
            print(f"{key}: {meta[key]}")
    config = meta.get("config") or {}
    print("config: " + ", ".join(f"{k}={v}" for k, v in sorted(config.items())))
    val = meta.get("validation")
    if val:
        print(f"validation: {val['sequences']} sequences, {val['tokens']} tokens; best step {val['best_step']}, "
              f"loss {val['loss']:.4f}, top-1 {val['top1']:.3f}")
        for h in val.get("heads", []):
            print(f"  head {h['head']}: top-1 {h['top1']:.3f}, top-5 {h['top5']:.3f} ({h['positions']} positions)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad input)."""
    try:
        args = _parser().parse_args(argv)
        if args.command is None:
            raise _UsageError("give a command: train or info")
        return _train(args) if args.command == "train" else _info(args)
    except (_UsageError, ValueError, FileNotFoundError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished work is kept; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

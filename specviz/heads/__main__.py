"""``python -m specviz.heads``: train draft heads into the specviz cache, or describe a result.

::

    python -m specviz.heads train --kind medusa --target qwen2.5-coder-1.5b-instruct --minutes 10
    python -m specviz.heads train --kind eagle --tiny --steps 200        # the tiny random target
    python -m specviz.heads distill --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct
    python -m specviz.heads info ~/.cache/specviz/heads/<target>/<kind>-c...-d...

``distill`` fine-tunes a draft model towards the target on the same corpus
(:mod:`specviz.heads.distill`) and prints the model directory to pass as the draft.
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

from specviz.heads.distill import DIVERGENCES

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
    _corpus_arguments(t)
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
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    d = sub.add_parser("distill", help="distil a draft model towards its target (resumes an interrupted run)")
    d.add_argument("--target", metavar="NAME", help="target model: a built-in name, a directory or a Hub id")
    d.add_argument("--draft", metavar="NAME", help="draft model to distil (loaded in fp32)")
    d.add_argument("--tiny", action="store_true", help="use the tiny random pair (for tests)")
    d.add_argument("--minutes", type=float, metavar="N", help="training time budget (default 30 unless --steps)")
    d.add_argument("--steps", type=int, metavar="N", help="optimizer step budget")
    d.add_argument("--out", metavar="DIR", help="result directory (default: the specviz cache)")
    d.add_argument("--divergence", default="fkl", choices=DIVERGENCES,
                   help="loss: forward KL (default), reverse KL, Jensen-Shannon or total variation")
    d.add_argument("--on-policy", type=int, default=16, metavar="N",
                   help="also train on N of the corpus's prompts continued by the draft itself (default 16; 0: none)")
    d.add_argument("--lora-rank", type=int, default=16, metavar="R", help="LoRA rank (default 16)")
    d.add_argument("--lr", type=float, default=2e-4, help="learning rate (default 2e-4)")
    d.add_argument("--batch", type=int, default=2, metavar="B", help="sequences per step (default 2)")
    d.add_argument("--max-tokens", type=int, default=768, metavar="T",
                   help="longest sequence trained on, prompt included (default 768)")
    d.add_argument("--validation", type=float, default=0.1, metavar="SHARE",
                   help="share of the sequences held out to measure agreement and keep the best adapters (default 0.1)")
    d.add_argument("--eval-every", type=int, default=20, metavar="N", help="steps between held-out evaluations (default 20)")
    _corpus_arguments(d, prompts=16, tasks=48, new_tokens=128)
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    i = sub.add_parser("info", help="describe a training result")
    i.add_argument("dir", metavar="DIR", help="a result directory (or its checkpoint.pt)")
    return p


def _corpus_arguments(p: argparse.ArgumentParser, prompts: int = 32, tasks: int = 160, new_tokens: int = 192) -> None:
    """The options of the self-distilled corpus (:func:`~specviz.heads.corpus.build_corpus`)."""
    p.add_argument("--prompts", type=int, metavar="N", help=f"standard library prompts (default {prompts}; 4 with --tiny)")
    p.add_argument("--tasks", type=int, metavar="N",
                   help="prompts of the study's task kinds: writing, questions, word problems, translation, "
                        f"summaries, questions on a context, code (default {tasks}; 4 with --tiny)")
    p.add_argument("--written", type=int, metavar="N",
                   help="prompts of those kinds written by the target itself from its chat template and a kind's "
                        "first words, sampled (default 0)")
    p.add_argument("--new-tokens", type=int, metavar="N",
                   help=f"continuation tokens per prompt (default {new_tokens}; 32 with --tiny)")
    p.add_argument("--temperatures", default="0", metavar="T[,T...]",
                   help="one continuation per prompt and temperature; 0 is greedy, others are sampled with a seed "
                        "per prompt (default 0)")
    p.add_argument("--decode-batch", type=int, default=16, metavar="B",
                   help="prompts whose continuations are decoded together (default 16)")
    p.add_argument("--spec-bench", metavar="FILE", help="also use the prompts of this Spec-Bench-format file")
    p.add_argument("--exclude", metavar="CAT[,CAT...]",
                   help="held-out categories of --spec-bench (default: the evaluation categories)")
    p.add_argument("--seed", type=int, default=0, help="prompt choice, sampling and initialisation seed")
    p.add_argument("--dtype", default="fp32", help="weight mode of the target (default fp32)")
    p.set_defaults(corpus_defaults=(prompts, tasks, new_tokens))


def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise _UsageError(f"{name} must be > 0, got {value}")


def _corpus(args, target):
    """The self-distilled corpus the corpus options describe, built or read from the cache."""
    from specviz.heads.corpus import build_corpus
    from specviz.models.builtin import cache_dir

    _positive("--new-tokens", args.new_tokens)
    for name in ("prompts", "tasks", "written"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise _UsageError(f"--{name} must be >= 0, got {getattr(args, name)}")
    _positive("--decode-batch", args.decode_batch, allow_none=False)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        raise _UsageError(f"--temperatures must be numbers separated by commas, got {args.temperatures!r}") from None
    if not temperatures or min(temperatures) < 0:
        raise _UsageError(f"--temperatures must list values >= 0, got {args.temperatures!r}")
    default_prompts, default_tasks, default_tokens = args.corpus_defaults
    prompts = args.prompts if args.prompts is not None else (4 if args.tiny else default_prompts)
    tasks = args.tasks if args.tasks is not None else (4 if args.tiny else default_tasks)
    written = args.written or 0
    if prompts + tasks + written == 0 and args.spec_bench is None:
        raise _UsageError("no training prompts: --prompts, --tasks and --written are all 0 and there is no "
                          "--spec-bench")
    new_tokens = args.new_tokens if args.new_tokens is not None else (32 if args.tiny else default_tokens)
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
    print(f"corpus: {len(corpus)} sequences, {corpus.tokens} tokens, sha256 {corpus.sha256[:16]}", file=sys.stderr)
    return corpus


def _budget(args) -> None:
    if args.tiny == bool(args.target):
        raise _UsageError("give --target NAME or --tiny (exactly one)")
    for name in ("steps", "minutes"):
        _positive(f"--{name}", getattr(args, name))


def _train(args) -> int:
    from specviz.heads.training import HeadConfig, train_heads, training_precision
    from specviz.models.loading import load_model
    from specviz.models.tiny import tiny_pair

    _budget(args)
    if args.steps is None and args.minutes is None:
        raise _UsageError("give --steps or --minutes (or both)")
    _positive("--vocab", args.vocab)
    for name in ("heads", "batch", "window", "lr"):
        _positive(f"--{name}", getattr(args, name), allow_none=False)
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
    corpus = _corpus(args, target)
    print(f"training in {precision}", file=sys.stderr)
    result = train_heads(args.kind, target, corpus, minutes=args.minutes, steps=args.steps, out_dir=args.out,
                         config=config, progress=not args.no_progress)
    val = result.validation
    print(f"{args.kind} heads for {target.name}: {result.step} steps, loss {result.loss:.4f}, "
          f"top-1 {result.accuracy:.3f}" + (f"; validation top-1 {val['top1']:.3f} (best step {val['best_step']})"
                                             if val else "") + f" -> {result.path}")
    return 0


def _distill(args) -> int:
    from specviz.heads.distill import DistillConfig, distill_draft
    from specviz.models.builtin import DEFAULT_DRAFT
    from specviz.models.loading import load_model
    from specviz.models.tiny import tiny_pair

    _budget(args)
    if args.tiny and args.draft:
        raise _UsageError("--tiny distils the tiny pair's draft; leave out --draft")
    if args.on_policy < 0:
        raise _UsageError(f"--on-policy must be >= 0, got {args.on_policy}")
    config = DistillConfig(divergence=args.divergence, lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank,
                           lr=args.lr, batch_size=args.batch, max_tokens=args.max_tokens,
                           validation=args.validation, eval_every=args.eval_every, seed=args.seed)
    if args.tiny:
        pair = tiny_pair(seed=0)
        target, draft = pair.target, pair.draft
    else:
        target = load_model(args.target, args.dtype)
        draft = load_model(args.draft or DEFAULT_DRAFT, "fp32")
    corpus = _corpus(args, target)
    minutes = args.minutes if args.minutes is not None or args.steps is not None else 30.0
    result = distill_draft(target, draft, corpus, on_policy=args.on_policy, minutes=minutes, steps=args.steps,
                           config=config, out_dir=args.out, progress=not args.no_progress)
    shown = lambda v: f"top-1 {v['top1']:.3f}, 1-TVD {v['accept']:.3f}" if v else "not measured"  # noqa: E731
    print(f"{draft.name} distilled towards {target.name}: {result.step} steps, loss {result.loss:.4f}; held out: "
          f"before {shown(result.before)}, after {shown(result.after)} -> {result.path}")
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
            raise _UsageError("give a command: train, distill or info")
        return {"train": _train, "distill": _distill, "info": _info}[args.command](args)
    except (_UsageError, ValueError, FileNotFoundError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished work is kept; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Training draft heads on the target's own features, with checkpoints, resume and a cache.

* :class:`HeadConfig` - the training settings (and the reduced vocabulary size), from
  :mod:`~specviz.heads.config`;
* :func:`train_heads` - AdamW on random windows of the target's features
  (:mod:`specviz.models.features`) from a :class:`~specviz.heads.Corpus`, for a number of
  steps and/or minutes, with a progress bar (loss and top-1 accuracy) on stderr. A
  checkpoint is written atomically every ``checkpoint_minutes``, at the end and on
  Ctrl-C; calling it again with the same arguments resumes from the checkpoint (the
  batch sampler's random state included, so an interrupted run ends with the weights
  an uninterrupted one would have), and calling it on a finished run returns at once;
* :func:`heads_dir` - where a result lives by default: ``<cache>/heads/<target>/
  <kind>-<weight mode>-c<config hash>-d<data hash>`` under the specviz cache (``$SPECVIZ_CACHE`` or
  ``~/.cache/specviz``);
* :func:`load_heads` - a trained module back, checked against the target;
  :func:`find_heads` / :func:`load_cached_heads` - the result of a kind for a target
  that the registry's ``medusa`` and ``eagle`` strategies use (``$SPECVIZ_HEADS``, else
  the cached one trained on the most data); :func:`heads_validation` - what a run
  measured on its validation split;
* :func:`head_accuracy` - top-1 / top-k accuracy of every Medusa head.

A result directory holds ``checkpoint.pt`` (weights, optimizer, sampler state, step,
loss history) and ``meta.json`` (kind, target, hidden size, configuration, data size and
hash, progress), both replaced atomically.

Losses: Medusa - cross-entropy of head ``k`` against the token ``k + 1`` places after
the next one, heads weighted ``head_decay ** (k - 1)``; EAGLE - ``regression_weight`` x
smooth-L1 between predicted and true next features plus ``classification_weight`` x
cross-entropy of the LM head on the predicted feature against the target's next token.
Labels come only from continuation tokens (the target's own output), never from prompts;
the EAGLE head's input features get uniform noise of ``noise`` x their RMS, so that it
learns to continue from its own slightly wrong predictions, and with ``rollout`` > 1 it
is also trained on its own predictions, as a draft's deeper nodes feed it. The batches and
these losses are computed in :mod:`~specviz.heads.losses`.

Dimension legend: B = batch windows, W = window positions, H = hidden size, K = Medusa
heads, V = scored vocabulary.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from specviz.heads.config import PRECISIONS, HeadConfig, training_precision
from specviz.heads.corpus import Corpus
# the batches and losses of a training step (_batch_loss calls them through these names)
from specviz.heads.losses import (_eagle_batch, _eagle_loss, _medusa_batch, _medusa_loss,  # noqa: F401
                                  _rollout_mask, _windows)
from specviz.models.features import extract_features, load_features
from specviz.models.heads import MedusaHeads, reduced_vocab
from specviz.models.saved_heads import KINDS, build_heads, heads_root, name_slug, target_meta
from specviz.models.types import LoadedModel
from specviz.data.store import atomic_write_bytes, atomic_write_text
from specviz.validate import check_choice, check_int

__all__ = [
    "HeadConfig",
    "TrainResult",
    "config_hash",
    "heads_dir",
    "features_dir",
    "train_heads",
    "validation_split",
    "draft_vocab",
    "head_accuracy",
    "PRECISIONS",
    "training_precision",
]

_FORMAT = 1


@dataclass
class TrainResult:
    """What :func:`train_heads` returns.

    Attributes:
        path: the result directory.
        heads: the trained module (:class:`~specviz.heads.MedusaHeads` or
            :class:`~specviz.heads.EagleHead`), in eval mode.
        step: optimizer steps done in total.
        loss: mean loss of the last steps (nan before the first step).
        accuracy: mean top-1 accuracy of the last steps.
        finished: the step / time budget was reached (False after an interruption).
        history: ``(step, loss, accuracy)`` of every step (accuracy: top-1 of the first
            drafted token, Medusa's head 1 or the EAGLE head's next token).
        validation: None without a validation split; else what ``meta.json`` records
            under ``"validation"``: ``sequences``, ``tokens``, ``best_step`` (whose weights
            ``heads`` holds), ``loss``, ``top1``, ``history`` (``[step, loss, top1]`` of
            every pass) and, for Medusa, ``heads`` (per head: ``top1``, ``top5``,
            ``rank_accuracy`` of ranks 1-5, ``positions``).
    """

    path: Path
    heads: torch.nn.Module
    step: int
    loss: float
    accuracy: float
    finished: bool
    history: list[tuple[int, float, float]]
    validation: dict | None = None


def config_hash(kind: str, config: HeadConfig) -> str:
    """12 hex digits identifying ``kind`` trained with ``config``."""
    check_choice("kind", kind, KINDS)
    text = json.dumps({"kind": kind, **config.key_fields(kind)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def heads_dir(target_name: str, kind: str, config: HeadConfig, data_sha256: str,
              cache: str | os.PathLike | None = None, weight_mode: str = "fp32") -> Path:
    """The default result directory: ``<cache>/heads/<target>/<kind>-<mode>-c<config>-d<data>``,
    named like :func:`features_dir` by the weight mode of the target whose features the
    heads learn from."""
    return (heads_root(cache) / name_slug(target_name)
            / f"{kind}-{name_slug(weight_mode)}-c{config_hash(kind, config)}-d{data_sha256[:12]}")


def features_dir(target_name: str, data_sha256: str, cache: str | os.PathLike | None = None,
                 weight_mode: str = "fp32") -> Path:
    """The default feature directory of a target in a weight mode and a data set (shared by
    both kinds): ``<cache>/heads/<target>/features-<mode>-<data>``."""
    return heads_root(cache) / name_slug(target_name) / f"features-{name_slug(weight_mode)}-{data_sha256[:16]}"


# -- the modules -----------------------------------------------------------------------------

def draft_vocab(target: LoadedModel, data: Corpus, config: HeadConfig) -> torch.Tensor | None:
    """The token ids heads trained with ``config`` on ``data`` score (None: the full
    vocabulary): :func:`~specviz.heads.reduced_vocab` of the data with the target's
    end-of-sequence ids, filled with the tokenizer's first ids when ``config.vocab_fill``."""
    if not config.vocab:
        return None
    from specviz.decode.engine import eos_token_ids

    return reduced_vocab(data.sequences, config.vocab, always=eos_token_ids(target),
                         fill_to=target.vocab_size if config.vocab_fill else None)


# -- training steps --------------------------------------------------------------------------

def _batch_loss(kind: str, module, feats: list[torch.Tensor], data: Corpus, wins, cfg: HeadConfig,
                generator: torch.Generator | None) -> tuple[torch.Tensor, int, int]:
    """A kind's loss on the windows ``wins`` and its first drafted token's right guesses and
    labels, the products in ``cfg.precision`` (autocast on the module's device for bf16)."""
    import contextlib
    autocast = (contextlib.nullcontext() if cfg.precision == "fp32" else
                torch.autocast(device_type=next(module.parameters()).device.type, dtype=torch.bfloat16))
    with autocast:
        if kind == "medusa":
            return _medusa_loss(module, *_medusa_batch(feats, data, cfg.n_heads, wins), cfg.head_decay,
                                cfg.soft_labels)
        return _eagle_loss(module, _eagle_batch(feats, data, wins), cfg, generator)


def validation_split(n_sequences: int, share: float, seed: int) -> tuple[int, ...]:
    """The indices (sorted) of the sequences :func:`train_heads` holds out: ``round(share
    x n)`` of them, at least one and never all, drawn with ``seed``; none when ``share``
    is 0 or there is a single sequence."""
    check_int("n_sequences", n_sequences)
    if share <= 0 or n_sequences < 2:
        return ()
    count = min(max(round(share * n_sequences), 1), n_sequences - 1)
    order = torch.randperm(n_sequences, generator=torch.Generator().manual_seed(seed + 7919))
    return tuple(sorted(order[:count].tolist()))


@torch.no_grad()
def _validate(kind: str, module, feats: list[torch.Tensor], data: Corpus, held: Sequence[int],
              firsts: list[int], cfg: HeadConfig) -> tuple[float, float]:
    """Loss (mean over windows, weighted by their positions) and top-1 accuracy of the
    first drafted token on the held-out sequences, every position covered once."""
    wins = [(s, a, min(a + cfg.window, len(data.sequences[s]) - 1))
            for s in held for a in range(firsts[s], len(data.sequences[s]) - 1, cfg.window)]
    was_training = module.training
    module.eval()
    total, positions, correct, counted = 0.0, 0, 0, 0
    quiet = replace(cfg, noise=0.0)
    for i in range(0, len(wins), cfg.batch_size):
        batch = wins[i:i + cfg.batch_size]
        loss, right, count = _batch_loss(kind, module, feats, data, batch, quiet, None)
        n = sum(b - a for _, a, b in batch)
        total += float(loss) * n
        positions += n
        correct += right
        counted += count
    module.train(was_training)
    return (total / positions if positions else float("nan")), (correct / counted if counted else float("nan"))


# -- checkpoints -----------------------------------------------------------------------------

def _save(path: Path, payload: dict, meta: dict) -> None:
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(path / "checkpoint.pt", buf.getvalue())
    atomic_write_text(path / "meta.json", json.dumps(meta, indent=1, sort_keys=True) + "\n")


def _recent(history: list[tuple[int, float, float]], last: int = 20) -> tuple[float, float]:
    tail = history[-last:]
    if not tail:
        return float("nan"), float("nan")
    losses = [h[1] for h in tail]
    accs = [h[2] for h in tail if h[2] == h[2]]
    return sum(losses) / len(losses), (sum(accs) / len(accs) if accs else float("nan"))


def _check_same_run(path: Path, found: dict, wanted: dict) -> None:
    for key in ("kind", "target", "hidden_size", "config_hash", "data_sha256", "features_weight_mode"):
        if found.get(key) != wanted[key]:
            raise ValueError(f"{path} holds a training run with {key} {found.get(key)!r}, not {wanted[key]!r}; "
                             "give another out_dir")


@dataclass
class _Run:
    """A training run in progress: the module, its optimizer and batch sampler, and what
    a checkpoint keeps of them (step, elapsed seconds, histories, best validation weights)."""

    kind: str
    cfg: HeadConfig
    out: Path
    meta: dict
    module: torch.nn.Module
    params: list
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    steps: int | None
    minutes: float | None
    step: int = 0
    elapsed: float = 0.0
    history: list = field(default_factory=list)
    val_history: list = field(default_factory=list)
    best: dict = field(default_factory=dict)  # step, loss and state of the lowest validation loss so far

    def done(self, now_elapsed: float) -> bool:
        """Whether the step or time budget is reached after ``now_elapsed`` seconds."""
        return ((self.steps is not None and self.step >= self.steps)
                or (self.minutes is not None and now_elapsed >= self.minutes * 60))

    def optimizer_step(self, loss: torch.Tensor) -> None:
        """One AdamW step on ``loss`` (gradients clipped to ``cfg.grad_clip``)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1

    def evaluate(self, feats: list[torch.Tensor], data: Corpus, held: Sequence[int], firsts: list[int]) -> None:
        """A validation pass, keeping the weights if its loss is the lowest so far."""
        loss, acc = _validate(self.kind, self.module, feats, data, held, firsts, self.cfg)
        self.val_history.append((self.step, loss, acc))
        if not self.best or loss < self.best["loss"]:
            self.best.update(step=self.step, loss=loss,
                             state={k: v.detach().clone() for k, v in self.module.state_dict().items()})

    def save(self, finished: bool, now_elapsed: float, validation: dict | None = None) -> None:
        """The checkpoint and ``meta.json``, written atomically."""
        loss, acc = _recent(self.history)
        payload = {"format": _FORMAT, "meta": self.meta, "state": self.module.state_dict(),
                   "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                   "step": self.step, "elapsed_s": now_elapsed, "history": [list(h) for h in self.history],
                   "val_history": [list(h) for h in self.val_history], "best": self.best}
        extra = {"validation": validation} if validation is not None else {}
        _save(self.out, payload, {**self.meta, "step": self.step, "elapsed_s": round(now_elapsed, 3), "loss": loss,
                                  "accuracy": acc, "finished": finished, "updated": time.time(), **extra})

    def result(self, validation: dict | None) -> TrainResult:
        """The finished run: the best validation weights (if any) loaded, in eval mode."""
        if self.best:
            self.module.load_state_dict(self.best["state"])
        self.module.eval()
        loss, acc = _recent(self.history)
        return TrainResult(self.out, self.module, self.step, loss, acc, True, self.history, validation)


def _checked_config(kind: str, target: LoadedModel, data: Corpus, minutes: float | None, steps: int | None,
                    config: HeadConfig | None) -> HeadConfig:
    """The configuration of a :func:`train_heads` call, its arguments checked."""
    check_choice("kind", kind, KINDS)
    if not isinstance(data, Corpus):
        raise TypeError(f"data must be a specviz.heads.Corpus, got {type(data).__name__}")
    if steps is None and minutes is None:
        raise ValueError("give steps or minutes (or both): training runs until either is reached")
    if steps is not None:
        check_int("steps", steps)
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0):
        raise ValueError(f"minutes must be a number > 0, got {minutes!r}")
    cfg = config if config is not None else HeadConfig()
    if not isinstance(cfg, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(cfg).__name__}")
    if cfg.vocab is not None and cfg.vocab > target.vocab_size:
        raise ValueError(f"vocab {cfg.vocab} is larger than {target.name}'s vocabulary ({target.vocab_size})")
    top = max(max(s) for s in data.sequences)
    if top >= target.vocab_size:
        raise ValueError(f"data holds token id {top}, outside {target.name}'s vocabulary ({target.vocab_size})")
    return cfg


def _run_meta(kind: str, target: LoadedModel, data: Corpus, cfg: HeadConfig) -> dict:
    """What ``meta.json`` records of a run before its progress."""
    return {"format": _FORMAT, "kind": kind, **target_meta(target), "n_heads": cfg.n_heads if kind == "medusa"
            else None, "config": asdict(cfg), "config_hash": config_hash(kind, cfg), "data_sha256": data.sha256,
            "data_tokens": data.tokens, "data_sequences": len(data), "features_weight_mode": target.weight_mode}


def _start_run(kind: str, target: LoadedModel, data: Corpus, cfg: HeadConfig, out: Path, meta: dict,
               steps: int | None, minutes: float | None) -> _Run:
    """A new run's module, optimizer and batch sampler, resumed from ``out``'s checkpoint if
    it has one."""
    vocab_map = draft_vocab(target, data, cfg)
    module = build_heads(kind, target, cfg.n_heads, vocab_map, cfg.seed, cfg.mlp_size if kind == "eagle" else None)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    run = _Run(kind, cfg, out, meta, module, params, optimizer, generator, steps, minutes)
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        module.load_state_dict(saved["state"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        run.step, run.elapsed = int(saved["step"]), float(saved["elapsed_s"])
        run.history = [tuple(h) for h in saved["history"]]
        run.val_history = [tuple(h) for h in saved.get("val_history", [])]
        run.best = saved.get("best") or {}
    return run


def _sampling(kind: str, data: Corpus, cfg: HeadConfig) -> tuple[list[int], list[int], list[float], tuple[int, ...]]:
    """The sequence lengths, the first position a window must reach in each sequence, the
    sequences' sampling weights (0 for held-out ones) and the held-out sequences."""
    lengths = [len(s) for s in data.sequences]
    if kind == "medusa":  # windows that reach a position whose heads have a continuation label
        firsts = [max(p - 1 - cfg.n_heads, 0) for p in data.prompt_lengths]
        weights = [float(n - p) for n, p in zip(lengths, data.prompt_lengths)]
    else:
        firsts = [0] * len(lengths)
        weights = [float(n - 1) for n in lengths]
    if not any(weights):
        raise ValueError("the data has no continuation tokens to learn from (every sequence is all prompt)")
    held = validation_split(len(data), cfg.validation, cfg.seed)
    weights = [0.0 if i in held else w for i, w in enumerate(weights)]
    if not any(weights):
        raise ValueError("the sequences left for training after the validation split have no continuation tokens; "
                         "lower validation or add data")
    return lengths, firsts, weights, held


def _train_loop(run: _Run, feats: list[torch.Tensor], data: Corpus, sampling: tuple, progress: bool) -> None:
    """Optimizer steps until the run's budget is reached, with validation passes,
    checkpoints and a progress bar; on Ctrl-C a checkpoint (the unfinished step's batch
    drawn again on resume) before the ``KeyboardInterrupt`` propagates."""
    from tqdm import tqdm

    lengths, firsts, weights, held = sampling
    cfg = run.cfg
    start = time.monotonic()
    last_save = start
    run.module.train()
    bar = tqdm(initial=run.step, total=run.steps, desc=f"training {run.kind} heads", unit="step", file=sys.stderr,
               disable=not progress, mininterval=0.5)
    at_start = None
    try:
        while not run.done(run.elapsed + time.monotonic() - start):
            at_start = run.generator.get_state()  # restored if this step is interrupted
            wins = _windows(lengths, firsts, weights, cfg.batch_size, cfg.window, run.generator)
            loss, right, count = _batch_loss(run.kind, run.module, feats, data, wins, cfg, run.generator)
            run.optimizer_step(loss)
            at_start = None
            run.history.append((run.step, float(loss.detach()), right / count if count else float("nan")))
            if held and run.step % cfg.eval_every == 0:
                run.evaluate(feats, data, held, firsts)
            bar.update(1)
            bar.set_postfix(loss=f"{run.history[-1][1]:.3f}", acc=f"{run.history[-1][2]:.3f}", refresh=False,
                            **({"val_acc": f"{run.val_history[-1][2]:.3f}"} if run.val_history else {}))
            if time.monotonic() - last_save >= cfg.checkpoint_minutes * 60:
                run.save(False, run.elapsed + time.monotonic() - start)
                last_save = time.monotonic()
    except KeyboardInterrupt:
        if at_start is not None:  # the unfinished step's batch is drawn again on resume
            run.generator.set_state(at_start)
        run.save(False, run.elapsed + time.monotonic() - start)
        bar.close()
        print(f"\ninterrupted at step {run.step}; the checkpoint in {run.out} keeps it: run the same command to "
              "resume", file=sys.stderr)
        raise
    bar.close()
    run.elapsed += time.monotonic() - start


def train_heads(kind: str, target: LoadedModel, data: Corpus, *, minutes: float | None = None,
                steps: int | None = None, out_dir: str | os.PathLike | None = None,
                config: HeadConfig | None = None, features: str | os.PathLike | None = None,
                progress: bool = True) -> TrainResult:
    """Train ``kind`` heads ("medusa" or "eagle") for ``target`` on ``data``.

    The target's features of ``data`` are extracted first (cached in ``features``,
    default :func:`features_dir`); then AdamW runs until ``steps`` optimizer steps or
    ``minutes`` of training (in total over every call on this directory) are done,
    whichever comes first. Interrupting it (Ctrl-C) writes a checkpoint before the
    ``KeyboardInterrupt`` propagates; the same call again resumes. With
    ``config.validation`` > 0 a share of the sequences is held out
    (:func:`validation_split`): the weights returned (and loaded by :func:`load_heads`)
    are those of the lowest validation loss, and ``meta.json`` records the validation
    results.

    Args:
        kind: "medusa" or "eagle".
        target: the target model (frozen; its LM head and embeddings are shared).
        data: the training :class:`~specviz.heads.Corpus`.
        minutes: training time budget.
        steps: optimizer step budget.
        out_dir: the result directory (default :func:`heads_dir` in the specviz cache).
        config: training settings (default :class:`HeadConfig`).
        features: the feature directory (default :func:`features_dir`).
        progress: progress bars on stderr.

    Raises:
        ValueError: an unknown kind, neither ``steps`` nor ``minutes``, a reduced
            vocabulary larger than the target's, or an ``out_dir`` holding another run.
    """
    cfg = _checked_config(kind, target, data, minutes, steps, config)
    out = Path(out_dir) if out_dir is not None else heads_dir(target.name, kind, cfg, data.sha256,
                                                                    weight_mode=target.weight_mode)
    meta = _run_meta(kind, target, data, cfg)
    if (out / "meta.json").exists():
        _check_same_run(out, json.loads((out / "meta.json").read_text()), meta)
    run = _start_run(kind, target, data, cfg, out, meta, steps, minutes)
    if run.done(run.elapsed):  # a finished run: nothing to extract or train
        finished_meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
        return run.result(finished_meta.get("validation"))

    feat_dir = Path(features) if features is not None else features_dir(target.name, data.sha256,
                                                                             weight_mode=target.weight_mode)
    extract_features(target, data.sequences, feat_dir, sha256=data.sha256, dtype=cfg.feature_dtype,
                     progress=progress, kept=data.features)
    feats = load_features(feat_dir, sha256=data.sha256)
    lengths, firsts, weights, held = _sampling(kind, data, cfg)
    _train_loop(run, feats, data, (lengths, firsts, weights, held), progress)
    validation = None
    if held:
        if not run.val_history or run.val_history[-1][0] != run.step:
            run.evaluate(feats, data, held, firsts)
        validation = _validation_summary(kind, run.module, run.best, run.val_history, feats, data, held)
    run.save(True, run.elapsed, validation)
    return run.result(validation)


def _validation_summary(kind: str, module, best: dict, val_history: list, feats: list[torch.Tensor], data: Corpus,
                        held: Sequence[int]) -> dict:
    """What ``meta.json`` records of the validation split (the best weights' accuracy
    by Medusa head and rank included)."""
    out = {"sequences": len(held), "tokens": sum(len(data.sequences[s]) for s in held),
           "best_step": int(best["step"]), "loss": float(best["loss"]),
           "top1": next(float(a) for s, _, a in val_history if s == best["step"]),
           "history": [[int(s), float(l_), float(a)] for s, l_, a in val_history]}
    if kind == "medusa":
        best_heads = copy.deepcopy(module)  # the module itself keeps the last weights, which the checkpoint saves
        best_heads.load_state_dict(best["state"])
        best_heads.eval()
        table = head_accuracy(best_heads, [feats[s] for s in held], [data.sequences[s] for s in held], k=5,
                              start=[data.prompt_lengths[s] for s in held], by_rank=True)
        del best_heads
        ranks = sorted((c for c in table.columns if c.startswith("rank_")), key=lambda c: int(c.split("_")[1]))
        out["heads"] = [{"head": int(r["head"]), "top1": float(r["top1"]), "top5": float(r["top5"]),
                         "rank_accuracy": [float(r[c]) for c in ranks], "positions": int(r["positions"])}
                        for _, r in table.iterrows()]
    return out


# -- loading ---------------------------------------------------------------------------------

# -- evaluation ------------------------------------------------------------------------------

@torch.no_grad()
def head_accuracy(heads: MedusaHeads, features: torch.Tensor | Sequence[torch.Tensor],
                  tokens: Sequence[int] | torch.Tensor | Sequence[Sequence[int]], k: int = 5,
                  start: int | Sequence[int] = 0, by_rank: bool = False):
    """Top-1 and top-``k`` accuracy of every Medusa head, teacher-forced.

    Head ``j`` at position ``t`` is right when the target's token at ``t + 1 + j`` is its
    top-1 (top-``k``) candidate. With ``by_rank`` the table also says how often the right
    token is exactly the candidate of each rank: the acceptance probability of a
    Medusa tree node of that rank (:func:`~specviz.heads.medusa_tree` builds trees from it).

    Args:
        heads: the :class:`~specviz.heads.MedusaHeads`.
        features: ``(T, H)`` target features of one sequence, or one tensor per sequence.
        tokens: the sequence's ``T`` token ids, or one sequence per features tensor.
        k: the wider cut.
        start: score only labels at positions ``>= start`` (e.g. the prompt length; one
            value per sequence, or one for all).
        by_rank: add columns ``rank_1`` ... ``rank_<k>``.

    Returns:
        A pandas DataFrame, one row per head: ``head``, ``offset`` (tokens ahead of the
        position), ``top1``, ``top<k>``, ``positions`` (labels scored) and, with
        ``by_rank``, the share of labels found at each rank.
    """
    import pandas as pd

    if not isinstance(heads, MedusaHeads):
        raise TypeError(f"heads must be MedusaHeads, got {type(heads).__name__}")
    check_int("k", k)
    single = isinstance(features, torch.Tensor)
    feats = [features] if single else list(features)
    toks = [tokens] if single else list(tokens)
    if len(feats) != len(toks):
        raise ValueError(f"got {len(feats)} feature tensors for {len(toks)} token sequences")
    starts = [start] * len(feats) if isinstance(start, int) else list(start)
    width = min(k, heads.scored_vocab)
    at_rank = torch.zeros(heads.n_heads, width, dtype=torch.long)  # labels found at each rank
    counts = [0] * heads.n_heads
    for f, t, s0 in zip(feats, toks, starts):
        t = torch.as_tensor(t, dtype=torch.long)
        if f.shape[0] != t.numel():
            raise ValueError(f"features cover {f.shape[0]} positions but the sequence has {t.numel()} tokens")
        for a in range(0, f.shape[0], 256):
            chunk = f[a:a + 256]
            scores = heads.scores(heads.states(chunk.float().to(heads.blocks[0].weight.device))).cpu()  # (n, K, W)
            top = heads.token_ids(scores.topk(width, dim=-1).indices)  # (n, K, k) token ids
            for j in range(heads.n_heads):
                at = torch.arange(a, a + chunk.shape[0]) + 2 + j
                ok = (at < t.numel()) & (at >= s0)
                if not bool(ok.any()):
                    continue
                want = t[at[ok]]  # (m,)
                cand = top[ok, j]  # (m, k)
                at_rank[j] += (cand == want[:, None]).sum(0)
                counts[j] += int(ok.sum())
    rows = []
    for j in range(heads.n_heads):
        share = at_rank[j].double() / counts[j] if counts[j] else torch.full((width,), float("nan"))
        row = {"head": j + 1, "offset": j + 2, "top1": float(share[0]), f"top{k}": float(share.sum()),
               "positions": counts[j]}
        if by_rank:
            row.update({f"rank_{r + 1}": float(share[r]) for r in range(width)})
        rows.append(row)
    return pd.DataFrame(rows)

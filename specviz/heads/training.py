"""Training draft heads on the target's own features, with checkpoints, resume and a cache.

* :class:`HeadConfig` - the training settings (and the reduced vocabulary size);
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
is also trained on its own predictions, as a draft's deeper nodes feed it.

Dimension legend: B = batch windows, W = window positions, H = hidden size, K = Medusa
heads, V = scored vocabulary.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from specviz.heads.corpus import Corpus
from specviz.models.features import FEATURE_DTYPES, extract_features, load_features
from specviz.models.heads import EagleHead, MedusaHeads, reduced_vocab
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


@dataclass(frozen=True)
class HeadConfig:
    """Training settings of :func:`train_heads`.

    Attributes:
        n_heads: Medusa heads (draft depth); ignored by EAGLE.
        vocab: score only the ``vocab`` most frequent tokens of the training data
            (:func:`~specviz.heads.reduced_vocab`, end-of-sequence ids always in); None
            scores the full vocabulary.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        batch_size: windows per step.
        window: positions per window.
        head_decay: Medusa: weight of head ``k``'s loss is ``head_decay ** (k - 1)``.
        regression_weight: EAGLE: weight of the smooth-L1 feature loss.
        classification_weight: EAGLE: weight of the cross-entropy of the predicted feature.
        noise: EAGLE: uniform noise on input features, relative to each feature's RMS.
        mlp_size: EAGLE: the width of the head layer's MLP (None: the target's own
            ``intermediate_size``); narrower drafts cheaper (:class:`~specviz.heads.EagleHead`).
        rollout: EAGLE: the draft depths trained. 1 trains every position on the target's
            true features (EAGLE-1). With ``d`` > 1 each step also runs the head ``d - 1``
            more times on its own predictions, as a draft tree's deeper nodes do: at depth
            ``k`` a position's input is the head's depth ``k - 1`` prediction of its feature,
            and it attends to the true features up to ``k - 1`` positions back and to its
            own chain of predictions since (the "training-time test" of HASS and EAGLE-3).
            The depths' losses are averaged, depth ``k``'s weighted ``rollout_decay ** (k - 1)``;
            a step costs about ``d`` times as much.
        rollout_decay: EAGLE: the weight of each deeper depth's loss relative to the one
            above it (with ``rollout`` > 1).
        soft_labels: the share of the classification loss taken against the target's own
            distribution of the drafted position (its frozen LM head on its feature of the
            position before, over the scored vocabulary) instead of the token the data
            holds there: 0 trains on the tokens alone, 1 on the distributions alone (the
            self-distillation loss of Medusa-2). The tokens stay what accuracy is measured
            against.
        grad_clip: gradient norm clip (0 = none).
        seed: initial weights and batch sampling.
        feature_dtype: storage dtype of the cached features (a key of
            :data:`~specviz.models.features.FEATURE_DTYPES`).
        vocab_fill: fill a reduced vocabulary beyond the data's distinct tokens with the
            tokenizer's first ids (``reduced_vocab(..., fill_to=...)``).
        validation: share of the data's sequences held out of training (picked with
            ``seed``; at least one when the share is > 0 and the data has two or more).
            Every ``eval_every`` steps and at the end, the loss and top-1 accuracy on them
            are measured; the result keeps the weights of the lowest validation loss (early
            stopping) and records, for Medusa, every head's accuracy by rank on them
            (what the registry's ``medusa-n<N>`` trees are chosen from). 0 = no split.
        eval_every: optimizer steps between validation passes.
        precision: ``"fp32"``, or ``"bf16"``: the forward and backward products of a
            training step in bfloat16 (``torch.autocast``; weights, optimizer state and
            the losses stay float32). On a CPU with AVX512-BF16 a step's products are
            about 2.5 times as fast; on an AVX2-only CPU bfloat16 products are slower
            than float32. :func:`training_precision` picks one from a probe.
        checkpoint_minutes: minutes between checkpoints (not part of the result's key).
    """

    n_heads: int = 4
    vocab: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 8
    window: int = 128
    head_decay: float = 0.8
    regression_weight: float = 1.0
    classification_weight: float = 0.1
    noise: float = 0.1
    mlp_size: int | None = None
    rollout: int = 1
    rollout_decay: float = 1.0
    soft_labels: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    feature_dtype: str = "float16"
    vocab_fill: bool = True
    validation: float = 0.1
    eval_every: int = 25
    precision: str = "fp32"
    checkpoint_minutes: float = field(default=5.0, compare=False)

    def __post_init__(self) -> None:
        check_int("n_heads", self.n_heads)
        if self.vocab is not None:
            check_int("vocab", self.vocab, 2, note="(or None for the full vocabulary)")
        check_int("batch_size", self.batch_size)
        check_int("window", self.window)
        check_int("seed", self.seed, 0)
        check_int("eval_every", self.eval_every)
        check_int("rollout", self.rollout, note="(1 = trained on the target's true features only)")
        if self.mlp_size is not None:
            check_int("mlp_size", self.mlp_size, note="(or None for the target's MLP width)")
        if (isinstance(self.validation, bool) or not isinstance(self.validation, (int, float))
                or not 0 <= self.validation < 1):
            raise ValueError(f"validation must be a share in [0, 1), got {self.validation!r}")
        for name in ("lr", "weight_decay", "head_decay", "regression_weight", "classification_weight", "noise",
                     "soft_labels", "grad_clip", "checkpoint_minutes", "rollout_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.soft_labels > 1:
            raise ValueError(f"soft_labels must be a share in [0, 1], got {self.soft_labels!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.checkpoint_minutes <= 0:
            raise ValueError(f"checkpoint_minutes must be > 0, got {self.checkpoint_minutes!r}")
        check_choice("feature_dtype", self.feature_dtype, tuple(FEATURE_DTYPES))
        check_choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.vocab_fill, bool):
            raise ValueError(f"vocab_fill must be True or False, got {self.vocab_fill!r}")

    def key_fields(self, kind: str) -> dict:
        """The settings that change a ``kind`` result (those its cache key hashes)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.compare}
        drop = ("n_heads", "head_decay") if kind == "eagle" else ("regression_weight", "classification_weight",
                                                                  "noise", "mlp_size", "rollout",
                                                                  "rollout_decay")
        if self.precision == "fp32":  # results trained before the setting existed keep their key
            drop += ("precision",)
        if self.soft_labels == 0:  # likewise
            drop += ("soft_labels",)
        if self.mlp_size is None:  # likewise
            drop += ("mlp_size",)
        if self.rollout == 1:  # likewise
            drop += ("rollout", "rollout_decay")
        return {k: v for k, v in out.items() if k not in drop}


#: what :attr:`HeadConfig.precision` may be
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
_PROBED: dict[str, str] = {}


def training_precision(device: str | torch.device = "cpu") -> str:
    """The faster :attr:`HeadConfig.precision` on ``device``: on a CUDA GPU ``"bf16"``
    where it supports bfloat16; on a CPU the winner of a probe (measured once per
    process): a ``(512, 1536) x (1536, 4096)`` product, forward-sized for a head's
    training step, timed in both dtypes; ``"bf16"`` only if it is at least 1.3 times as
    fast. Other devices: ``"fp32"``."""
    import timeit

    dev = torch.device(device)
    if dev.type == "cuda":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if dev.type != "cpu":
        return "fp32"
    if "cpu" not in _PROBED:
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(512, 1536, generator=gen), torch.randn(4096, 1536, generator=gen)
        best = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = x.to(dtype), w.to(dtype)
            best[name] = min(timeit.repeat(lambda: F.linear(a, b), number=1, repeat=5))
        _PROBED["cpu"] = "bf16" if best["fp32"] >= 1.3 * best["bf16"] else "fp32"
    return _PROBED["cpu"]


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


# -- batches ---------------------------------------------------------------------------------

def _windows(lengths: list[int], firsts: list[int], weights: list[float], batch_size: int, window: int,
             generator: torch.Generator) -> list[tuple[int, int, int]]:
    """``(sequence, start, stop)`` of ``batch_size`` random windows: a sequence is drawn in
    proportion to ``weights``, a window covers at most ``window`` of its positions that
    have a next token (all but the last) and reaches position ``firsts[s]`` or later."""
    picks = torch.multinomial(torch.tensor(weights, dtype=torch.float64), batch_size, replacement=True,
                              generator=generator).tolist()
    out = []
    for s in picks:
        usable = lengths[s] - 1
        span = min(window, usable)
        low = min(max(firsts[s] - span + 1, 0), usable - span)
        start = low + int(torch.randint(0, usable - span - low + 1, (1,), generator=generator))
        out.append((s, start, start + span))
    return out


def _medusa_batch(features: list[torch.Tensor], data: Corpus, n_heads: int, wins) -> tuple[torch.Tensor, ...]:
    """Features ``(B, W + K, H)`` (each window's and the K after it, where the sequence has
    them: head ``k``'s label at position ``t`` follows the feature at ``t + k``) and labels
    ``(B, W, K)`` (-100 = no label)."""
    width = max(b - a for _, a, b in wins)
    h = features[0].shape[-1]
    feats = torch.zeros(len(wins), width + n_heads, h)
    labels = torch.full((len(wins), width, n_heads), -100, dtype=torch.long)
    for r, (s, a, b) in enumerate(wins):
        seq = torch.tensor(data.sequences[s])
        n, p = len(seq), data.prompt_lengths[s]
        stop = min(b + n_heads, n)
        feats[r, :stop - a] = features[s][a:stop].float()
        for k in range(1, n_heads + 1):
            at = torch.arange(a, b) + 1 + k  # label positions
            ok = (at < n) & (at >= p)
            labels[r, :b - a, k - 1] = torch.where(ok, seq[at.clamp(max=n - 1)], -100)
    return feats, labels


def _eagle_batch(features: list[torch.Tensor], data: Corpus, wins) -> tuple[torch.Tensor, ...]:
    """Input features, next tokens, positions, valid ``(B, W)``, target features
    ``(B, W, H)`` and labels ``(B, W)`` (-100 = no label) of EAGLE windows."""
    width = max(b - a for _, a, b in wins)
    h = features[0].shape[-1]
    b_ = len(wins)
    inputs = torch.zeros(b_, width, h)
    targets = torch.zeros(b_, width, h)
    tokens = torch.zeros(b_, width, dtype=torch.long)
    positions = torch.zeros(b_, width, dtype=torch.long)
    valid = torch.zeros(b_, width, dtype=torch.bool)
    labels = torch.full((b_, width), -100, dtype=torch.long)
    for r, (s, a, b) in enumerate(wins):
        seq = torch.tensor(data.sequences[s])
        n, p, m = len(seq), data.prompt_lengths[s], b - a
        inputs[r, :m] = features[s][a:b].float()
        targets[r, :m] = features[s][a + 1:b + 1].float()
        tokens[r, :m] = seq[a + 1:b + 1]
        positions[r, :m] = torch.arange(a, b)
        positions[r, m:] = b - 1
        valid[r, :m] = True
        at = torch.arange(a, b) + 2
        labels[r, :m] = torch.where((at < n) & (at >= p), seq[at.clamp(max=n - 1)], -100)
    return inputs, tokens, positions, valid, targets, labels


def _classification(logits: torch.Tensor, lab: torch.Tensor, teacher: torch.Tensor | None,
                    soft: float) -> torch.Tensor:
    """Cross-entropy of ``(M, V)`` logits against the ``(M,)`` label indices (-100 = none),
    with share ``soft`` against the softmax of the ``(M, V)`` teacher logits at the labelled
    rows instead."""
    if not soft or teacher is None:
        return F.cross_entropy(logits, lab, ignore_index=-100)
    rows = lab != -100  # the rows the tokens' loss counts: a token to follow, inside the scored vocabulary
    distill = F.cross_entropy(logits[rows], teacher[rows].float().softmax(-1))
    if soft == 1:  # the tokens' loss would be weighted 0: not computed
        return distill
    return (1 - soft) * F.cross_entropy(logits, lab, ignore_index=-100) + soft * distill


def _medusa_loss(heads: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor,
                 decay: float, soft: float = 0.0) -> tuple[torch.Tensor, int, int]:
    """The decay-weighted cross-entropy of the heads (share ``soft`` of it against the
    target's own distributions, :attr:`HeadConfig.soft_labels`), and head 1's right guesses
    and labels."""
    device = heads.blocks[0].weight.device
    feats = feats.to(device)
    width = labels.shape[1]
    states = heads.states(feats[:, :width])  # (B, W, K, H)
    labels = heads.label_index(labels.to(device))  # (B, W, K)
    teacher = None
    if soft:
        with torch.no_grad():
            teacher = heads.scores(feats)  # (B, W + K, V) the target's logits after each position
    total, weights, correct, counted = 0.0, 0.0, 0, 0
    for k in range(heads.n_heads):
        lab = labels[:, :, k].reshape(-1)
        count = int((lab != -100).sum())
        if count == 0:
            continue
        logits = heads.scores(states[:, :, k]).reshape(lab.numel(), -1)  # (B * W, V)
        weight = decay ** k
        wanted = None if teacher is None else teacher[:, k + 1:k + 1 + width].reshape(lab.numel(), -1)
        total = total + weight * _classification(logits, lab, wanted, soft)
        weights += weight
        if k == 0:
            correct, counted = int((logits.argmax(-1) == lab).sum()), count
    if not weights:
        return torch.zeros((), device=device, requires_grad=True), 0, 0
    return total / weights, correct, counted


def _rollout_mask(valid: torch.Tensor, depth: int) -> torch.Tensor:
    """``(B, W, depth x W)`` which slots the positions of draft depth ``depth`` (>= 2) may
    attend to, the slots being the depth-1 pass's positions and then each deeper pass's:
    position ``j`` sees the true-feature positions up to ``j - depth + 1`` (valid ones) and
    the position of its own chain in every deeper pass (``j - depth + r`` in pass ``r``),
    itself included."""
    b, w = valid.shape
    j = torch.arange(w, device=valid.device)
    parts = [(j[None, :] <= j[:, None] - depth + 1)[None] & valid[:, None, :]]  # (B, W, W) depth 1
    for r in range(2, depth + 1):
        parts.append((j[None, :] == j[:, None] - depth + r)[None].expand(b, w, w))
    return torch.cat(parts, dim=-1)


def _eagle_loss(head: EagleHead, batch, config: HeadConfig, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, int, int]:
    """The EAGLE loss (a weighted mean over :attr:`HeadConfig.rollout` draft depths), and the
    depth-1 right next-token guesses and labels (no input noise without a generator)."""
    from specviz.models.kvcache import new_cache
    inputs, tokens, positions, valid, targets, labels = batch
    if config.noise > 0 and generator is not None:
        rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()  # (B, W, 1)
        inputs = inputs + (torch.rand(inputs.shape, generator=generator) * 2 - 1) * config.noise * rms
    device = head.fc.weight.device
    tokens, positions, ok = tokens.to(device), positions.to(device), valid.to(device)
    targets = targets.to(device)
    lab = head.label_index(labels.to(device))  # (B, W)
    teacher = None
    if config.soft_labels:
        with torch.no_grad():  # the target's logits from its own next feature
            teacher = head.scores(targets)  # (B, W, V)
    depths = config.rollout
    cache = new_cache(head) if depths > 1 else None
    pred = head(inputs.to(device), tokens, positions, ok, cache)  # (B, W, H)
    loss, right, count, weights = 0.0, 0, 0, 0.0
    for depth in range(1, depths + 1):
        if depth > 1:  # each position's input: the previous depth's prediction of its feature
            fed = torch.cat([pred[:, :1], pred[:, :-1]], dim=1)
            pred = head.step(fed, tokens, positions, cache, _rollout_mask(ok, depth))
        rows = ok.clone()
        rows[:, :depth - 1] = False  # no true feature depth - 1 positions back
        term = config.regression_weight * F.smooth_l1_loss(pred[rows], targets[rows]) if rows.any() else 0.0
        depth_lab = torch.where(rows, lab, -100).reshape(-1)
        n = int((depth_lab != -100).sum())
        if n:
            logits = head.scores(pred).reshape(depth_lab.numel(), -1)  # (B * W, V)
            wanted = None if teacher is None else teacher.reshape(depth_lab.numel(), -1)
            term = term + config.classification_weight * _classification(logits, depth_lab, wanted,
                                                                         config.soft_labels)
            if depth == 1:
                right, count = int((logits.argmax(-1) == depth_lab).sum()), n
        weight = config.rollout_decay ** (depth - 1)
        loss, weights = loss + weight * term, weights + weight
    if not torch.is_tensor(loss):
        loss = torch.zeros((), device=device, requires_grad=True)
    return loss / weights, right, count


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
    from tqdm import tqdm

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
    out = Path(out_dir) if out_dir is not None else heads_dir(target.name, kind, cfg, data.sha256,
                                                                    weight_mode=target.weight_mode)
    meta = {"format": _FORMAT, "kind": kind, **target_meta(target), "n_heads": cfg.n_heads if kind == "medusa"
            else None, "config": asdict(cfg), "config_hash": config_hash(kind, cfg), "data_sha256": data.sha256,
            "data_tokens": data.tokens, "data_sequences": len(data), "features_weight_mode": target.weight_mode}
    if (out / "meta.json").exists():
        _check_same_run(out, json.loads((out / "meta.json").read_text()), meta)

    vocab_map = draft_vocab(target, data, cfg)
    module = build_heads(kind, target, cfg.n_heads, vocab_map, cfg.seed, cfg.mlp_size if kind == "eagle" else None)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    step, elapsed, history, val_history = 0, 0.0, [], []
    best: dict = {}  # step, loss and state of the lowest validation loss so far
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        module.load_state_dict(saved["state"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        step, elapsed = int(saved["step"]), float(saved["elapsed_s"])
        history = [tuple(h) for h in saved["history"]]
        val_history = [tuple(h) for h in saved.get("val_history", [])]
        best = saved.get("best") or {}

    def done(now_elapsed: float) -> bool:
        return (steps is not None and step >= steps) or (minutes is not None and now_elapsed >= minutes * 60)

    if done(elapsed):  # a finished run: nothing to extract or train
        if best:
            module.load_state_dict(best["state"])
        module.eval()
        loss, acc = _recent(history)
        finished_meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
        return TrainResult(out, module, step, loss, acc, True, history, finished_meta.get("validation"))

    feat_dir = Path(features) if features is not None else features_dir(target.name, data.sha256,
                                                                             weight_mode=target.weight_mode)
    extract_features(target, data.sequences, feat_dir, sha256=data.sha256, dtype=cfg.feature_dtype,
                     progress=progress, kept=data.features)
    feats = load_features(feat_dir, sha256=data.sha256)
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

    def save(finished: bool, now_elapsed: float, validation: dict | None = None) -> None:
        loss, acc = _recent(history)
        payload = {"format": _FORMAT, "meta": meta, "state": module.state_dict(), "optimizer": optimizer.state_dict(),
                   "generator": generator.get_state(), "step": step, "elapsed_s": now_elapsed,
                   "history": [list(h) for h in history], "val_history": [list(h) for h in val_history],
                   "best": best}
        extra = {"validation": validation} if validation is not None else {}
        _save(out, payload, {**meta, "step": step, "elapsed_s": round(now_elapsed, 3), "loss": loss,
                             "accuracy": acc, "finished": finished, "updated": time.time(), **extra})

    def evaluate() -> None:
        loss, acc = _validate(kind, module, feats, data, held, firsts, cfg)
        val_history.append((step, loss, acc))
        if not best or loss < best["loss"]:
            best.update(step=step, loss=loss, state={k: v.detach().clone() for k, v in module.state_dict().items()})

    start = time.monotonic()
    last_save = start
    module.train()
    bar = tqdm(initial=step, total=steps, desc=f"training {kind} heads", unit="step", file=sys.stderr,
               disable=not progress, mininterval=0.5)
    at_start = None
    try:
        while not done(elapsed + time.monotonic() - start):
            at_start = generator.get_state()  # restored if this step is interrupted
            wins = _windows(lengths, firsts, weights, cfg.batch_size, cfg.window, generator)
            loss, right, count = _batch_loss(kind, module, feats, data, wins, cfg, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            step += 1
            at_start = None
            history.append((step, float(loss.detach()), right / count if count else float("nan")))
            if held and step % cfg.eval_every == 0:
                evaluate()
            bar.update(1)
            bar.set_postfix(loss=f"{history[-1][1]:.3f}", acc=f"{history[-1][2]:.3f}", refresh=False,
                            **({"val_acc": f"{val_history[-1][2]:.3f}"} if val_history else {}))
            if time.monotonic() - last_save >= cfg.checkpoint_minutes * 60:
                save(False, elapsed + time.monotonic() - start)
                last_save = time.monotonic()
    except KeyboardInterrupt:
        if at_start is not None:  # the unfinished step's batch is drawn again on resume
            generator.set_state(at_start)
        save(False, elapsed + time.monotonic() - start)
        bar.close()
        print(f"\ninterrupted at step {step}; the checkpoint in {out} keeps it: run the same command to resume",
              file=sys.stderr)
        raise
    bar.close()
    elapsed += time.monotonic() - start
    validation = None
    if held:
        if not val_history or val_history[-1][0] != step:
            evaluate()
        validation = _validation_summary(kind, module, best, val_history, feats, data, held)
    save(True, elapsed, validation)
    if best:
        module.load_state_dict(best["state"])
    module.eval()
    loss, acc = _recent(history)
    return TrainResult(out, module, step, loss, acc, True, history, validation)


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

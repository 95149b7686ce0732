"""The settings of draft-head training.

* :class:`HeadConfig` - the training settings of :func:`~specviz.heads.train_heads` (and
  the reduced vocabulary size), with the fields that key a result
  (:meth:`HeadConfig.key_fields`);
* :data:`PRECISIONS` and :func:`training_precision` - the precisions a training step may
  run in, and the faster one on a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from specviz.models.features import FEATURE_DTYPES
from specviz.validate import check_choice, check_int

__all__ = ["HeadConfig", "PRECISIONS", "training_precision"]


@dataclass(frozen=True)
class HeadConfig:
    """Training settings of :func:`~specviz.heads.train_heads`.

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

"""Batches and losses of draft-head training.

* random windows of a corpus's sequences, drawn in proportion to their continuation
  tokens (the batch sampler of :func:`~specviz.heads.train_heads`);
* the Medusa batch and loss: cross-entropy of head ``k`` against the token ``k + 1``
  places after the next one, heads weighted ``head_decay ** (k - 1)``;
* the EAGLE batch and loss: ``regression_weight`` x smooth-L1 between predicted and true
  next features plus ``classification_weight`` x cross-entropy of the LM head on the
  predicted feature, over :attr:`~specviz.heads.HeadConfig.rollout` draft depths, with
  uniform input noise;
* with :attr:`~specviz.heads.HeadConfig.soft_labels`, a share of each classification
  loss taken against the target's own distribution instead of the data's token.

Labels come only from continuation tokens, never from prompts (-100 = no label).

Dimension legend: B = batch windows, W = window positions, H = hidden size, K = Medusa
heads, V = scored vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specviz.heads.config import HeadConfig
from specviz.heads.corpus import Corpus
from specviz.models.heads import EagleHead, MedusaHeads

__all__: list[str] = []


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

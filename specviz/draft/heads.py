"""Drafters that run trained heads on the target's own hidden states.

* :class:`MedusaDrafter` - a static Medusa tree: every node at depth ``d`` takes the
  candidate of its rank from head ``d``'s ranking (:class:`~specviz.heads.MedusaHeads`,
  all heads read the target's last hidden state at the last verified position), so one
  head forward drafts the whole tree;
* :class:`EagleDrafter` - EAGLE-2's dynamic tree grown with an
  :class:`~specviz.heads.EagleHead`: expand by cumulative confidence, keep the global
  top-k per depth, rerank everything to the budget (the same growth as
  :class:`~specviz.draft.DynamicTreeDrafter`, :func:`~specviz.draft.grow_dynamic_tree`);
  ``topk=1`` drafts an EAGLE chain.

Both read the target's last hidden states at the committed tokens
(their :attr:`~specviz.draft.Drafter.reads` holds ``"hidden"``): the engine passes the
prefill's and each verification's through :meth:`~specviz.draft.Drafter.observe`. When a
drafter is used without them (a direct :meth:`draft` call, a greedy replay, a merged
tree) it computes the missing ones itself with one teacher-forced target forward over
the context (:func:`~specviz.heads.target_features`), so it proposes the same trees
either way, only slower.

The EAGLE head keeps its own KV cache for its one layer: the committed context's
``(feature, next token)`` pairs, extended by the true features of newly committed
tokens at each step; the draft tree's nodes (fed with the head's own predicted
features) are appended during a step and dropped at the next.

Both draft deterministic siblings (the top candidates): under sampling, verify with a
rule whose ``sibling_sampling`` is "topk".

Dimension legend: L = committed length, H = hidden size, V = vocabulary, K = Medusa
heads, n = nodes fed in one head forward.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch

from specviz.draft.base import Drafter
from specviz.draft.model import draft_distribution, drafted_tree, grow_dynamic_tree
from specviz.models.features import target_features
from specviz.models.heads import EagleHead, MedusaHeads
from specviz.models.kvcache import crop_cache, new_cache
from specviz.models.types import LoadedModel
from specviz.quant.weights import weight_mode_of
from specviz.sampling import require_deterministic_siblings
from specviz.tree.core import DraftTree
from specviz.tree.shapes import TreeShape, expansion, from_paths
from specviz.validate import check_int

__all__ = ["MedusaDrafter", "EagleDrafter", "MEDUSA_BRANCHING", "medusa_tree", "head_drafter", "head_calibration"]

#: the default Medusa tree: 3 candidates of head 1, 2 of head 2 under each, then 1 and 1
MEDUSA_BRANCHING: tuple[int, ...] = (3, 2, 1, 1)


def medusa_tree(rank_accuracy, budget: int) -> TreeShape:
    """The Medusa tree of ``budget`` draft nodes with the most expected accepted tokens,
    from measured per-head, per-rank accuracies (Medusa's way of choosing its "choices").

    A node at depth ``d`` that takes head ``d``'s rank-``r`` candidate is accepted when
    its parent is and that candidate is the target's token. Taking the heads as
    independent, as Medusa does, its acceptance probability is the product of the
    accuracies along its path, and a tree's expected accepted tokens per step is the sum
    of those products over its nodes. A child's product never exceeds its parent's, so
    adding the best node of the frontier ``budget`` times gives the best tree of that
    size (ties go to the node found first: shallower, lower ranks).

    Args:
        rank_accuracy: ``(K, R)`` numbers, entry ``[d - 1][r - 1]`` the probability that
            head ``d``'s rank-``r`` candidate is right; or the DataFrame of
            :func:`~specviz.heads.head_accuracy` with ``by_rank=True``.
        budget: draft nodes (the root not counted).

    Returns:
        The :class:`~specviz.tree.shapes.TreeShape` (depth at most ``K``; fewer than
        ``budget`` nodes only when every path with a non-zero product is taken).

    Raises:
        ValueError: a bad budget, an empty table, or a value outside ``[0, 1]`` or NaN.
    """
    check_int("budget", budget)
    if hasattr(rank_accuracy, "filter"):  # the head_accuracy table
        cols = sorted(rank_accuracy.filter(regex=r"^rank_\d+$").columns, key=lambda c: int(c.split("_")[1]))
        if not cols:
            raise ValueError("rank_accuracy has no rank_<r> columns; compute it with head_accuracy(..., by_rank=True)")
        rank_accuracy = rank_accuracy[cols].to_numpy()
    table = [[float(v) for v in row] for row in rank_accuracy]
    if not table or not table[0]:
        raise ValueError("rank_accuracy must have at least one head and one rank")
    for d, row in enumerate(table):
        for r, v in enumerate(row):
            if math.isnan(v) or not 0.0 <= v <= 1.0:
                raise ValueError(f"rank_accuracy[{d}][{r}] must be a probability in [0, 1], got {v}")
    frontier = [(-table[0][r], 0, (r,)) for r in range(len(table[0])) if table[0][r] > 0]
    heapq.heapify(frontier)
    order = len(frontier)
    paths = []
    while frontier and len(paths) < budget:
        neg, _, path = heapq.heappop(frontier)
        paths.append(path)
        if len(path) < len(table):
            for r, v in enumerate(table[len(path)]):
                if v > 0:
                    heapq.heappush(frontier, (neg * v, order, path + (r,)))
                    order += 1
    return from_paths(paths) if paths else TreeShape((-1,), (0,))


def head_calibration(target: LoadedModel, max_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """What the calibrated weight modes of draft heads (``w8a8-token``, ``w4a8-token``)
    measure their layers' input ranges on: ``target``'s ``(T, H)`` features of the
    calibration text of its own weight modes (:func:`~specviz.models.convert.calibration_ids`,
    at most ``max_tokens + 1`` tokens) and the ``(T,)`` tokens after them. Computed once
    per loaded target (one forward over the text) and kept on it."""
    from specviz.models.convert import calibration_ids

    held = target.__dict__.get("_specviz_head_calibration")
    if held is None or held[0] != max_tokens:
        ids = calibration_ids(target.tokenizer, max_tokens + 1)[0].clamp(max=target.vocab_size - 1)  # (T + 1,)
        features = target_features(target, ids)  # (T + 1, H)
        held = (max_tokens, features[:-1], ids[1:])
        target.__dict__["_specviz_head_calibration"] = held
    return held[1], held[2]


def _cast_heads(target: LoadedModel, heads, dtype):
    """``heads`` in weight mode ``dtype`` (calibrated on :func:`head_calibration` where the
    mode needs it)."""
    from specviz.quant.weights import parse_weight_mode

    calibration = head_calibration(target) if parse_weight_mode(dtype).calibrated else None
    return heads.cast(dtype, calibration)


class _TargetFeatures:
    """The target's last hidden states at one sequence's committed tokens but the last."""

    def __init__(self, known: tuple[list[int], torch.Tensor] | None = None) -> None:
        self.tokens: list[int] = []
        self.features: torch.Tensor | None = None  # (unknown + len(tokens), H)
        self._unknown = 0  # leading positions of features whose token ids were not seen (the prompt's)
        self._prefill: torch.Tensor | None = None
        self._known = known  # features of a longer sequence, sliced where the context is its prefix

    def observe(self, step, hidden: torch.Tensor) -> None:
        """Take the engine's hidden states (see :class:`~specviz.draft.base.TargetOutputs`)."""
        hidden = hidden.detach().float().cpu()
        if step is None:
            self.tokens, self.features, self._prefill, self._unknown = [], None, hidden, 0
            return
        if self.features is None and self._prefill is not None and self._prefill.shape[0] == step.context_len - 1:
            # another drafter drafted the first steps (a cascade): the prompt's features come from
            # the prefill; its token ids are checked against the context at the next draft
            self.tokens, self.features, self._unknown, self._prefill = [], self._prefill, self._prefill.shape[0], None
        if self.features is None or self._unknown + len(self.tokens) != step.context_len - 1:
            self.tokens, self.features, self._unknown = [], None, 0  # out of step: recomputed at the next draft
            return
        nodes = [0] + list(step.acceptance.accepted_nodes)
        self.tokens.extend(step.tree.tokens[nodes].tolist())
        self.features = torch.cat([self.features, hidden[nodes]])

    def covering(self, target: LoadedModel, context: list[int]) -> torch.Tensor:
        """``(L - 1, H)`` features of ``context[:-1]``, computed when not observed."""
        want = context[:-1]
        if self._prefill is not None:
            if self._prefill.shape[0] == len(want):
                self.tokens, self.features, self._unknown = list(want), self._prefill, 0
            self._prefill = None
        if self._unknown:
            if len(want) == self._unknown + len(self.tokens) and want[self._unknown:] == self.tokens:
                self.tokens = list(want)  # the observed steps continue this context: its prompt is the prefill's
            else:
                self.features = None
            self._unknown = 0
        if self.features is None or self.tokens != want:
            known_tokens, known = self._known if self._known is not None else ([], None)
            if known is not None and len(want) <= len(known_tokens) and known_tokens[:len(want)] == want:
                self.tokens, self.features = list(want), known[:len(want)]
            else:
                self.tokens, self.features = list(want), target_features(target, want)
        return self.features


class _HeadDrafter(Drafter):
    """What both head drafters share: the target, the features, the checks.

    ``heads_path`` is the training result the heads were loaded from, when known
    (:func:`head_drafter` sets it, for the registry's drafters too); the benchmark
    records it next to the drafter's name.
    """

    reads = frozenset({"hidden"})
    heads_path = None

    def __init__(self, target: LoadedModel, heads, kind: type) -> None:
        if not isinstance(target, LoadedModel):
            raise TypeError(f"target must be a specviz LoadedModel, got {type(target).__name__}")
        if not isinstance(heads, kind):
            raise TypeError(f"heads must be {kind.__name__}, got {type(heads).__name__}")
        hidden = int(target.model.config.hidden_size)
        if heads.hidden_size != hidden:
            raise ValueError(f"the heads have hidden size {heads.hidden_size}, but target {target.name!r} has {hidden}")
        if heads.vocab_size != target.vocab_size:
            raise ValueError(f"the heads score a vocabulary of {heads.vocab_size}, but target {target.name!r} has "
                             f"{target.vocab_size}")
        self.target = target
        self.heads = heads
        self._known: tuple[list[int], torch.Tensor] | None = None
        self.reset()

    def reset(self) -> None:
        self.features = _TargetFeatures(self._known)

    def provide_features(self, token_ids: Sequence[int], features: torch.Tensor) -> None:
        """Give the target's features of a sequence this drafter will draft along, e.g. a
        replay's prompt plus its recorded continuation (:func:`~specviz.heads.target_features`
        of it, which :func:`~specviz.heads.head_accuracy` needs too): wherever the context
        is a prefix of ``token_ids``, drafting slices them instead of running the target
        over the context, which makes replays of head drafters cost little more than the
        heads. Kept across :meth:`reset`; ``provide_features([], empty)`` forgets them.

        Raises:
            ValueError: ``features`` is not ``(len(token_ids), hidden size)``.
        """
        ids = [int(t) for t in token_ids]
        hidden = int(self.target.model.config.hidden_size)
        if not isinstance(features, torch.Tensor) or tuple(features.shape) != (len(ids), hidden):
            shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
            raise ValueError(f"features must be ({len(ids)}, {hidden}) for {len(ids)} token ids, got {shape}")
        self._known = (ids, features.detach().float().cpu()) if ids else None
        self.reset()

    def observe(self, step, outputs=None) -> None:
        if outputs is not None and outputs.hidden is not None:
            self.features.observe(step, outputs.hidden)

    @property
    def tokenizers(self) -> tuple:
        return (self.target.tokenizer,)

    def _context(self, context, config, sibling_sampling) -> list[int]:
        require_deterministic_siblings(self.name, config, sibling_sampling)
        t = torch.as_tensor(context)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"context must be a non-empty 1-D tensor of token ids, got shape {tuple(t.shape)}")
        return t.tolist()


class MedusaDrafter(_HeadDrafter):
    """Medusa: a static tree whose depth-``d`` nodes are head ``d``'s top candidates.

    Node ``i`` of the shape at depth ``d`` takes the candidate of rank ``shape.ranks[i]``
    of head ``d`` at the last verified position, whatever its parent (Medusa's
    Cartesian tree). Candidates of zero probability (outside a reduced vocabulary) are
    left out with their subtrees.

    Args:
        target: the target model the heads were trained for.
        heads: trained :class:`~specviz.heads.MedusaHeads` (:func:`~specviz.heads.load_heads`).
        shape: a :class:`~specviz.tree.shapes.TreeShape`, or Medusa "choices" (one rank
            path per node, :func:`~specviz.tree.shapes.from_paths`); default: the
            expansion :data:`MEDUSA_BRANCHING` cut to the number of heads.
        dtype: the weight mode the heads' blocks (and, for the integer modes, their scored
            LM-head rows) draft in: None keeps the trained float32 heads; ``"w8a8-token"`` reads
            a quarter of float32's bytes, ``"w4a8-token"`` an eighth, with int8 activations
            (calibrated on :func:`head_calibration`; :meth:`MedusaHeads.cast`).
            Verification is the target's either way, so decoding stays lossless.

    Raises:
        ValueError: a shape deeper than the number of heads, or heads that do not fit
            the target.
    """

    def __init__(self, target: LoadedModel, heads: MedusaHeads,
                 shape: TreeShape | Sequence[Sequence[int]] | None = None,
                 dtype: torch.dtype | str | None = None) -> None:
        if shape is None:
            shape = expansion(list(MEDUSA_BRANCHING[:heads.n_heads]) if isinstance(heads, MedusaHeads) else [1])
        elif not isinstance(shape, TreeShape):
            shape = from_paths(shape)
        if isinstance(heads, MedusaHeads) and shape.depth > heads.n_heads:
            raise ValueError(f"the shape has depth {shape.depth} but the heads draft only {heads.n_heads} tokens "
                             "ahead; use a shallower shape or heads trained with more of them")
        self.shape = shape
        if dtype is not None and isinstance(heads, MedusaHeads):
            heads = _cast_heads(target, heads, dtype)
        mode = weight_mode_of(heads.blocks) if isinstance(heads, MedusaHeads) else "fp32"
        suffix = "" if mode == "fp32" else f",{mode}"  # the heads' weight mode, when not as trained
        self.name = f"medusa(n={shape.budget},d={shape.depth}{suffix})"
        super().__init__(target, heads, MedusaHeads)

    @torch.no_grad()
    def draft(self, context, config, sibling_sampling, generator) -> DraftTree:
        ctx = self._context(context, config, sibling_sampling)
        shape = self.shape
        if len(ctx) < 2 or shape.budget == 0:  # no verified position yet: no proposal
            return DraftTree.from_lists([ctx[-1]], [-1])
        hidden = self.features.covering(self.target, ctx)[-1]  # (H,)
        # the heads the shape reaches alone (a shallow tree leaves the deeper heads idle)
        logits = self.heads.full_logits(self.heads.states(hidden.to(self.heads.out_weight.device), shape.depth))
        logits = logits.cpu()  # (D, V)
        dist = draft_distribution(logits, config)  # (D, V)
        top = torch.topk(logits, min(max(shape.ranks) + 1, logits.shape[-1]), dim=-1).indices  # (D, R)
        depth = shape.depths()
        out = {0: 0}  # shape node -> drafted-tree index
        tokens, parents, qs, ranks = [], [], [], []
        for i in range(1, shape.n_nodes):
            d, r, p = depth[i], shape.ranks[i], shape.parents[i]
            if p not in out or r >= top.shape[-1]:
                continue
            tok = int(top[d - 1, r])
            q = float(dist[d - 1, tok])
            if q <= 0.0:
                continue
            out[i] = len(tokens) + 1
            tokens.append(tok)
            parents.append(out[p])
            qs.append(q)
            ranks.append(r)
        return drafted_tree(ctx[-1], tokens, parents, qs, ranks, None)


class _HeadCache:
    """The EAGLE head's KV cache for one sequence: the committed ``(feature, next token)``
    pairs in slots ``[0, L - 1)`` (pair ``i`` at position ``i``), then the draft nodes fed
    during the current step."""

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.cache = new_cache(head)
        self.tokens: list[int] = []  # the context whose pairs are cached
        self._parent: list[int] = []  # fed node -> parent handle (-1 = the root)
        self._depth: list[int] = []

    def sync(self, context: list[int], features: torch.Tensor) -> torch.Tensor:
        """Feed the pairs of ``context`` the cache lacks; returns the ``(H,)`` predicted
        feature at the root (the last pair's output). ``features``: ``(L - 1, H)``."""
        common = 0
        limit = min(len(self.tokens), len(context))
        while common < limit and self.tokens[common] == context[common]:
            common += 1
        # pair i needs context[:i + 2]; feed at least the last pair, whose output drafts depth 1
        keep = max(0, min(common - 1, len(context) - 2))
        crop_cache(self.cache, keep)
        n = len(context) - 1 - keep
        allowed = torch.cat([torch.ones(n, keep, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()],
                            dim=1)  # (n, keep + n)
        out = self.head.step(features[keep:][None], torch.tensor([context[keep + 1:]]),
                             torch.arange(keep, len(context) - 1)[None], self.cache, allowed[None])  # (1, n, H)
        self.tokens = list(context)
        self._parent, self._depth = [], []
        return out[0, -1]

    def expand(self, features: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Feed draft nodes: each reads its parent's predicted feature (``features``
        ``(n, H)``) and its own token, and sees the committed pairs, its ancestors and
        itself. Returns the nodes' ``(n, H)`` predicted features and their handles."""
        base = len(self.tokens) - 1  # committed pairs
        f0 = len(self._parent)
        n = len(tokens)
        allowed = torch.zeros(n, base + f0 + n, dtype=torch.bool)  # (n, L - 1 + F + n)
        allowed[:, :base] = True
        positions = []
        for j, p in enumerate(parents):
            depth = 1 if p == -1 else self._depth[p] + 1
            positions.append(base - 1 + depth)
            allowed[j, base + f0 + j] = True
            while p != -1:
                allowed[j, base + p] = True
                p = self._parent[p]
            self._depth.append(depth)
        self._parent.extend(parents)
        out = self.head.step(features[None], torch.tensor([tokens]), torch.tensor([positions]), self.cache,
                             allowed[None])  # (1, n, H)
        return out[0], list(range(f0, f0 + n))


class EagleDrafter(_HeadDrafter):
    """EAGLE-2 with a trained feature head: a dynamic tree (or, with ``topk=1``, a chain).

    The head turns the target's features of the context into a predicted feature at
    the root, whose LM-head logits give the root's children; every node fed to the head
    gets its parent's predicted feature and its own token, and its output feature gives
    its children. The tree grows as :class:`~specviz.draft.DynamicTreeDrafter`'s does:
    ``topk`` children per frontier node, the global ``topk`` best become the next
    frontier, ``depth`` levels, the best ``budget`` nodes kept.

    Args:
        target: the target model the head was trained for.
        head: a trained :class:`~specviz.heads.EagleHead` (:func:`~specviz.heads.load_heads`).
        topk: children per frontier node and frontier width.
        depth: tree depth (head forwards per step, besides the context's).
        budget: draft nodes kept.
        dtype: the weight mode the head's layers draft in: None keeps the trained head's
            (float32); ``"bf16"`` / ``torch.bfloat16`` halves the bytes a head forward
            reads, which pays on CPUs with bf16 instructions; ``"w8a8-token"`` /
            ``"w4a8-token"`` (CPU kernels) read a quarter / an eighth (:meth:`EagleHead.cast`).
            Verification is the target's either way, so decoding stays lossless.
    """

    def __init__(self, target: LoadedModel, head: EagleHead, topk: int = 4, depth: int = 5, budget: int = 16,
                 dtype: torch.dtype | str | None = None) -> None:
        for name, value in (("topk", topk), ("depth", depth), ("budget", budget)):
            check_int(name, value)
        self.topk, self.depth, self.budget = topk, depth, budget
        if dtype is not None and isinstance(head, EagleHead):
            head = _cast_heads(target, head, dtype)
        mode = weight_mode_of(head.layer) if isinstance(head, EagleHead) else "fp32"
        suffix = "" if mode == "fp32" else f",{mode}"  # the head's weight mode, when not as trained
        self.name = f"eagle-chain(k={depth}{suffix})" if topk == 1 and budget >= depth else \
            f"eagle(k={topk},d={depth},n={budget}{suffix})"
        super().__init__(target, head, EagleHead)
        self._token_ids = None if self.heads.vocab_map is None else self.heads.vocab_map.cpu().tolist()

    def reset(self) -> None:
        super().reset()
        self.head_cache = _HeadCache(self.heads)

    def draft(self, context, config, sibling_sampling, generator) -> DraftTree:
        return self._grow(context, config, sibling_sampling, self.budget)

    def draft_steps_within(self, max_nodes, context, config, sibling_sampling, generator):
        check_int("max_nodes", max_nodes)
        yield from ()
        return self._grow(context, config, sibling_sampling, min(self.budget, max_nodes))

    @torch.no_grad()
    def _grow(self, context, config, sibling_sampling, budget: int) -> DraftTree:
        ctx = self._context(context, config, sibling_sampling)
        if len(ctx) < 2:  # no committed feature yet: no proposal
            return DraftTree.from_lists([ctx[-1]], [-1])
        features = self.features.covering(self.target, ctx)  # (L - 1, H)
        root = self.head_cache.sync(ctx, features)  # (H,)
        predicted = {-1: root}  # pool node -> its predicted feature
        handle = {-1: -1}  # pool node -> its slot among this step's fed nodes
        # over the scored vocabulary only (a reduced one: the full one's -inf columns cost time, not choices)
        grow = grow_dynamic_tree(ctx[-1], self.heads.scores(root).cpu(), config, self.topk, self.depth,
                                 budget, self._token_ids)
        try:
            frontier = next(grow)
            while True:
                ids = [i for i, _, _ in frontier]
                parents = [p for _, _, p in frontier]
                out, handles = self.head_cache.expand(torch.stack([predicted[p] for p in parents]),
                                                      [t for _, t, _ in frontier], [handle[p] for p in parents])
                for i, h, feature in zip(ids, handles, out):
                    handle[i], predicted[i] = h, feature
                frontier = grow.send(self.heads.scores(out).cpu())  # (n, W)
        except StopIteration as done:
            return done.value


def head_drafter(pair, path, *, shape: TreeShape | Sequence[Sequence[int]] | None = None, topk: int = 4,
                 depth: int = 5, budget: int = 16, dtype: torch.dtype | str | None = None
                 ) -> MedusaDrafter | EagleDrafter:
    """The drafter of the trained heads at ``path`` for ``pair``'s target: a
    :class:`MedusaDrafter` with ``shape`` for Medusa heads, an :class:`EagleDrafter`
    with ``topk``, ``depth`` and ``budget`` for an EAGLE head (``topk=1``: a chain);
    either drafts in weight mode ``dtype`` (None: as trained, float32).

    A module-level factory, so that ``functools.partial(head_drafter, path=...)`` can
    travel to a study worker and build the drafter next to the loaded models (the
    registry's ``medusa`` and ``eagle`` strategies build theirs with it from
    :func:`~specviz.heads.find_heads`). The drafter's ``heads_path`` is the result
    directory, which the benchmark records.

    Raises:
        FileNotFoundError, ValueError: as :func:`~specviz.heads.load_heads`.
    """
    from specviz.models.saved_heads import resolve_heads_path, load_heads

    heads = load_heads(path, pair.target)
    if isinstance(heads, MedusaHeads):
        drafter = MedusaDrafter(pair.target, heads, shape, dtype=dtype)
    else:
        drafter = EagleDrafter(pair.target, heads, topk=topk, depth=depth, budget=budget, dtype=dtype)
    found = resolve_heads_path(path)
    drafter.heads_path = found.parent if found.is_file() else found
    return drafter

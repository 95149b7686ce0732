"""Each step, whichever of many drafters promises the most tokens per second
(:class:`ChooserDrafter`).

A user of speculative decoding often has several drafts at hand: a small draft model,
self-speculation, trained heads, prompt lookup, suffix trees. Which one pays depends on
the text (a copy favours lookup, free prose a model) and on what each costs on the
machine. A cascade (:class:`~specviz.draft.fallback.FallbackDrafter`) fixes the order; a
switch (:class:`~specviz.draft.switch.SwitchDrafter`) chooses between one lookup and one
chain. The chooser prices every part each step from what it has measured on this
sequence, and drafts with the best one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Sequence

import torch

from specviz.draft.base import Drafter, drafting_steps, spawn
from specviz.draft.composite import CompositeDrafter
from specviz.sampling import require_deterministic_siblings
from specviz.tree import DraftTree
from specviz.validate import check_int

__all__ = ["ChooserDrafter"]


def _robust_line(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """``t(n)``'s line through timed ``(n, seconds)`` points of at least two sizes, as
    ``(base size, its time, slope)``: each size's median time, anchored at the smallest size,
    and the median of the slopes from it to every other size (at least 0). One slow forward
    (a first call of a shape, another process) moves a median little, where it could tilt a
    least-squares line enough to price every tree out."""
    by_size: dict[int, list[float]] = {}
    for n, s in points:
        by_size.setdefault(n, []).append(s)
    medians = sorted((n, statistics.median(times)) for n, times in by_size.items())
    base, level = medians[0]
    slope = statistics.median((s - level) / (n - base) for n, s in medians[1:])
    return float(base), level, max(0.0, slope)


class ChooserDrafter(CompositeDrafter):
    """Each step, the part with the highest expected committed tokens per second.

    A part ``i`` that drafts a tree of depth ``D`` and ``n`` nodes is worth

    ``W_i = (1 + sum_{d <= D} a_i1 ... a_id) / (t(n) + c_i)``,

    where ``a_id`` is the chance that its ``d``-th draft token is accepted once the
    ones before it were (a Beta posterior counted from the steps it drafted on this
    sequence, prior ``Beta(prior_accepted, prior_rejected)``), ``t(n)`` the target's
    verification time for ``n`` tokens and ``c_i`` the part's drafting time (the median
    of its latest drafts, timed whether or not they were chosen; its first, which reads
    the prompt, left out once there are others). ``t(n)`` is given (``costs``) or a line
    through the steps' measured verification times over the tokens they fed (each size's
    median, and the median slope between sizes; the first step of each size, which can carry
    one-off costs, left out); before two sizes are timed (and in a replay, which times no
    target) the prior :attr:`verify_prior_s` gives its shape. Plain decoding is worth
    ``1 / t(1)``.

    Each step:

    * **exploration first**: the parts short of ``explore`` drafted steps are asked in
      the order given, and the first that proposes something drafts the step, so each is
      measured before it is judged (a lookup without a match passes the step on, its cost
      measured); a part that is not cheap (below) and was not chosen for ``revisit``
      steps drafts the next one (the longest unchosen first), since what pays changes
      along a text;
    * **patience**: once some part is measured cheap, the parts that are not (or not yet
      measured) are neither explored nor revisited until the cheap parts have been
      unproductive for ``patience`` steps in a row (no cheap part drafted the step, or its
      first draft token was rejected). A draft model's first draft reads the whole context
      (the prompt's prefill: a few hundred milliseconds for a 0.5B draft on a CPU) and its
      catch-up after a run of lookup steps feeds every token it missed, which pays back
      only where the lookups have nothing to offer; so list the cheap parts first;
    * **cheap parts are asked**: a part whose drafting costs at most ``cheap`` of
      ``t(1)`` (prompt lookup, suffix trees) drafts every step, and is priced by the tree
      it actually proposed (a lookup with no match is worth a plain step); the others are
      priced by the depth and size of their latest trees;
    * the best worth drafts: a cheap part's tree as it stands, an expensive part after
      drafting, or the root alone when plain decoding is worth the most.

    Every part drafts deterministically (``"greedy"``, or ``"topk"`` under sampling), as
    in a cascade, so the chooser verifies with a rule for deterministic drafts and stays
    lossless whichever part drafted; greedy output never depends on the choices. Only
    the part that drafted a step observes it (and every part that reads the target's
    hidden states, whose features follow the context); a part that drafted but was not
    chosen withdraws its proposal where it can. The returned tree's ``source`` is the
    part's index at every node, and :attr:`history` records each step's choice and every
    part's worth (NaN where unknown).

    Args:
        drafters: at least two drafters; parts that guess from the target's outputs of
            earlier steps (lookahead, Jacobi) cannot take part, since they would miss the
            steps others draft.
        explore: steps each part drafts (with a proposal) before it is compared.
        revisit: the most steps a part waits before it drafts again (0: never forced).
        patience: steps in a row without an accepted token from a cheap part before an
            expensive part is explored or revisited (0: no wait).
        cheap: drafting time, as a share of ``t(1)``, up to which a part drafts every step.
        prior_accepted, prior_rejected: the Beta prior of every ``a_id``.
        costs: ``t(n)`` given (anything with ``target_s(n)`` in seconds, such as the
            benchmark's :class:`~specviz.bench.cost.CostModel`) instead of fitted.
        draft_costs: each part's drafting time per step in seconds, instead of measured.
            With both given the choices depend on the text alone, so a sampled run is
            reproducible from its seed (measured times steer the choices otherwise).
        time_samples: how many of a part's latest drafting times its estimate uses (the
            verification line: four times as many steps).

    Raises:
        ValueError: fewer than two parts, a part that guesses from the target's outputs, a
            prior or share that is not positive, or a count that is not an int >= 0.
        TypeError: a part that is not a :class:`Drafter`.
    """

    outputs_reason = " of every step, which it would miss on the steps another part drafts"

    #: ``t(n)`` in seconds before a verification is timed and without ``costs``: a one-token
    #: step of a 1.5B target on a CPU, 2% more per token fed
    verify_prior_s: tuple[float, float] = (0.25, 0.005)

    def __init__(self, drafters: Sequence[Drafter], explore: int = 2, revisit: int = 24, cheap: float = 0.05,
                 prior_accepted: float = 1.0, prior_rejected: float = 1.0, costs=None,
                 draft_costs: Sequence[float] | None = None, time_samples: int = 32, patience: int = 2) -> None:
        drafters = list(drafters)
        if len(drafters) < 2:
            raise ValueError(f"ChooserDrafter needs at least two drafters, got {len(drafters)}")
        for name, value in (("explore", explore), ("revisit", revisit), ("time_samples", time_samples),
                            ("patience", patience)):
            check_int(name, value, 0)
        for name, value in (("cheap", cheap), ("prior_accepted", prior_accepted),
                            ("prior_rejected", prior_rejected)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if costs is not None and not callable(getattr(costs, "target_s", None)):
            raise TypeError(f"costs must have a target_s(n) method (a CostModel), got {type(costs).__name__}")
        if draft_costs is not None:
            draft_costs = tuple(draft_costs)
            if len(draft_costs) != len(drafters) or not all(
                    isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0 for c in draft_costs):
                raise ValueError(f"draft_costs must give one drafting time >= 0 per part ({len(drafters)}), "
                                 f"got {draft_costs!r}")
        super().__init__(drafters)
        self.explore, self.revisit, self.cheap, self.patience = explore, revisit, float(cheap), patience
        self.prior = (float(prior_accepted), float(prior_rejected))
        self.costs, self.time_samples = costs, max(2, time_samples)
        self.draft_costs = None if draft_costs is None else tuple(float(c) for c in draft_costs)
        self.name = "choose(" + "|".join(d.name for d in drafters) + ")"
        self.reset()

    def reset(self) -> None:
        super().reset()
        n = len(self.drafters)
        self._accepted: list[list[float]] = [[] for _ in range(n)]  # per part, per depth d - 1
        self._tried: list[list[float]] = [[] for _ in range(n)]
        self._first_s: list[float | None] = [None] * n  # drafting time of its first step (it read the prompt)
        self._draft_s: list[list[float]] = [[] for _ in range(n)]  # drafting times of its later steps, latest last
        self._shape: list[tuple[int, int] | None] = [None] * n  # (depth, nodes) of its latest tree
        self._chosen = [0] * n  # steps each part drafted
        self._last = [-1] * n  # the step each part last drafted
        self._verify: list[tuple[int, float]] = []  # (tokens fed, seconds) of the latest timed steps
        self._fed_sizes: set[int] = set()  # sizes verified at least once (their first step is a warm-up)
        self._fit: tuple[float, float, float] | None = None  # t(n)'s line: base size, its time, slope
        self._step = 0
        self._silent = 0  # steps in a row in which no cheap part's draft token was accepted
        self.last_part: int | None = None
        self.history: list[tuple[str, tuple[float, ...]]] = []  # (chosen part or "plain", every part's worth)

    def spawn(self) -> "ChooserDrafter":
        return type(self)([spawn(d) for d in self.drafters], self.explore, self.revisit, self.cheap, *self.prior,
                          costs=self.costs, draft_costs=self.draft_costs, time_samples=self.time_samples,
                          patience=self.patience)

    # -- the estimates ---------------------------------------------------------------

    def verify_s(self, n: int) -> float:
        """``t(n)``: the target's verification time for ``n`` tokens fed, in seconds."""
        if self.costs is not None:
            return float(self.costs.target_s(n))
        points = self._verify
        if len({p for p, _ in points}) >= 2:
            if self._fit is None:  # refitted after each timed step
                self._fit = _robust_line(points)
            base, level, slope = self._fit
            return max(level + slope * (n - base), 1e-6)
        if points:  # one size timed: the prior's shape through the measured level
            base, per = self.verify_prior_s
            level = statistics.median(t for _, t in points) / (base + per * (points[0][0] - 1))
            return level * (base + per * (n - 1))
        base, per = self.verify_prior_s
        return base + per * (n - 1)

    def draft_s(self, part: int) -> float:
        """``c_i``: part ``part``'s drafting time per step in seconds (``draft_costs``' where
        given; NaN before it has drafted)."""
        if self.draft_costs is not None:
            return self.draft_costs[part]
        if self._draft_s[part]:
            return statistics.median(self._draft_s[part])
        first = self._first_s[part]
        return float("nan") if first is None else first

    def expected_tokens(self, part: int, depth: int) -> float:
        """``1 + sum_{d <= depth} a_1 ... a_d``: the tokens a step of part ``part`` commits,
        on average, when it drafts to ``depth``."""
        a, b = self.prior
        reach, expected = 1.0, 1.0
        for d in range(depth):
            tried = self._tried[part][d] if d < len(self._tried[part]) else 0.0
            accepted = self._accepted[part][d] if d < len(self._accepted[part]) else 0.0
            reach *= (accepted + a) / (tried + a + b)
            expected += reach
        return expected

    def worth(self, part: int, depth: int, nodes: int) -> float:
        """``W_i`` of part ``part`` drafting a tree of ``depth`` and ``nodes`` (root included)."""
        cost = self.draft_s(part)
        if cost != cost:  # not measured
            return float("nan")
        return self.expected_tokens(part, depth) / (self.verify_s(nodes) + cost)

    def is_cheap(self, part: int) -> bool:
        """Whether part ``part`` drafts every step (its drafting is at most ``cheap`` of ``t(1)``)."""
        cost = self.draft_s(part)
        return cost == cost and cost <= self.cheap * self.verify_s(1)

    # -- drafting --------------------------------------------------------------------

    def _waiting(self) -> bool:
        """Whether the parts that are not cheap wait (``patience``): a part is measured cheap
        and a cheap part's draft token was accepted within the last ``patience`` steps."""
        return (self._silent < self.patience
                and any(self.is_cheap(i) for i in range(len(self.drafters))))

    def _stalest(self) -> int | None:
        """The part that is not cheap and has waited longest past ``revisit`` steps, or None."""
        if not self.revisit:
            return None
        waited = [(self._step - last, -i) for i, last in enumerate(self._last)
                  if self._step - last > self.revisit and not self.is_cheap(i)]
        return -max(waited)[1] if waited else None

    def _draft_part(self, part: int, context, config, mode, generator):
        """Part ``part``'s tree for ``context``, its drafting time recorded (in a batch, the
        time until every row's forwards of it were served)."""
        start = time.perf_counter()
        tree = yield from drafting_steps(self.drafters[part], context, config, mode, generator)
        elapsed = time.perf_counter() - start
        if self._first_s[part] is None:
            self._first_s[part] = elapsed
        else:
            self._draft_s[part].append(elapsed)
            del self._draft_s[part][:-self.time_samples]
        return tree

    def draft_steps(self, context, config, sibling_sampling, generator):
        require_deterministic_siblings("a chooser between drafters", config, sibling_sampling)
        mode = "greedy" if config.greedy else "topk"
        n_parts = len(self.drafters)
        worths = [float("nan")] * n_parts
        trees: dict[int, DraftTree] = {}
        best = None
        for i in range(n_parts):  # exploration: the first part short of its steps that proposes something
            if self._chosen[i] < self.explore and (self.is_cheap(i) or not self._waiting()):
                trees[i] = yield from self._draft_part(i, context, config, mode, generator)
                if trees[i].n_nodes > 1:
                    best = i
                    break
        if best is None and not self._waiting():
            best = self._stalest()
        if best is None:
            for i in range(n_parts):
                if i not in trees and self.is_cheap(i):
                    trees[i] = yield from self._draft_part(i, context, config, mode, generator)
                if i in trees:
                    worths[i] = self.worth(i, trees[i].depth, trees[i].n_nodes)
                elif self._shape[i] is not None:
                    worths[i] = self.worth(i, *self._shape[i])
            known = [(w, -i) for i, w in enumerate(worths) if w == w]
            if known and max(known)[0] > 1.0 / self.verify_s(1):
                best = -max(known)[1]
        for i in trees:
            if i != best and hasattr(self.drafters[i], "withdraw"):
                self.drafters[i].withdraw()
        self._step += 1
        if best is not None and best not in trees:
            trees[best] = yield from self._draft_part(best, context, config, mode, generator)
        if best is not None and trees[best].n_nodes == 1:  # chosen, but proposing nothing: a plain step
            best = None
        self.last_part = best
        self.history.append(("plain" if best is None else self.drafters[best].name, tuple(worths)))
        if best is None:
            return DraftTree.from_lists([int(context[-1])], [-1])
        tree = trees[best]
        return dataclasses.replace(tree, source=torch.full((tree.n_nodes,), best, dtype=torch.long))

    def observes(self, part: int, step) -> bool:
        return part == self.last_part

    def observe(self, step, outputs=None) -> None:
        super().observe(step, outputs)
        if step is None:
            return
        if step.verify_time_s > 0 and step.fed_tokens not in self._fed_sizes:
            self._fed_sizes.add(step.fed_tokens)  # a size's first forward can carry one-off costs: left out
        elif step.verify_time_s > 0:
            self._verify.append((step.fed_tokens, step.verify_time_s))
            del self._verify[:-4 * self.time_samples]
            self._fit = None
        part = self.last_part
        productive = part is not None and self.is_cheap(part) and step.acceptance.n_accepted > 0
        self._silent = 0 if productive else self._silent + 1
        if part is None:
            return
        tree, accepted = step.tree, step.acceptance.n_accepted
        depth = tree.depth
        tried, hits = self._tried[part], self._accepted[part]
        while len(tried) < depth:
            tried.append(0.0)
            hits.append(0.0)
        for d in range(min(depth, accepted + 1)):  # depths reached: every token before them accepted
            tried[d] += 1
            hits[d] += float(d < accepted)
        self._shape[part] = (depth, tree.n_nodes)
        self._chosen[part] += 1
        self._last[part] = self._step - 1

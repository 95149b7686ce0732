"""A draft-model chain whose length follows recent acceptance (:class:`AdaptiveChainDrafter`).

Two schedules (:data:`ADAPTIVE_SCHEDULES`): the popular +2/-1 heuristic of Hugging Face's
assisted generation, and specviz's expected-throughput rule, which decides token by
token whether one more draft forward pays for itself.

Dimension legend: N = tree nodes incl. root, V = vocabulary.
"""

from __future__ import annotations

import torch

from specviz.draft.model import (
    ModelDrafter,
    choose_children,
    draft_distribution,
    drafted_tree,
)
from specviz.sampling import check_sibling_sampling, siblings_sampled
from specviz.validate import check_choice, check_int

__all__ = ["ADAPTIVE_SCHEDULES", "AdaptiveChainDrafter"]

ADAPTIVE_SCHEDULES = ("heuristic", "throughput")


class AdaptiveChainDrafter(ModelDrafter):
    """A draft-LM chain whose length adapts to recent acceptance.

    ``schedule="heuristic"`` is the rule of Hugging Face's assisted generation
    (``num_assistant_tokens_schedule="heuristic"``): after a step where every draft
    token was accepted, draft 2 more next time, otherwise 1 fewer.

    ``schedule="throughput"`` (specviz's rule) decides token by token, inside the step,
    whether one more draft forward pays for itself. With ``c`` the cost of a draft
    forward relative to a target verify, ``P_i`` the estimated probability that the
    first ``i`` draft tokens are all accepted, ``E = 1 + sum P_i`` the expected tokens
    this step commits and ``T = 1 + k c`` its cost, a ``(k+1)``-th token raises the
    expected throughput ``E / T`` iff ``P_{k+1} > c E / T``. ``P_i`` multiplies a
    *calibrated* acceptance per drafted token: the draft's own probability ``q`` mapped
    through a histogram of how often tokens with that ``q`` were accepted (a Beta prior
    centred on ``q`` itself), updated from every observed step; the unseen next token
    uses the running mean acceptance. So the chain stops early exactly when the draft is
    unsure, and runs long through easy text, rather than reacting one step late.

    Args:
        draft: the draft :class:`~specviz.models.LoadedModel`.
        schedule: "heuristic" or "throughput".
        k_init: chain length of the first step ("heuristic").
        k_min, k_max: bounds on the chain length.
        cost_ratio: draft-forward cost / target-verify cost for "throughput"; None
            measures it online from the step traces' wall times (fix it for
            reproducible runs).
        bins: histogram bins of the calibration of ``q``.
    """

    def __init__(self, draft, schedule: str = "throughput", k_init: int = 4, k_min: int = 1, k_max: int = 12,
                 cost_ratio: float | None = None, bins: int = 10) -> None:
        check_choice("schedule", schedule, ADAPTIVE_SCHEDULES)
        for name, value in (("k_init", k_init), ("k_min", k_min), ("k_max", k_max), ("bins", bins)):
            check_int(name, value)
        if not k_min <= k_init <= k_max:
            raise ValueError(f"need k_min <= k_init <= k_max, got {k_min}, {k_init}, {k_max}")
        if cost_ratio is not None and not cost_ratio > 0:
            raise ValueError(f"cost_ratio must be > 0 or None, got {cost_ratio}")
        self.schedule, self.k_init, self.k_min, self.k_max = schedule, k_init, k_min, k_max
        self.cost_ratio, self.bins = cost_ratio, bins
        self.name = f"adaptive-{schedule}"
        super().__init__(draft)

    def reset(self) -> None:
        super().reset()
        self.k = self.k_init
        edges = (torch.arange(self.bins, dtype=torch.float64) + 0.5) / self.bins
        # Beta(2 q, 2 (1 - q)) prior per bin: before any evidence a(q) = q.
        self._accepted = 2.0 * edges
        self._tried = torch.full((self.bins,), 2.0, dtype=torch.float64)
        self._mean_accept = 0.6
        self._t_draft: float | None = None
        self._t_verify: float | None = None
        self.history: list[int] = []  # chain length drafted at each step

    def _calibrated(self, q: float) -> float:
        b = min(int(q * self.bins), self.bins - 1)
        return float(self._accepted[b] / self._tried[b])

    def _ratio(self) -> float:
        if self.cost_ratio is not None:
            return self.cost_ratio
        if self._t_draft is None or self._t_verify is None or self._t_verify <= 0:
            return 0.25  # until measured: roughly a 0.5B draft against a 1.5B target on a CPU
        return self._t_draft / self._t_verify

    def _keep_going(self, reach: float, expected: float, k: int) -> bool:
        """Whether a (k+1)-th draft token is worth a forward, given ``P_k = reach`` and
        ``E = expected`` for the chain of ``k`` drafted so far."""
        c = self._ratio()
        return reach * self._mean_accept > c * expected / (1.0 + k * c)

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        ctx = self._context(context)
        logits = (yield self.state.sync(ctx))[-1]  # (V,)
        limit = self.k if self.schedule == "heuristic" else self.k_max
        tokens, qs, ranks = [], [], []
        rows = []
        reach, expected = 1.0, 1.0  # P_k and E = 1 + sum_i P_i
        parent = -1
        while True:
            dist = draft_distribution(logits, config)  # (V,)
            (tok, rank), = choose_children(logits, dist, [0], config, sibling_sampling, generator)
            tokens.append(tok)
            qs.append(float(dist[tok]))
            ranks.append(rank)
            rows.append(dist)
            reach *= self._calibrated(qs[-1])
            expected += reach
            k = len(tokens)
            if k >= limit:
                break
            if self.schedule == "throughput" and k >= self.k_min and not self._keep_going(reach, expected, k):
                break
            request, (parent,) = self.state.expand([tok], [parent])
            logits = (yield request)[0]
        self.history.append(len(tokens))
        draft_probs = None
        if siblings_sampled(config, sibling_sampling):
            draft_probs = torch.zeros(len(tokens) + 1, logits.shape[-1])  # (N, V)
            draft_probs[:-1] = torch.stack(rows)
        return drafted_tree(ctx[-1], tokens, list(range(len(tokens))), qs, ranks, draft_probs)

    def observe(self, step, outputs=None) -> None:
        drafted = step.tree.budget
        accepted = step.acceptance.n_accepted
        if self.schedule == "heuristic":
            self.k = min(self.k_max, self.k + 2) if drafted and accepted == drafted else max(self.k_min, self.k - 1)
            return
        q = step.tree.q.tolist()
        for i in range(1, min(accepted + 1, drafted) + 1):  # the tried prefix of the chain
            b = min(int(q[i] * self.bins), self.bins - 1)
            self._tried[b] += 1.0
            self._accepted[b] += 1.0 if i <= accepted else 0.0
            self._mean_accept = 0.9 * self._mean_accept + 0.1 * (1.0 if i <= accepted else 0.0)
        forwards = max(1, drafted)
        if step.verify_time_s > 0:
            t_d, t_v = step.draft_time_s / forwards, step.verify_time_s
            self._t_draft = t_d if self._t_draft is None else 0.8 * self._t_draft + 0.2 * t_d
            self._t_verify = t_v if self._t_verify is None else 0.8 * self._t_verify + 0.2 * t_v

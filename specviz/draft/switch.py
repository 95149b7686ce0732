"""Per step, prompt lookup or a draft-model chain, whichever promises more tokens per
second (:class:`SwitchDrafter`).

Prompt lookup costs next to nothing and is right in long runs where the text copies
itself (retrieval answers, summaries that quote, code that repeats a name); a draft
model proposes everywhere, but on a CPU each of its forwards costs about half a target
step. A cascade (:class:`~specviz.draft.fallback.FallbackDrafter`) takes the lookup
whenever it finds a match, even a weak one that the draft model would beat. The switch
prices both proposals every step, with the same expected-throughput rule that
:class:`~specviz.draft.ngram.AdaptiveNgramDrafter` uses to choose its chain's length,
and drafts with the better one.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from specviz.draft.base import drafting_steps, spawn
from specviz.draft.composite import CompositeDrafter
from specviz.draft.model import ChainDrafter
from specviz.draft.ngram import AdaptiveNgramDrafter
from specviz.sampling import require_deterministic_siblings
from specviz.validate import check_int

__all__ = ["SwitchDrafter"]


def _cost_at(costs: list[float], n: int) -> float:
    """``C(n)`` from a curve ``C(1) .. C(m)`` (the lookup part's
    :meth:`~specviz.draft.ngram.AdaptiveNgramDrafter.relative_costs`), extended linearly
    past its largest size."""
    if n <= len(costs):
        return costs[n - 1]
    return costs[-1] + (costs[-1] - costs[-2]) * (n - len(costs))


class SwitchDrafter(CompositeDrafter):
    """Each step, the adaptive prompt-lookup chain or the draft model's chain, whichever
    has the higher expected throughput.

    With ``C(n) = t(n) / t(1)`` the cost of verifying ``n`` tokens relative to a plain
    step (the lookup part's cost curve: given, or measured online from every step's
    verification time), a proposal is worth ``E / C``, the tokens the step is expected
    to commit per plain step's time:

    * the lookup part chooses its chain's length for the highest ``E / C``, with its
      acceptance per match length (:meth:`AdaptiveNgramDrafter.choose_length`); its
      worth is that value, and 1.0 (a plain step) when it finds no match;
    * the model chain of ``k`` tokens is worth ``(1 + sum_{i<=k} a_1 ... a_i) / (C(k + 1)
      + (C(n) + k - 1) r)``, where ``a_i`` is the acceptance of its ``i``-th token (a Beta
      posterior counted from this sequence's model steps, prior ``Beta(prior_accepted,
      prior_rejected)``), ``n`` the tokens its first forward must feed (those committed
      since the draft model last ran: after lookup steps its catch-up costs more, priced
      with the target's curve standing in for the draft's) and ``r`` a one-token draft
      forward's time over a plain step's (``draft_cost``, or the median of its measured
      times on the latest model steps over the lookup part's estimate of ``t(1)``; 0.5
      until measured).

    The model drafts when its worth is higher than the lookup's and than 1.0; otherwise
    the lookup's chain is the draft (the root alone when it proposes nothing). Two
    exceptions come first:

    * **patience**: the model's first step costs more than its others, since the draft
      model reads the whole context first (the prompt's prefill: a few hundred
      milliseconds for a 0.5B draft on a CPU), which pays back only over many model
      steps. So the model is not asked before the lookup has had nothing to propose on
      ``patience`` steps: a short answer copied from its prompt (retrieval, quoting)
      never pays for the draft model. That prefill is not counted in ``r``.
    * **exploration**: the model's first ``explore`` steps are then taken on trust (unless
      the lookup proposes a chain worth more), so that its acceptance and cost are
      measured before they decide: from the priors alone a chain that pays only a few
      percent over plain steps would never be tried.

    The lookup is asked every step, since its answer is part of the decision, and learns
    from every step's committed tokens how its proposal fared or would have fared
    (:meth:`AdaptiveNgramDrafter.observe`); the model part learns from its own steps
    only, and catches up on the tokens committed while it was not asked in its next
    forward. The returned tree's ``source`` is 0 (lookup) or 1 (model) at every node, and
    :attr:`history` records each step's choice and both worths.

    Both parts draft deterministically, so the switch verifies with a rule for
    deterministic drafts (greedy, or "topk" under sampling) and stays lossless. Greedy
    output never depends on the choices; a sampled one is reproducible from its seed only
    when no cost is measured (the lookup part's ``costs`` and ``draft_cost`` given), since
    measured times steer the choices.

    Args:
        drafters: ``[lookup, model]``: an :class:`~specviz.draft.ngram.AdaptiveNgramDrafter`
            and a :class:`~specviz.draft.model.ChainDrafter`.
        draft_cost: ``r``, or None to measure it (fix it, and the lookup part's
            ``costs``, for reproducible sampled runs).
        prior_accepted, prior_rejected: the Beta prior of every ``a_i``.
        explore: the model's first steps taken without comparing its worth with a plain
            step's.
        patience: steps on which the lookup proposes nothing before the model is first
            asked.

    Raises:
        ValueError: not exactly two parts, a prior or cost that is not positive, or
            ``explore`` / ``patience`` not an int >= 0.
        TypeError: parts of other kinds.
    """

    outputs_reason = " of every step, which it would miss on the steps the other part drafts"

    #: the ``r`` assumed until a model step has been timed
    draft_cost_prior: float = 0.5

    def __init__(self, drafters, draft_cost: float | None = None, prior_accepted: float = 3.0,
                 prior_rejected: float = 1.0, explore: int = 3, patience: int = 2) -> None:
        drafters = list(drafters)
        if len(drafters) != 2:
            raise ValueError(f"SwitchDrafter needs two parts, [lookup, model], got {len(drafters)}")
        lookup, model = drafters
        if not isinstance(lookup, AdaptiveNgramDrafter):
            raise TypeError(f"SwitchDrafter's first part must be an AdaptiveNgramDrafter (ngram-adaptive), "
                            f"got {type(lookup).__name__}")
        if not isinstance(model, ChainDrafter):
            raise TypeError(f"SwitchDrafter's second part must be a ChainDrafter (chain-k<K>), "
                            f"got {type(model).__name__}")
        for name, value in (("draft_cost", draft_cost), ("prior_accepted", prior_accepted),
                            ("prior_rejected", prior_rejected)):
            if name == "draft_cost" and value is None:
                continue
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name, value in (("explore", explore), ("patience", patience)):
            check_int(name, value, 0)
        super().__init__(drafters)
        self.explore, self.patience = explore, patience
        self.draft_cost = None if draft_cost is None else float(draft_cost)
        self.prior = (float(prior_accepted), float(prior_rejected))
        self.name = f"switch({lookup.name}|{model.name})"
        self.reset()

    @property
    def lookup(self) -> AdaptiveNgramDrafter:
        return self.drafters[0]

    @property
    def model(self) -> ChainDrafter:
        return self.drafters[1]

    def reset(self) -> None:
        super().reset()
        k = self.model.k
        self._accepted = torch.full((k + 1,), self.prior[0], dtype=torch.float64)
        self._tried = torch.full((k + 1,), self.prior[0] + self.prior[1], dtype=torch.float64)
        self._forward_times: list[float] = []  # a draft forward's measured times, latest last
        self._model_steps = 0
        self._silent = 0  # steps on which the lookup proposed nothing
        self._last_catch_up = 1  # tokens the draft model had to catch up on at the latest step
        self.last_part: int | None = None
        self.history: list[tuple[str, float, float]] = []  # (chosen part, lookup's worth, model's worth)

    def draft_ratio(self) -> float:
        """``r``: a draft forward's time over a plain step's, as the next decision uses it."""
        if self.draft_cost is not None:
            return self.draft_cost
        plain = self.lookup.plain_step_time()
        if not self._forward_times or not plain:
            return self.draft_cost_prior
        return statistics.median_low(self._forward_times) / plain

    def _catch_up(self, context_len: int) -> int:
        """Tokens the draft model's first forward of a step would feed: those committed
        since it last read the context (at least the root)."""
        return max(1, context_len - len(self.model.state.tokens))

    def model_worth(self, catch_up: int = 1) -> float:
        """The model chain's expected tokens per plain step's time, ``E / C``, when its
        first forward feeds ``catch_up`` tokens (the tokens committed since the draft
        model last ran; a forward of ``n`` tokens is priced at ``r C(n)``, the target's
        curve standing in for the draft's)."""
        k = self.model.k
        rate = (self._accepted / self._tried).tolist()
        reach, expected = 1.0, 1.0
        for i in range(1, k + 1):
            reach *= rate[i]
            expected += reach
        costs = self.lookup.relative_costs()
        drafting = _cost_at(costs, catch_up) + (k - 1)  # in one-token draft forwards
        return expected / (_cost_at(costs, k + 1) + drafting * self.draft_ratio())

    def draft_steps(self, context, config, sibling_sampling, generator):
        require_deterministic_siblings("a switch between drafters", config, sibling_sampling)
        mode = "greedy" if config.greedy else "topk"
        tree = yield from drafting_steps(self.lookup, context, config, mode, generator)
        lookup_worth = self.lookup.last_worth
        self._last_catch_up = self._catch_up(len(context))
        model_worth = self.model_worth(self._last_catch_up if self._model_steps else 1)
        ready = self._model_steps > 0 or self._silent >= self.patience
        self._silent += tree.n_nodes == 1
        if not ready:
            bar = float("inf")
        elif self._model_steps < self.explore:  # still measuring the model: only a lookup chain worth more wins
            bar = lookup_worth if tree.n_nodes > 1 else 0.0
        else:
            bar = max(lookup_worth, 1.0)
        if model_worth > bar:
            self.lookup.withdraw()
            tree = yield from drafting_steps(self.model, context, config, mode, generator)
            part = 1
        else:
            part = 0
        self.history.append(("model" if part else "lookup", lookup_worth, model_worth))
        self.last_part = part if tree.n_nodes > 1 else None
        return dataclasses.replace(tree, source=torch.full((tree.n_nodes,), part, dtype=torch.long))

    def observe(self, step, outputs=None) -> None:
        # the lookup part sees every step: its verification-time curve, and what its proposal would have given
        self.lookup.observe(step, outputs)
        if self.last_part != 1:
            return
        self.model.observe(step, outputs)
        drafted = step.tree.n_nodes - 1
        accepted = step.acceptance.n_accepted
        for i in range(1, min(drafted, accepted + 1) + 1):  # positions reached: all before them accepted
            self._tried[i] += 1
            self._accepted[i] += float(i <= accepted)
        self._model_steps += 1
        if self._model_steps > 1 and drafted and step.draft_time_s > 0:
            # the first model step also fed the draft model the prompt: not a drafting step's cost
            catch_up = _cost_at(self.lookup.relative_costs(), self._last_catch_up)
            forwards = catch_up + (drafted - 1)  # in one-token draft forwards
            self._forward_times.append(step.draft_time_s / forwards)
            del self._forward_times[:-self.lookup.time_samples]

    def spawn(self) -> "SwitchDrafter":
        return type(self)([spawn(d) for d in self.drafters], self.draft_cost, *self.prior, self.explore,
                          self.patience)

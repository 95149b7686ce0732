"""Verification: which drafted tokens the target keeps, and how many it should keep.

A verifier walks a :class:`~specviz.tree.DraftTree` from the root. At every reached
node it tries the node's children against the target distribution ``p`` there, moves
to the child it accepts, and stops at the first node where it accepts none; it then
adds one *bonus* token. The rules (SPECDEC.md section 2):

=============  =========================================================  =========
name           rule                                                       lossless
=============  =========================================================  =========
``greedy``     E: follow the child whose token is ``argmax p``            yes
``chain``      A: chain rejection sampling (Leviathan et al. 2023)        yes
``specinfer``  B: multi-step speculative sampling (SpecInfer)             yes
``sequoia``    C: B for siblings drawn without replacement (Sequoia)      yes
``topk``       D: deterministic top-k siblings (EAGLE, SGLang)            yes
``typical``    F: Medusa typical acceptance                               no
``naive``      G: accept iff ``p(x) >= q(x)``                             no
``naive_half`` G: accept iff ``p(x) >= 0.5 q(x)``                         no
=============  =========================================================  =========

A lossless rule emits tokens distributed exactly as if the target sampled them one
by one, *provided the siblings were drafted the way the rule assumes*; each verifier
says how in ``sibling_sampling`` ("greedy", "iid", "without_replacement", "topk").

Conventions shared by all rules:

* ``p = probs_from_logits(target_logits[u], config)``, the same processing the drafter
  applied to its own logits, so both sides compare like with like.
* ``tree.draft_probs[u]`` is the draft distribution ``q`` that node ``u``'s children were
  drawn from. When ``tree.draft_probs`` is None the draft is deterministic: each
  child's ``q`` is one-hot on its own token, and rules B, C and A become rule D
  (children tried in index order).
* A child whose token the draft gave probability 0 (possible when siblings came from
  a draft's top-k at temperature 0) is accepted with probability 1 if ``r(x) > 0``
  and 0 otherwise, the limit of ``min(1, r(x) / q(x))``. This is what makes every
  lossless rule reduce to greedy at temperature 0.
* Siblings carrying the same token (B draws siblings i.i.d.) need no special case:
  after a rejection the residual gives the repeated token the right (often zero)
  chance.

Exact expectations (:func:`node_reach_probs`, :func:`expected_accept_length`) are
computed from one target forward over the tree, with no sampling:

* rules A, C, D and B with a deterministic draft try children in index order:
  ``P(child i accepted | parent reached) = prod_{j<i} (1 - a_j) * a_i`` with
  ``a_j`` the acceptance probability after the residual updates of siblings
  ``1..j-1``. For D with distinct sibling tokens this telescopes to ``p(x_i)``;
  with repeated tokens it does not, and the recursion is what is used.
* rule B tries children in a uniformly random order, and its expectation is the
  exact average over all orders. Every sibling was drawn from the same ``q``, so
  after ``j`` rejections the residual ``r_j`` depends only on ``j``, not on which
  siblings were rejected. A sibling can only be rejected when ``r_j(x) < q(x)``,
  and then ``r_{j+1}(x) = 0``: its token is impossible from then on. So a dynamic
  program over (position, rejected counts of the still-possible token classes)
  has a single state per position in exact arithmetic, and costs ``k`` residual
  updates plus ``O(k * C)`` per node, however wide the node. States whose
  probability falls below ``1e-13`` (floating-point near-ties can create them)
  are dropped, which bounds the error of each probability by the dropped mass.
* the lossy rules and greedy are deterministic given the tree: their reach
  probabilities are 1 on the path they would accept and 0 elsewhere.

Dimension legend: N = nodes in the draft tree including the root, V = vocabulary size,
k = children of one node, C = distinct tokens among those children.
"""

from __future__ import annotations

import abc
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

import torch

from specviz.sampling import SamplingConfig, probs_from_logits
from specviz.tree.core import DraftTree, children_lists, depths, greedy_walk

__all__ = [
    "Acceptance",
    "Verifier",
    "GreedyVerifier",
    "ChainVerifier",
    "SpecInferVerifier",
    "SequoiaVerifier",
    "TopKVerifier",
    "TypicalVerifier",
    "NaiveVerifier",
    "VERIFIERS",
    "get_verifier",
    "node_reach_probs",
    "expected_accept_length",
]

# Order-averaging DP states lighter than this are dropped (see module docstring).
_NEGLIGIBLE = 1e-13
# Trees with at most this many logits (N * V) are turned into probabilities in one call.
_EAGER_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class Acceptance:
    """What a verifier kept in one step.

    Attributes:
        accepted_nodes: node indices along the accepted path, root excluded, in order.
        accepted_tokens: the tokens at those nodes.
        bonus_token: the token the target adds after the accepted path (a correction
            after a rejection, or a free token when the path ends at a leaf).
        node_accept_prob: ``(N,)`` float32, the acceptance probability the verifier used
            at each node it tried (given its parent was reached); NaN where never tried;
            1.0 at the root.
        tried: ``(N,)`` bool, True for every node the verifier considered (root included).
        rule: name of the verifier.
        lossless: whether the rule reproduces the target distribution exactly.
    """

    accepted_nodes: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    bonus_token: int
    node_accept_prob: torch.Tensor
    tried: torch.Tensor
    rule: str
    lossless: bool

    def __post_init__(self) -> None:
        if len(self.accepted_nodes) != len(self.accepted_tokens):
            raise ValueError(
                f"accepted_nodes and accepted_tokens differ in length: "
                f"{len(self.accepted_nodes)} vs {len(self.accepted_tokens)}"
            )

    @property
    def accept_length(self) -> int:
        """Accepted draft tokens in this step."""
        return len(self.accepted_nodes)

    @property
    def tau(self) -> int:
        """Tokens committed by this step: accepted draft tokens plus the bonus token."""
        return self.accept_length + 1

    @property
    def committed_tokens(self) -> tuple[int, ...]:
        """Accepted tokens followed by the bonus token."""
        return self.accepted_tokens + (self.bonus_token,)

    @property
    def last_node(self) -> int:
        """Last accepted node (0, the root, when nothing was accepted)."""
        return self.accepted_nodes[-1] if self.accepted_nodes else 0


# -- validated inputs ---------------------------------------------------------------------

class _Problem:
    """Validated verifier inputs. Probability rows are processed when a rule needs them:
    only the rows of reached nodes matter, and V can be 150k."""

    def __init__(self, tree: DraftTree, target_logits: torch.Tensor, config: SamplingConfig,
                 use_draft: bool) -> None:
        if not isinstance(tree, DraftTree):
            raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
        if not isinstance(config, SamplingConfig):
            raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
        if not isinstance(target_logits, torch.Tensor):
            raise TypeError(
                f"target_logits must be a torch.Tensor, got {type(target_logits).__name__}"
            )
        if not target_logits.dtype.is_floating_point:
            raise TypeError(f"target_logits must be floating point, got {target_logits.dtype}")
        n = tree.n_nodes
        if target_logits.dim() != 2 or target_logits.shape[0] != n or target_logits.shape[1] == 0:
            raise ValueError(
                f"target_logits must have shape (N, V) = ({n}, V) with one row per tree node, "
                f"got {tuple(target_logits.shape)}"
            )
        vocab = int(target_logits.shape[1])
        top = int(tree.tokens.max())
        if top >= vocab:
            raise ValueError(
                f"tree holds token id {top} but target_logits has only {vocab} columns"
            )
        draft = tree.draft_probs if use_draft else None
        if draft is not None and draft.shape[1] != vocab:
            raise ValueError(
                f"tree.draft_probs has {draft.shape[1]} columns but target_logits has {vocab}"
            )
        self.n = n
        self.tokens: list[int] = tree.tokens.tolist()
        self.parents: list[int] = tree.parents.tolist()
        self.children = children_lists(tree)
        self._logits = target_logits
        self._config = config
        self._draft = draft
        # A small problem is processed in one call rather than one call per reached node;
        # with a real vocabulary only the rows of reached nodes are worth processing.
        self._eager = n * vocab <= _EAGER_ELEMENTS
        if self._eager:
            self._p_rows = probs_from_logits(target_logits, config).to("cpu", torch.float64)
            if draft is not None:
                rows = torch.as_tensor(draft).to("cpu", torch.float64)  # (N, V)
                self._q_mass = rows.sum(dim=1).tolist()
                self._q_negative = (rows < 0).any(dim=1).tolist()
                self._q_rows = rows / rows.sum(dim=1, keepdim=True)

    def p(self, u: int) -> torch.Tensor:
        """Target distribution after node ``u``: ``(V,)`` float64 on the CPU (do not modify)."""
        if self._eager:
            return self._p_rows[u]
        return probs_from_logits(self._logits[u], self._config).to("cpu", torch.float64)

    def q(self, u: int) -> torch.Tensor | None:
        """Draft distribution node ``u``'s children came from, ``(V,)`` float64 on the CPU
        (do not modify), or None when the draft is deterministic."""
        if self._draft is None:
            return None
        if self._eager:
            mass, negative, row = self._q_mass[u], self._q_negative[u], self._q_rows[u]
        else:
            row = torch.as_tensor(self._draft[u]).to("cpu", torch.float64)
            mass, negative = float(row.sum()), bool((row < 0).any())
            row = row / mass
        if negative or not mass > 0:
            raise ValueError(
                f"tree.draft_probs[{u}] must be a non-negative distribution with positive mass "
                f"(node {u} has children), got sum {mass}"
            )
        return row


class _Trace:
    """Per-node bookkeeping of one verification, turned into an :class:`Acceptance`.

    ``uniforms[s]`` is node ``s``'s acceptance coin and ``uniforms[0]`` the quantile of
    the bonus token: a step draws N uniforms up front, one call instead of one per coin.
    """

    def __init__(self, n: int, generator: torch.Generator | None = None) -> None:
        self.uniforms: list[float] = (
            [] if generator is None
            else torch.rand(n, generator=generator, dtype=torch.float64).tolist()
        )
        self.accept_prob = [math.nan] * n
        self.accept_prob[0] = 1.0
        self.tried = [False] * n
        self.tried[0] = True
        self.path: list[int] = []

    def record(self, node: int, prob: float) -> None:
        self.tried[node] = True
        self.accept_prob[node] = prob

    def acceptance(self, problem: _Problem, bonus: int, verifier: "Verifier") -> Acceptance:
        return Acceptance(
            accepted_nodes=tuple(self.path),
            accepted_tokens=tuple(problem.tokens[s] for s in self.path),
            bonus_token=int(bonus),
            node_accept_prob=torch.tensor(self.accept_prob, dtype=torch.float32),
            tried=torch.tensor(self.tried, dtype=torch.bool),
            rule=verifier.name,
            lossless=verifier.lossless,
        )


# -- the arithmetic of rejection sampling ------------------------------------------------

def _ratio(r_x: float, q_x: float) -> float:
    """``min(1, r(x) / q(x))``; a token the draft could not propose is accepted iff r allows it."""
    if q_x > 0.0:
        return min(1.0, r_x / q_x)
    return 1.0 if r_x > 0.0 else 0.0


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(r - q, 0))``, shapes ``(V,), (V,) -> (V,)``."""
    rest = (r - q).clamp_(min=0.0)
    total = float(rest.sum())
    if total > 0.0:
        return rest / total
    # r <= q everywhere means r == q: every token q can propose is accepted surely, so the
    # rejection came from a token with q(x) = 0 and the target still owes a sample from r.
    return r


def _without(dist: torch.Tensor, x: int) -> torch.Tensor:
    """``dist`` with token ``x`` removed and renormalised, ``(V,) -> (V,)``."""
    out = dist.clone()
    out[x] = 0.0
    total = float(out.sum())
    # Zero mass left means dist was one-hot on x, which is then accepted surely (for r)
    # or can no longer be proposed (for q); keeping dist changes no outcome.
    return out / total if total > 0.0 else dist


def _sample_token(dist: torch.Tensor, uniform: float) -> int:
    """The token of ``dist`` (``(V,)``, any non-negative weights) at quantile ``uniform``;
    inverting the CDF never returns a zero-weight token."""
    cdf = dist.cumsum(0)  # (V,)
    index = int(torch.searchsorted(cdf, uniform * float(cdf[-1]), right=True))
    return min(index, cdf.numel() - 1)


def _rejection_walk(problem: _Problem, trace: _Trace, generator: torch.Generator, *,
                    shuffle: bool, without_replacement: bool) -> int:
    """Rules A-D: walk the tree with residual updates; returns the bonus token."""
    u = 0
    while True:
        r = problem.p(u)  # (V,) residual, starts as the target distribution
        kids = problem.children[u]
        # a leaf has no draft distribution (its row may be all zero): only the bonus is sampled there
        q = problem.q(u) if kids else None  # (V,) or None for a deterministic draft
        if shuffle and q is not None and len(kids) > 1:
            kids = [kids[i] for i in torch.randperm(len(kids), generator=generator).tolist()]
        chosen = None
        for s in kids:
            x = problem.tokens[s]
            a = float(r[x]) if q is None else _ratio(float(r[x]), float(q[x]))
            trace.record(s, a)
            if trace.uniforms[s] < a:  # exactly never for a = 0, always for a = 1
                chosen = s
                break
            if q is None:
                r = _without(r, x)
            else:
                r = _residual(r, q)
                if without_replacement:
                    q = _without(q, x)
        if chosen is None:
            return _sample_token(r, trace.uniforms[0])
        trace.path.append(chosen)
        u = chosen


def _sequential_probs(r: torch.Tensor, q: torch.Tensor | None, toks: list[int],
                      without_replacement: bool) -> list[float]:
    """P(sibling i is the accepted one | parent reached) when siblings are tried in order."""
    out: list[float] = []
    still = 1.0  # probability that every earlier sibling was rejected
    for x in toks:
        a = float(r[x]) if q is None else _ratio(float(r[x]), float(q[x]))
        out.append(still * a)
        still *= 1.0 - a
        if still <= 0.0:
            break
        if q is None:
            r = _without(r, x)
        else:
            r = _residual(r, q)
            if without_replacement:
                q = _without(q, x)
    return out + [0.0] * (len(toks) - len(out))


def _random_order_probs(r: torch.Tensor, q: torch.Tensor, toks: list[int]) -> list[float]:
    """P(sibling i is the accepted one | parent reached) for rule B, averaged over all
    orders of trying the siblings (see the module docstring for why this is cheap)."""
    k = len(toks)
    classes = list(dict.fromkeys(toks))  # C distinct tokens, first-seen order
    mult = [toks.count(x) for x in classes]
    residuals = [r]
    for _ in range(k - 1):
        residuals.append(_residual(residuals[-1], q))
    cls = torch.tensor(classes, dtype=torch.long)
    r_at = torch.stack(residuals)[:, cls].tolist()  # (k, C): r_j(x_c)
    q_at = q[cls].tolist()  # (C,)
    accept = [[_ratio(r_at[j][c], q_at[c]) for c in range(len(classes))] for j in range(k)]
    alive = [[r_at[j][c] > 0.0 for c in range(len(classes))] for j in range(k)]

    def key_at(counts: tuple[int, ...], j: int) -> tuple[int, ...]:
        # Once r_j(x) = 0 a class can never be accepted again: forget its rejected count.
        return tuple(n if alive[j][c] else 0 for c, n in enumerate(counts))

    got = [0.0] * len(classes)  # P(some child of class c is the accepted one)
    states = {key_at((0,) * len(classes), 0): 1.0}  # rejected counts -> probability
    for j in range(k):
        left = k - j
        nxt: dict[tuple[int, ...], float] = defaultdict(float)
        for counts, w in states.items():
            alive_left = 0
            for c, n in enumerate(counts):
                if not alive[j][c]:
                    continue
                m = mult[c] - n
                alive_left += m
                if m == 0:
                    continue
                pick = w * m / left
                got[c] += pick * accept[j][c]
                miss = pick * (1.0 - accept[j][c])
                if j + 1 < k and miss > _NEGLIGIBLE:
                    bumped = counts[:c] + (n + 1,) + counts[c + 1:]
                    nxt[key_at(bumped, j + 1)] += miss
            dead_left = left - alive_left
            if j + 1 < k and dead_left > 0:
                miss = w * dead_left / left  # an impossible token is rejected surely
                if miss > _NEGLIGIBLE:
                    nxt[key_at(counts, j + 1)] += miss
        states = nxt
        if not states:
            break
    index = {x: c for c, x in enumerate(classes)}
    return [got[index[x]] / mult[index[x]] for x in toks]


def _rejection_reach(problem: _Problem, *, random_order: bool,
                     without_replacement: bool) -> torch.Tensor:
    """``(N,)`` float64 probability that each node is accepted, for rules A-D."""
    reach = [0.0] * problem.n
    reach[0] = 1.0
    for u in range(problem.n):  # index order is a topological order
        kids = problem.children[u]
        if not kids or reach[u] == 0.0:
            continue
        r = problem.p(u)
        q = problem.q(u)
        toks = [problem.tokens[s] for s in kids]
        if q is not None and random_order and len(kids) > 1:
            cond = _random_order_probs(r, q, toks)
        else:
            cond = _sequential_probs(r, q, toks, without_replacement)
        for s, c in zip(kids, cond):
            reach[s] = reach[u] * c
    return torch.tensor(reach, dtype=torch.float64)


def _path_indicator(n: int, path: list[int]) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float64)
    out[0] = 1.0
    out[path] = 1.0
    return out


# -- verifiers ------------------------------------------------------------------------------

class Verifier(abc.ABC):
    """A verification rule. Call it on a tree and the target logits to get an
    :class:`Acceptance`; ask it for exact expectations with :meth:`node_reach_probs`.

    Attributes:
        name: the name :func:`get_verifier` knows it by.
        lossless: whether emitted tokens follow the target distribution exactly.
        sibling_sampling: how drafters must propose siblings for the rule to be exact:
            "greedy", "iid", "without_replacement" or "topk".
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    sibling_sampling: ClassVar[str]
    _uses_draft: ClassVar[bool] = False

    def __call__(self, tree: DraftTree, target_logits: torch.Tensor, config: SamplingConfig,
                 generator: torch.Generator) -> Acceptance:
        """Verify ``tree`` against ``target_logits`` (``(N, V)``; row i = logits for the
        token after node i), drawing all randomness from ``generator``: N uniforms per
        call (node i's acceptance coin, node 0's for the bonus token), plus one sibling
        order per reached node for ``specinfer``."""
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        problem = self._problem(tree, target_logits, config)
        trace = _Trace(problem.n, generator)
        bonus = self._walk(problem, trace, generator)
        return trace.acceptance(problem, bonus, self)

    def node_reach_probs(self, tree: DraftTree, target_logits: torch.Tensor,
                         config: SamplingConfig) -> torch.Tensor:
        """``(N,)`` float64: probability that each node is on the accepted path (root = 1)."""
        return self._reach(self._problem(tree, target_logits, config))

    def expected_accept_length(self, tree: DraftTree, target_logits: torch.Tensor,
                               config: SamplingConfig) -> float:
        """Expected number of accepted draft tokens (root excluded) in this step."""
        return float(self.node_reach_probs(tree, target_logits, config)[1:].sum())

    def _problem(self, tree: DraftTree, target_logits: torch.Tensor,
                 config: SamplingConfig) -> _Problem:
        return _Problem(tree, target_logits, config, use_draft=self._uses_draft)

    @abc.abstractmethod
    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        """Fill ``trace`` and return the bonus token."""

    @abc.abstractmethod
    def _reach(self, problem: _Problem) -> torch.Tensor:
        """``(N,)`` float64 reach probabilities."""


@dataclass(frozen=True)
class GreedyVerifier(Verifier):
    """Rule E: follow the child whose token is ``argmax p`` (the first such child when
    several siblings share it); the bonus token is ``argmax p`` at the last accepted node."""

    name: ClassVar[str] = "greedy"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "greedy"

    def _greedy_path(self, problem: _Problem, trace: _Trace) -> int:
        path, best = greedy_walk(problem.children, problem.tokens, lambda u, d: int(problem.p(u).argmax()),
                                 lambda s, hit: trace.record(s, 1.0 if hit else 0.0))
        trace.path.extend(path)
        return best

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return self._greedy_path(problem, trace)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        trace = _Trace(problem.n)
        self._greedy_path(problem, trace)
        return _path_indicator(problem.n, trace.path)


@dataclass(frozen=True)
class TopKVerifier(Verifier):
    """Rule D: siblings are the draft's top-k, treated as if ``q`` were one-hot.

    Children are tried in index order; sibling ``x`` is accepted with probability
    ``r(x)``; on rejection ``r(x) = 0`` and ``r`` is renormalised; if none is accepted
    the bonus token is drawn from ``r``. ``tree.draft_probs`` is ignored.
    """

    name: ClassVar[str] = "topk"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "topk"

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=False, without_replacement=False)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=False, without_replacement=False)


@dataclass(frozen=True)
class SpecInferVerifier(Verifier):
    """Rule B: multi-step speculative sampling over a tree (SpecInfer).

    At a reached node the children are tried in a random order drawn from the
    generator; child ``x`` is accepted with probability ``min(1, r(x) / q(x))``; on
    rejection ``r = norm(max(r - q, 0))``. Exact when siblings are drawn i.i.d. from
    ``q``. With a deterministic draft (``tree.draft_probs`` None) it is rule D.
    """

    name: ClassVar[str] = "specinfer"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "iid"
    _uses_draft: ClassVar[bool] = True

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=True, without_replacement=False)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=True, without_replacement=False)


@dataclass(frozen=True)
class SequoiaVerifier(Verifier):
    """Rule C: rule B for siblings drawn from ``q`` without replacement (Sequoia).

    Children are tried in index order (their draw order); after rejecting ``x`` the
    residual is updated as in B and ``q(x)`` is set to 0 and ``q`` renormalised.
    """

    name: ClassVar[str] = "sequoia"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "without_replacement"
    _uses_draft: ClassVar[bool] = True

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=False, without_replacement=True)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=False, without_replacement=True)


@dataclass(frozen=True)
class ChainVerifier(Verifier):
    """Rule A: chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; on the first
    rejection emit a sample from ``norm(max(p_i - q_i, 0))``; if every draft is
    accepted emit a sample from ``p`` at the last node. Needs a chain (at most one
    child per node); use ``specinfer`` or ``sequoia`` for trees.
    """

    name: ClassVar[str] = "chain"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "iid"
    _uses_draft: ClassVar[bool] = True

    def _problem(self, tree: DraftTree, target_logits: torch.Tensor,
                 config: SamplingConfig) -> _Problem:
        problem = super()._problem(tree, target_logits, config)
        for u, kids in enumerate(problem.children):
            if len(kids) > 1:
                raise ValueError(
                    f"the chain verifier needs a chain (at most one child per node), but node {u} "
                    f"has {len(kids)} children {kids}; use 'specinfer' or 'sequoia' for trees"
                )
        return problem

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=False, without_replacement=False)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=False, without_replacement=False)


@dataclass(frozen=True)
class TypicalVerifier(Verifier):
    """Rule F, lossy: Medusa's typical acceptance.

    A node passes if ``p(x) > min(eps, alpha * exp(-H(p)))`` with ``p`` the target
    distribution at its parent. The accepted path is the deepest node whose whole path
    passes (Medusa keeps the longest accepted candidate; ties go to the lowest node
    index). The bonus token is a sample from ``p`` at the last accepted node (the argmax
    at temperature 0, where this rule reduces to greedy).

    Args:
        eps: hard threshold on ``p(x)`` (Medusa's ``posterior_threshold``).
        alpha: entropy-scaled threshold factor (Medusa's ``posterior_alpha``).
    """

    eps: float = 0.09
    alpha: float = 0.3

    name: ClassVar[str] = "typical"
    lossless: ClassVar[bool] = False
    sibling_sampling: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        if not 0.0 < self.eps <= 1.0:
            raise ValueError(f"eps must be in (0, 1], got {self.eps}")
        if not self.alpha > 0.0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    def _typical_path(self, problem: _Problem, trace: _Trace) -> None:
        passes = [False] * problem.n
        passes[0] = True
        probs: dict[int, torch.Tensor] = {}
        thresholds: dict[int, float] = {}
        for s in range(1, problem.n):
            u = problem.parents[s]
            if not passes[u]:
                continue
            if u not in probs:
                p = problem.p(u)  # (V,)
                entropy = float(-torch.special.xlogy(p, p).sum())
                probs[u] = p
                thresholds[u] = min(self.eps, self.alpha * math.exp(-entropy))
            passes[s] = float(probs[u][problem.tokens[s]]) > thresholds[u]
            trace.record(s, 1.0 if passes[s] else 0.0)
        depth = depths(torch.tensor(problem.parents)).tolist()
        best = max(range(problem.n), key=lambda i: (passes[i], depth[i], -i))
        node = best
        while node != 0:
            trace.path.append(node)
            node = problem.parents[node]
        trace.path.reverse()

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        self._typical_path(problem, trace)
        last = trace.path[-1] if trace.path else 0
        return _sample_token(problem.p(last), trace.uniforms[0])

    def _reach(self, problem: _Problem) -> torch.Tensor:
        trace = _Trace(problem.n)
        self._typical_path(problem, trace)
        return _path_indicator(problem.n, trace.path)


@dataclass(frozen=True)
class NaiveVerifier(Verifier):
    """Rule G, lossy: the tutorial rule "accept x if p(x) >= min_ratio * q(x)".

    Children are tried in index order and the first that passes is accepted. When
    none passes, the bonus token is a fresh sample from ``p`` at that node, as the
    tutorials do: together with the hard threshold this skews the output towards the
    draft (a lossless rule would sample the residual instead). With a deterministic
    draft ``q(x) = 1``.

    Args:
        min_ratio: 1.0 gives "naive" (``p >= q``), 0.5 gives "naive_half".
    """

    min_ratio: float = 1.0

    lossless: ClassVar[bool] = False
    sibling_sampling: ClassVar[str] = "iid"
    _uses_draft: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not self.min_ratio > 0.0:
            raise ValueError(f"min_ratio must be > 0, got {self.min_ratio}")

    @property
    def name(self) -> str:  # type: ignore[override]
        if self.min_ratio == 1.0:
            return "naive"
        if self.min_ratio == 0.5:
            return "naive_half"
        return f"naive_{self.min_ratio:g}"

    def _naive_path(self, problem: _Problem, trace: _Trace) -> int:
        """Fill ``trace`` and return the last accepted node."""
        u = 0
        while True:
            p = problem.p(u)
            q = problem.q(u) if problem.children[u] else None
            chosen = None
            for s in problem.children[u]:
                x = problem.tokens[s]
                q_x = 1.0 if q is None else float(q[x])
                hit = float(p[x]) >= self.min_ratio * q_x
                trace.record(s, 1.0 if hit else 0.0)
                if hit:
                    chosen = s
                    break
            if chosen is None:
                return u
            trace.path.append(chosen)
            u = chosen

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        last = self._naive_path(problem, trace)
        return _sample_token(problem.p(last), trace.uniforms[0])

    def _reach(self, problem: _Problem) -> torch.Tensor:
        trace = _Trace(problem.n)
        self._naive_path(problem, trace)
        return _path_indicator(problem.n, trace.path)


# -- registry and module-level API -----------------------------------------------------------

_REGISTRY: dict[str, tuple[type[Verifier], dict[str, float]]] = {
    "greedy": (GreedyVerifier, {}),
    "chain": (ChainVerifier, {}),
    "specinfer": (SpecInferVerifier, {}),
    "sequoia": (SequoiaVerifier, {}),
    "topk": (TopKVerifier, {}),
    "typical": (TypicalVerifier, {}),
    "naive": (NaiveVerifier, {"min_ratio": 1.0}),
    "naive_half": (NaiveVerifier, {"min_ratio": 0.5}),
}

VERIFIERS: tuple[str, ...] = tuple(_REGISTRY)


def get_verifier(name: str, **kw) -> Verifier:
    """Return the verifier called ``name`` (one of :data:`VERIFIERS`).

    Keyword arguments go to its constructor, e.g. ``get_verifier("typical", eps=0.05)``.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown verifier {name!r}; valid names: {', '.join(VERIFIERS)}")
    cls, fixed = _REGISTRY[name]
    clash = sorted(set(kw) & set(fixed))
    if clash:
        raise TypeError(f"verifier {name!r} fixes {clash}; use NaiveVerifier(...) to set them")
    try:
        return cls(**fixed, **kw)
    except TypeError as err:
        raise TypeError(f"bad options {sorted(kw)} for verifier {name!r}: {err}") from None


def _as_verifier(rule: str | Verifier) -> Verifier:
    if isinstance(rule, Verifier):
        return rule
    if isinstance(rule, str):
        return get_verifier(rule)
    raise TypeError(f"rule must be a verifier name or a Verifier, got {type(rule).__name__}")


def node_reach_probs(tree: DraftTree, target_logits: torch.Tensor, config: SamplingConfig,
                     rule: str | Verifier = "topk") -> torch.Tensor:
    """Probability that each node ends up on the accepted path, computed exactly.

    Args:
        tree: the draft tree (its ``draft_probs`` are used by the sampling rules).
        target_logits: ``(N, V)``; row i = target logits for the token after node i.
        config: the sampling configuration the target and the drafter share.
        rule: a name from :data:`VERIFIERS` or a :class:`Verifier`.

    Returns:
        ``(N,)`` float64, 1.0 at the root; the sum over non-root nodes is the expected
        acceptance length, and a node's value is at most its parent's.
    """
    return _as_verifier(rule).node_reach_probs(tree, target_logits, config)


def expected_accept_length(tree: DraftTree, target_logits: torch.Tensor, config: SamplingConfig,
                           rule: str | Verifier = "topk") -> float:
    """Exact expected number of accepted draft tokens (root excluded) for one step.

    Add 1 for tau (tokens committed per target call). Arguments as in
    :func:`node_reach_probs`.
    """
    return _as_verifier(rule).expected_accept_length(tree, target_logits, config)

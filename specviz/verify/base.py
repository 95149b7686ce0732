"""The shared machinery of every verification rule: the validated inputs of one step, the
record of what the rule tried, the arithmetic of rejection sampling and the :class:`Verifier`
interface (the rules themselves: :mod:`specviz.verify.lossless`, :mod:`specviz.verify.lossy`;
their names and the module-level API: :mod:`specviz.verify.rules`).

Dimension legend: N = nodes in the draft tree including the root, V = vocabulary size.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from specviz.sampling import SamplingConfig, probs_from_logits
from specviz.tree.core import DraftTree, children_lists

__all__ = ["Acceptance", "Verifier"]

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
    def n_accepted(self) -> int:
        """Accepted draft tokens in this step."""
        return len(self.accepted_nodes)

    @property
    def tau(self) -> int:
        """Tokens committed by this step: accepted draft tokens plus the bonus token."""
        return self.n_accepted + 1

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

    def expected_accepted(self, tree: DraftTree, target_logits: torch.Tensor,
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

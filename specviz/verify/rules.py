"""Verification: which drafted tokens the target keeps, and how many it should keep.

A verifier walks a :class:`~specviz.tree.DraftTree` from the root. At every reached
node it tries the node's children against the target distribution ``p`` there, moves
to the child it accepts, and stops at the first node where it accepts none; it then
adds one *bonus* token. The rules, each lossless one with the paper that introduced it:

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

Exact expectations (:func:`node_reach_probs`, :func:`expected_accepted`) are
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

import torch

from specviz.sampling import SamplingConfig
from specviz.tree.core import DraftTree
from specviz.verify.base import Acceptance, Verifier
from specviz.verify.lossless import ChainVerifier, GreedyVerifier, SequoiaVerifier, SpecInferVerifier, TopKVerifier
from specviz.verify.lossy import NaiveVerifier, TypicalVerifier

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
    "as_verifier",
    "node_reach_probs",
    "expected_accepted",
]


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


def as_verifier(rule: str | Verifier, argument: str = "rule") -> Verifier:
    """``rule`` as a :class:`Verifier`: a name of :data:`VERIFIERS` is looked up, a Verifier
    passes through; ``argument`` names the caller's parameter in the error."""
    if isinstance(rule, Verifier):
        return rule
    if isinstance(rule, str):
        return get_verifier(rule)
    raise TypeError(f"{argument} must be a verifier name or a Verifier, got {type(rule).__name__}")


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
        number of accepted draft tokens, and a node's value is at most its parent's.
    """
    return as_verifier(rule).node_reach_probs(tree, target_logits, config)


def expected_accepted(tree: DraftTree, target_logits: torch.Tensor, config: SamplingConfig,
                           rule: str | Verifier = "topk") -> float:
    """Exact expected number of accepted draft tokens (root excluded) for one step.

    Add 1 for tau (tokens committed per target call). Arguments as in
    :func:`node_reach_probs`.
    """
    return as_verifier(rule).expected_accepted(tree, target_logits, config)

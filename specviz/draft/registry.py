"""Every drafting strategy by name: the one vocabulary of the benchmark, the checks, the
explorer and the notebooks.

A *method name* is a family plus its parameters, e.g. ``chain-k4``, ``tree-2x2x1``,
``dynamic-w4-d5-b16`` or just ``dynamic`` (every parameter at its default). Each letter
means one thing in every family (:data:`NAME_LETTERS`, the table ``--list-methods``
prints): ``k`` a chain's tokens, ``w`` a tree's width, ``d`` its depth, ``b`` the draft
budget, ``n`` an n-gram order, and so on. Names in an older spelling (:data:`OLD_NAMES`)
are refused with the current name; readers of stored results translate them with
:func:`rename_methods`, which says which old names it read. The
``medusa``, ``eagle`` and ``eagle-chain`` families draft with heads trained for the
target (:mod:`specviz.heads`), found in the specviz cache when the drafter is built.
:func:`parse_strategy` turns a name into a :class:`MethodSpec` and :func:`build_drafter`
builds its :class:`~specviz.draft.base.Drafter` for a :class:`~specviz.models.ModelPair`.

Each strategy is one :class:`Strategy` in :data:`STRATEGIES`: its name grammar, its
parameters with their defaults, the verification rule it runs with under sampling (its
siblings decide which rule is exact) and how it is built. The benchmark's other
methods (transformers' own decoding) are :class:`Family` entries of the same grammar
kept in :mod:`specviz.bench.e2e`, parsed by the same :func:`parse_name`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specviz.draft.adaptive import AdaptiveChainDrafter
from specviz.draft.base import Drafter
from specviz.draft.lookahead import JacobiDrafter, LookaheadDrafter
from specviz.draft.fallback import FallbackDrafter
from specviz.draft.switch import SwitchDrafter
from specviz.draft.chooser import ChooserDrafter
from specviz.draft.merged import MergedDrafter
from specviz.draft.model import ChainDrafter, DynamicTreeDrafter, TreeDrafter
from specviz.draft.ngram import AdaptiveNgramDrafter, NgramDrafter, NgramTrieDrafter
from specviz.draft.self_spec import SelfSpeculativeDrafter
from specviz.draft.suffix import SuffixDrafter
from specviz.tree.budgets import budgeted_kary
from specviz.tree.shapes import chain, expansion

__all__ = [
    "Param",
    "Family",
    "Strategy",
    "MethodSpec",
    "STRATEGIES",
    "NAME_LETTERS",
    "OLD_NAMES",
    "current_name",
    "rename_methods",
    "parse_name",
    "parse_strategy",
    "build_drafter",
    "heads_kinds",
    "eagle_head_mode",
    "medusa_head_mode",
]

#: a parameter's value: an int, a list of ints ("2x2x1") or a word ("heuristic")
Value = int | str | tuple[int, ...]
_KINDS = ("int", "ints", "word")


@dataclass(frozen=True)
class Param:
    """One parameter of a family's names.

    Attributes:
        name: the parameter, as the builder receives it.
        default: its value when a name leaves it out; None = the name always gives it, or
            the builder derives it from the models (the family's description says how).
        kind: "int" (>= 1), "ints" (``B1xB2x...``, each >= 1) or "word".
    """

    name: str
    default: Value | None = None
    kind: str = "int"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Param kind must be one of {_KINDS}, got {self.kind!r}")

    def read(self, method: str, raw: str) -> Value:
        """The value of this parameter's text ``raw`` in the name ``method``."""
        if self.kind == "word":
            return raw
        numbers = tuple(int(b) for b in raw.split("x"))
        if min(numbers) < 1:
            raise ValueError(f"method {method!r}: {self.name} must be >= 1, got {raw}")
        return numbers if self.kind == "ints" else numbers[0]


@dataclass(frozen=True)
class Family:
    """A family of method names: a pattern whose groups are the parameters.

    Attributes:
        name: the family, e.g. "chain".
        usage: the names it accepts, as shown to users, e.g. ``"chain-k<K>"``.
        pattern: a regex matching the whole name; group ``i`` is ``params[i]`` (an
            absent optional group keeps the parameter's default).
        params: the parameters, in group order.
        description: one line for ``--list-methods``.
    """

    name: str
    usage: str
    pattern: str
    params: tuple[Param, ...]
    description: str

    def match(self, method: str) -> "MethodSpec | None":
        """The parsed ``method`` if this family spells it, else None."""
        found = re.fullmatch(self.pattern, method)
        if found is None:
            return None
        given = tuple((p.name, p.read(method, raw)) for p, raw in zip(self.params, found.groups()) if raw is not None)
        return MethodSpec(method, self, given)


@dataclass(frozen=True)
class Strategy(Family):
    """A specviz drafting strategy: a :class:`Family` that builds a drafter.

    Attributes:
        verifier: the verification rule under sampling: "chain" (Leviathan's rule) for
            chains drawn from a draft distribution, "topk" (rule D) for deterministic
            siblings; greedy decoding always verifies greedily.
        build: ``build(pair, arguments)`` -> the drafter, with ``arguments`` every
            parameter's value (defaults filled in).
    """

    verifier: str
    build: Callable[[Any, dict[str, Any]], Drafter]


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name.

    Attributes:
        name: the name as given, e.g. ``"tree-2x2x1"``.
        definition: the :class:`Family` (or :class:`Strategy`) that spells it.
        params: ``(parameter, value)`` pairs given in the name, in the family's order.
    """

    name: str
    definition: Family
    params: tuple[tuple[str, Value], ...] = ()

    @property
    def family(self) -> str:
        """The family's name, e.g. ``"tree"``."""
        return self.definition.name

    @property
    def is_strategy(self) -> bool:
        """A specviz drafting strategy (as opposed to another method of the benchmark)."""
        return isinstance(self.definition, Strategy)

    def param(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` given in the name, else ``default``."""
        return dict(self.params).get(key, default)

    def arguments(self) -> dict[str, Any]:
        """Every parameter's value: given in the name, else its default."""
        return {p.name: p.default for p in self.definition.params} | dict(self.params)

    def verifier(self, temperature: float, override: str | None = None) -> str:
        """The verification rule a strategy runs with ("" for other methods): greedy at
        temperature 0, else ``override`` when given, else the strategy's own."""
        if not self.is_strategy:
            return ""
        if temperature == 0.0:
            return "greedy"
        return override or self.definition.verifier


def _tree(pair, a: dict[str, Any]) -> Drafter:
    if a["branching"] is not None:
        return TreeDrafter(pair.draft, expansion(list(a["branching"])), vocab=a["vocab"])
    return TreeDrafter(pair.draft, budgeted_kary(a["width"], a["depth"], a["budget"]), vocab=a["vocab"])


def _medusa(pair, a: dict[str, Any]) -> Drafter:
    from specviz.draft.heads import head_drafter, medusa_tree
    from specviz.models.saved_heads import find_heads, heads_validation

    path = find_heads(pair.target.name, "medusa")
    if a["tree_budget"] is not None:  # the best tree of that many nodes for the heads' validation accuracy
        shape = medusa_tree([h["rank_accuracy"] for h in heads_validation(path)["heads"]], a["tree_budget"])
    elif a["width"] is not None:
        shape = budgeted_kary(a["width"], a["depth"], a["budget"])
    else:
        shape = expansion(list(a["branching"]))
    return head_drafter(pair, path, shape=shape, dtype=medusa_head_mode(pair.target))


def _eagle(pair, a: dict[str, Any]) -> Drafter:
    from specviz.draft.heads import head_drafter
    from specviz.models.saved_heads import find_heads

    path = find_heads(pair.target.name, "eagle")
    dtype = eagle_head_mode(pair.target)
    if a.get("k") is not None:  # a chain
        return head_drafter(pair, path, topk=1, depth=a["k"], budget=a["k"], dtype=dtype)
    return head_drafter(pair, path, topk=a["topk"], depth=a["depth"], budget=a["budget"], dtype=dtype)


def _packed_head_mode(target) -> str | None:
    """A head's weight mode for ``target`` (see :func:`eagle_head_mode`)."""
    dtype = target.model.dtype
    if dtype == torch.float32 and target.weight_mode == "fp32":
        return None
    if target.device.type == "cpu":
        from specviz.quant.extension import vnni_kernel, w4a8_token_op

        if w4a8_token_op() is not None and vnni_kernel():
            return "w4a8-token"
        return "w8a8-token" if "fbgemm" in torch.backends.quantized.supported_engines else None
    return "bf16" if dtype == torch.float32 else str(dtype).removeprefix("torch.")


def eagle_head_mode(target) -> str | None:
    """The weight mode the registry's EAGLE head drafts in for ``target``: as trained
    (float32, None) for a float32 target, the exactness reference; on a CPU otherwise
    ``w4a8-token`` where the compiled operator runs with its AVX-512 VNNI kernel (4-bit
    weights, int8 activations: on a 2-core AVX-512 CPU a chain of 2 drafted in 6.5 ms a
    step against 8.8 ms in ``w8a8-token``, at the same tau), else ``w8a8-token`` where
    fbgemm runs (x86), else as trained; the target's dtype on an accelerator.
    Verification is the target's in every case, so decoding stays lossless."""
    return _packed_head_mode(target)


def medusa_head_mode(target) -> str | None:
    """The weight mode the registry's Medusa heads draft in for ``target``: as
    :func:`eagle_head_mode`. On a 2-core AVX-512 CPU a step of a 2-node tree over a
    16,384-token vocabulary drafted in 1.5 ms in ``w4a8-token`` and 17.5 ms as trained
    (float32)."""
    return _packed_head_mode(target)


def _part_drafters(pair, names: str, strategy: str, nested: tuple[str, ...], why: str) -> list[Drafter]:
    """The drafters of a composite strategy's ``+``-separated part names; an unknown part or
    one of the ``nested`` families is an error naming the part (``why`` says why not)."""
    parts = []
    for name in names.split("+"):
        try:
            spec = parse_strategy(name)
        except ValueError as exc:
            raise ValueError(f"{strategy} strategy part {name!r}: {exc}") from None
        if spec.family in nested:
            raise ValueError(f"{strategy} strategy part {name!r}: {why}; list its parts instead")
        parts.append(build_drafter(spec, pair))
    return parts


def _merged(pair, a: dict[str, Any]) -> Drafter:
    if a["parts"] is None:
        return MergedDrafter([ChainDrafter(pair.draft, 4), NgramDrafter()], a["budget"])
    return MergedDrafter(_part_drafters(pair, a["parts"], "merged", ("merged", "choose"), "merged trees do not nest"),
                         a["budget"])


#: the default parts of the ``fallback`` strategy
FALLBACK_DEFAULT = "ngram-n3-k4-min2+chain-k2"


def _fallback(pair, a: dict[str, Any]) -> Drafter:
    return FallbackDrafter(_part_drafters(pair, a["parts"] or FALLBACK_DEFAULT, "fallback",
                                          ("fallback", "merged", "switch", "choose"),
                                          "composite strategies do not nest in a cascade"))


#: the default parts of the ``switch`` strategy
SWITCH_DEFAULT = "ngram-adaptive+chain-k2"


def _chooser(cls, family: str, default: str, kind: str):
    """The builder of a composite family that gives each step to one of its parts: ``cls``
    over the parts named (``default`` when none), any error of theirs naming them."""
    def build(pair, a: dict[str, Any]) -> Drafter:
        names = a["parts"] or default
        parts = _part_drafters(pair, names, family, ("fallback", "merged", "switch", "choose"),
                               f"composite strategies do not nest in a {kind}")
        try:
            return cls(parts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{family} strategy parts {names!r}: {exc}") from None
    return build


_switch = _chooser(SwitchDrafter, "switch", SWITCH_DEFAULT, "switch")


#: the default parts of the ``choose`` strategy: prompt lookup, suffix trees and the draft model's chain
CHOOSE_DEFAULT = "ngram-n3-k4+suffix+chain-k2"


_choose = _chooser(ChooserDrafter, "choose", CHOOSE_DEFAULT, "chooser")


def heads_kinds(spec: MethodSpec) -> tuple[str, ...]:
    """The kinds of trained heads (``"medusa"``, ``"eagle"``) a strategy drafts with, its
    merged parts' included, in the order of the parts (each once)."""
    kind = {"medusa": "medusa", "eagle": "eagle", "eagle-chain": "eagle"}.get(spec.family)
    if kind is not None:
        return (kind,)
    if spec.family in ("merged", "fallback", "choose") and spec.param("parts"):
        parts = (k for n in spec.param("parts").split("+") for k in heads_kinds(parse_strategy(n)))
        return tuple(dict.fromkeys(parts))
    return ()


def _self_spec(pair, a: dict[str, Any]) -> Drafter:
    n_layers = a["n_layers"] if a["n_layers"] is not None else pair.target.model.config.num_hidden_layers // 2
    return SelfSpeculativeDrafter(pair.target, n_layers=n_layers, shape=chain(a["k"]))


#: every drafting strategy, in the order ``--list-methods`` shows them
STRATEGIES: tuple[Strategy, ...] = (
    Strategy("chain", "chain-k<K>[-v<N>]", r"chain-k(\d+)(?:-v(\d+))?", (Param("k"), Param("vocab")),
             "draft-model chain of K tokens; -v<N>: the draft scores only the N most frequent tokens of its ranking "
             "plus the sequence's own (specviz.draft.vocab)",
             "chain", lambda pair, a: ChainDrafter(pair.draft, a["k"], vocab=a["vocab"])),
    Strategy("tree", "tree-<B1>x<B2>x... | tree-w<W>-d<D>-b<B>, then [-v<V>]",
             r"tree-(?:(\d+(?:x\d+)*)|w(\d+)-d(\d+)-b(\d+))(?:-v(\d+))?",
             (Param("branching", kind="ints"), Param("width"), Param("depth"), Param("budget"), Param("vocab")),
             "static draft-model tree: branching B1 at depth 1, B2 at depth 2, ...; or the first B nodes, "
             "breadth first, of the W-ary tree of depth D; -v<V>: a reduced draft vocabulary as for chain", "topk",
             _tree),
    Strategy("dynamic", "dynamic[-w<W>-d<D>-b<B>][-v<V>]", r"dynamic(?:-w(\d+)-d(\d+)-b(\d+))?(?:-v(\d+))?",
             (Param("topk", 4), Param("depth", 5), Param("budget", 16), Param("vocab")),
             "EAGLE-2 dynamic tree: W children per node and a frontier of W, D expansions, B nodes kept (default "
             "w4-d5-b16); -v<V>: a reduced draft vocabulary as for chain", "topk",
             lambda pair, a: DynamicTreeDrafter(pair.draft, topk=a["topk"], depth=a["depth"], budget=a["budget"],
                                                vocab=a["vocab"])),
    Strategy("adaptive", "adaptive[-throughput|-heuristic]", r"adaptive(?:-(throughput|heuristic))?",
             (Param("schedule", "throughput", "word"),),
             "draft-model chain of adaptive length (default throughput rule)", "chain",
             lambda pair, a: AdaptiveChainDrafter(pair.draft, schedule=a["schedule"])),
    Strategy("ngram", "ngram[-n<N>-k<K>][-min<M>]", r"ngram(?:-n(\d+)-k(\d+))?(?:-min(\d+))?",
             (Param("n", 3), Param("k", 5), Param("min_n", 1)),
             "prompt lookup chain, n-grams up to N, K tokens; -min<M>: no proposal without a match of at least "
             "M tokens (default n3-k5, min 1)", "topk",
             lambda pair, a: NgramDrafter(n=a["n"], k=a["k"], min_n=a["min_n"])),
    Strategy("ngram-adaptive", "ngram-adaptive[-n<N>-k<K>][-min<M>]",
             r"ngram-adaptive(?:-n(\d+)-k(\d+))?(?:-min(\d+))?",
             (Param("n", 3), Param("k", 8), Param("min_n", 1)),
             "prompt lookup chain whose length (0 to K) is chosen every step for expected throughput, from "
             "the acceptance seen per match length and the measured cost of verifying (default n3-k8)", "topk",
             lambda pair, a: AdaptiveNgramDrafter(n=a["n"], k_max=a["k"], min_n=a["min_n"])),
    Strategy("ngram-trie", "ngram-trie[-n<N>-d<D>-b<B>][-m<M>]",
             r"ngram-trie(?:-n(\d+)-d(\d+)-b(\d+))?(?:-m(\d+))?",
             (Param("n", 3), Param("depth", 5), Param("budget", 16), Param("max_matches", 8)),
             "trie of up to M prompt-lookup matches of n-grams up to N, D deep, B nodes (default n3-d5-b16-m8)", "topk",
             lambda pair, a: NgramTrieDrafter(n=a["n"], depth=a["depth"], budget=a["budget"],
                                              max_matches=a["max_matches"])),
    Strategy("suffix", "suffix[-n<N>-d<D>-b<B>]", r"suffix(?:-n(\d+)-d(\d+)-b(\d+))?",
             (Param("n", 8), Param("depth", 8), Param("budget", 16)),
             "SuffixDecoding: of the context's suffixes of up to N tokens found in the request's suffix tree or in "
             "the one over earlier requests' outputs, the one whose tree of most frequent continuations scores "
             "highest; D deep, at most B nodes and one per matched token (default n8-d8-b16)", "topk",
             lambda pair, a: SuffixDrafter(n=a["n"], depth=a["depth"], budget=a["budget"])),
    Strategy("merged", "merged[-b<B>][-<P1>+<P2>[+...]]",
             r"merged(?:-b(\d+))?(?:-([A-Za-z0-9-]+(?:\+[A-Za-z0-9-]+)+))?",
             (Param("budget", None), Param("parts", None, "word")),
             "SpecInfer's merged tree of several strategies' drafts, verified in one target call (default "
             "chain-k4+ngram; e.g. merged-medusa-b4+ngram-n3-k8); -b<B>: at most B draft nodes, "
             "shared by the parts in order, a dynamic tree taking what the parts before it left (e.g. "
             "merged-b16-ngram-n3-k6+eagle-w8-d3-b16)", "topk", _merged),
    Strategy("fallback", "fallback[-<P1>+<P2>[+...]]", r"fallback(?:-([A-Za-z0-9-]+(?:\+[A-Za-z0-9-]+)+))?",
             (Param("parts", None, "word"),),
             "cascade: the first part that proposes anything drafts the step, later parts run only when the "
             "earlier ones are silent (default ngram-n3-k4-min2+chain-k2: the draft model only where prompt "
             "lookup finds no match of 2 tokens)", "topk", _fallback),
    Strategy("switch", "switch[-<LOOKUP>+<CHAIN>]", r"switch(?:-([A-Za-z0-9-]+\+[A-Za-z0-9-]+))?",
             (Param("parts", None, "word"),),
             "each step, the adaptive prompt-lookup chain or the draft model's chain, whichever has the higher "
             "expected tokens per unit of time from the acceptance and costs measured so far; the draft model "
             "joins once the lookup has had nothing to propose twice (default ngram-adaptive+chain-k2)", "topk",
             _switch),
    Strategy("choose", "choose[-<P1>+<P2>[+...]]", r"choose(?:-([A-Za-z0-9-]+(?:\+[A-Za-z0-9-]+)+))?",
             (Param("parts", None, "word"),),
             "each step, whichever part promises the most committed tokens per second, from its acceptance per "
             "depth and its drafting and verification times measured on the sequence so far; each part is tried "
             "first and again when it has not drafted for a while, cheap parts (lookup) are asked every step "
             "(default ngram-n3-k4+suffix+chain-k2)", "topk", _choose),
    Strategy("jacobi", "jacobi[-k<K>]", r"jacobi(?:-k(\d+))?", (Param("k", 5),),
             "Jacobi decoding: a block of K guesses, last step's target predictions (default k5)", "topk",
             lambda pair, a: JacobiDrafter(k=a["k"])),
    Strategy("lookahead", "lookahead[-w<W>-n<N>-g<G>][-context]",
             r"lookahead(?:-w(\d+)-n(\d+)-g(\d+))?(?:-(context))?",
             (Param("window", 5), Param("ngram", 4), Param("guesses", 5), Param("pool", "jacobi", "word")),
             "lookahead decoding: a W-wide Jacobi window of N-1 levels in the target's forward fills an n-gram "
             "pool, G guesses verified per step; -context adds the committed text's n-grams (default w5-n4-g5)",
             "topk", lambda pair, a: LookaheadDrafter(window=a["window"], ngram=a["ngram"], guesses=a["guesses"],
                                                      pool=a["pool"])),
    Strategy("self-spec", "self-spec[-L<L>][-k<K>]", r"self-spec(?:-L(\d+))?(?:-k(\d+))?",
             (Param("n_layers"), Param("k", 4)),
             "target's first L layers draft a chain of K (default half the layers, k4)", "chain", _self_spec),
    Strategy("medusa", "medusa[-<B1>x<B2>x...|-w<W>-d<D>-b<B>|-b<B>]",
             r"medusa(?:-(\d+(?:x\d+)*)|-w(\d+)-d(\d+)-b(\d+)|-b(\d+))?",
             (Param("branching", (3, 2, 1, 1), "ints"), Param("width"), Param("depth"), Param("budget"),
              Param("tree_budget")),
             "Medusa heads trained for the target (python -m specviz.heads train --kind medusa): head D's top "
             "B_D candidates at depth D, the first B nodes of the W-ary tree of depth D, or (-b<B> alone) the tree of "
             "B nodes with the most expected accepted tokens for the heads' accuracy by rank on their validation "
             "split (default 3x2x1x1; the heads draft in a packed weight mode on a CPU unless the target is fp32, "
             "see medusa_head_mode)", "topk", _medusa),
    Strategy("eagle", "eagle[-w<W>-d<D>-b<B>]", r"eagle(?:-w(\d+)-d(\d+)-b(\d+))?",
             (Param("topk", 4), Param("depth", 5), Param("budget", 16)),
             "EAGLE-2 dynamic tree of a feature head trained for the target (python -m specviz.heads train "
             "--kind eagle; default w4-d5-b16; the head drafts in a packed weight mode on a CPU unless the target "
             "is fp32, see eagle_head_mode)", "topk", _eagle),
    Strategy("eagle-chain", "eagle-chain[-k<K>]", r"eagle-chain(?:-k(\d+))?", (Param("k", 4),),
             "chain of K tokens of the trained EAGLE feature head (default k4)", "topk", _eagle),
)


#: what each letter of a strategy name means, in every family that uses it
NAME_LETTERS: tuple[tuple[str, str], ...] = (
    ("k<K>", "tokens in a chain: its length (the most, where the length adapts; a Jacobi block's guesses)"),
    ("w<W>", "width: children per node and frontier width of a tree; the Jacobi window of lookahead"),
    ("d<D>", "depth of a tree: draft tokens along its longest path (expansions of a dynamic tree)"),
    ("b<B>", "budget: the most draft nodes per step"),
    ("n<N>", "n-gram order: the longest n-gram prompt lookup matches (suffix decoding: the longest pattern); "
             "lookahead's n-gram length"),
    ("g<G>", "guesses verified per step (lookahead)"),
    ("m<M>", "prompt-lookup matches merged into one trie"),
    ("min<M>", "the shortest match prompt lookup drafts from"),
    ("v<V>", "reduced draft vocabulary: the V most frequent tokens of its ranking plus the sequence's own"),
    ("L<L>", "target layers that draft (self-speculation)"),
    ("<B1>x<B2>x...", "branching: children per node at depth 1, 2, ..."),
    ("<P1>+<P2>", "the parts of a composite strategy, each a strategy name"),
)

#: older spellings and the current name each reads as: ``(pattern, replacement)``, applied in
#: order with :func:`re.sub` (strategy names, also inside composite names, and the explorer's
#: former labels)
OLD_NAMES: tuple[tuple[str, str], ...] = (
    (r"(?<![A-Za-z])(tree|dynamic|eagle|medusa)-k(\d+)-d(\d+)-n(\d+)", r"\1-w\2-d\3-b\4"),  # width -k, budget -n
    (r"(?<![A-Za-z])(medusa|sequoia)-n(\d+)\b", r"\1-b\2"),  # a budget was -n
    (r"^static shape$", "tree"),  # the explorer's former labels
    (r"^n-gram$", "ngram-trie"),
    (r"^adaptive n-gram$", "ngram-adaptive"),
    (r"^cascade$", "fallback"),
    (r"^eagle \+ lookup$", "merged"),
)


def current_name(name: str) -> str:
    """``name`` in the current spelling (itself where no :data:`OLD_NAMES` pattern applies)."""
    for pattern, replacement in OLD_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


def rename_methods(frame, columns: Sequence[str] = ("method", "strategy")) -> dict[str, str]:
    """Rewrite the strategy names of stored results in ``frame``'s ``columns`` (those it has)
    to the current spelling, in place; returns ``{old name: current name}`` for each old
    name read, so that the reader can say so."""
    renamed: dict[str, str] = {}
    for column in columns:
        if column not in frame.columns:
            continue
        values = frame[column]
        old = {v: current_name(v) for v in values.dropna().unique() if isinstance(v, str)}
        old = {k: v for k, v in old.items() if k != v}
        if old:
            frame[column] = values.replace(old)
            renamed.update(old)
    return renamed


def parse_name(name: str, families: Sequence[Family], what: str = "method") -> MethodSpec:
    """Parse ``name`` with the first of ``families`` that spells it.

    Args:
        name: a method name.
        families: the grammar, in order.
        what: what a name is called in the error message ("method", "strategy").

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: no family spells it (the message lists the grammar), or a numeric
            parameter < 1.
    """
    if not isinstance(name, str):
        raise TypeError(f"a {what} name must be a str, got {type(name).__name__}")
    for family in families:
        spec = family.match(name)
        if spec is not None:
            return spec
    new = current_name(name)
    if new != name:
        raise ValueError(f"{what} {name!r} is spelt {new!r} now (each letter of a name has one meaning: "
                         f"python -m specviz.bench --list-methods)")
    valid = "; ".join(f.usage for f in families)
    plural = "strategies" if what == "strategy" else f"{what}s"
    raise ValueError(f"unknown {what} {name!r}; valid {plural}: {valid}")


def parse_strategy(name: str) -> MethodSpec:
    """Parse the name of a drafting strategy of :data:`STRATEGIES`."""
    return parse_name(name, STRATEGIES, "strategy")


def build_drafter(spec: MethodSpec | str, pair) -> Drafter:
    """The drafter of a strategy for a :class:`~specviz.models.ModelPair`.

    Args:
        spec: a parsed strategy, or its name.
        pair: the target and draft models.

    Raises:
        ValueError: an unknown name, a method that is not a strategy, or parameters
            invalid for the models (e.g. more self-speculative layers than the target has).
        FileNotFoundError: a ``medusa`` / ``eagle`` strategy for a target without trained
            heads in the specviz cache (the message gives the command that trains them).
    """
    if isinstance(spec, str):
        spec = parse_strategy(spec)
    if not spec.is_strategy:
        raise ValueError(f"method {spec.name!r} is not a specviz strategy")
    return spec.definition.build(pair, spec.arguments())

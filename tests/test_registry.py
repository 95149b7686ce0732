"""The strategy registry (specviz.draft.registry): every name builds its drafter on the tiny
pair, parameters fall back to their defaults, and bad names or values are named in the error."""

import re

import pandas as pd
import pytest

from specviz.draft import (
    AdaptiveChainDrafter,
    ChainDrafter,
    ChooserDrafter,
    Drafter,
    DynamicTreeDrafter,
    FallbackDrafter,
    AdaptiveNgramDrafter,
    MergedDrafter,
    NgramDrafter,
    NgramTrieDrafter,
    SelfSpeculativeDrafter,
    SwitchDrafter,
    TreeDrafter,
)
from specviz.draft.lookahead import JacobiDrafter, LookaheadDrafter
from specviz.draft.suffix import SuffixDrafter
from specviz.tree.budgets import budgeted_kary
from specviz.draft.registry import (
    STRATEGIES,
    build_drafter,
    parse_strategy,
)

# one name per family, with and without parameters, and the drafter each must build
NAMES = {
    "chain-k3": (ChainDrafter, "chain(k=3)"),
    "tree-2x1": (TreeDrafter, "tree(n=4,d=2)"),
    "tree-w2-d3-b5": (TreeDrafter, "tree(n=5,d=2)"),
    "dynamic": (DynamicTreeDrafter, "dynamic(k=4,d=5,n=16)"),
    "dynamic-w2-d3-b5": (DynamicTreeDrafter, "dynamic(k=2,d=3,n=5)"),
    "adaptive": (AdaptiveChainDrafter, "adaptive-throughput"),
    "adaptive-heuristic": (AdaptiveChainDrafter, "adaptive-heuristic"),
    "ngram": (NgramDrafter, "ngram(n=3,k=5)"),
    "ngram-n2-k4": (NgramDrafter, "ngram(n=2,k=4)"),
    "ngram-adaptive": (AdaptiveNgramDrafter, "ngram-adaptive(n=3,k<=8)"),
    "ngram-adaptive-n2-k4-min2": (AdaptiveNgramDrafter, "ngram-adaptive(n=2,k<=4),min=2"),
    "ngram-trie": (NgramTrieDrafter, "ngram-trie(n=3,budget=16)"),
    "ngram-trie-n2-d3-b6-m2": (NgramTrieDrafter, "ngram-trie(n=2,budget=6)"),
    "merged": (MergedDrafter, "merged(chain(k=4)+ngram(n=3,k=5))"),
    "merged-chain-k2+ngram-n2-k4+ngram-trie": (MergedDrafter,
                                               "merged(chain(k=2)+ngram(n=2,k=4)+ngram-trie(n=3,budget=16))"),
    "merged-self-spec-L1-k2+ngram": (MergedDrafter, None),
    "self-spec-L1-k2": (SelfSpeculativeDrafter, None),
    "fallback": (FallbackDrafter, "fallback(ngram(n=3,k=4,min=2)>chain(k=2))"),
    "fallback-ngram-n2-k3+tree-2x1": (FallbackDrafter, "fallback(ngram(n=2,k=3)>tree(n=4,d=2))"),
    "switch": (SwitchDrafter, "switch(ngram-adaptive(n=3,k<=8)|chain(k=2))"),
    "switch-ngram-adaptive-n2-k4+chain-k3": (SwitchDrafter, "switch(ngram-adaptive(n=2,k<=4)|chain(k=3))"),
    "choose": (ChooserDrafter, "choose(ngram(n=3,k=4)|suffix(n=8,depth=8,budget=16)|chain(k=2))"),
    "choose-ngram-n2-k3+chain-k3": (ChooserDrafter, "choose(ngram(n=2,k=3)|chain(k=3))"),
    "suffix": (SuffixDrafter, "suffix(n=8,depth=8,budget=16)"),
    "suffix-n4-d3-b6": (SuffixDrafter, "suffix(n=4,depth=3,budget=6)"),
    "jacobi": (JacobiDrafter, "jacobi(k=5)"),
    "lookahead-w3-n2-g4-context": (LookaheadDrafter, "lookahead(w=3,n=2,g=4,context)"),
}


#: families whose drafters need heads trained for the target; tests/test_heads.py builds them
HEAD_FAMILIES = {"medusa", "eagle", "eagle-chain"}


def test_every_name_builds_its_drafter(tiny_pair):
    assert {parse_strategy(n).family for n in NAMES} | HEAD_FAMILIES == {s.name for s in STRATEGIES}
    for name, (kind, drafter_name) in NAMES.items():
        drafter = build_drafter(name, tiny_pair)
        assert isinstance(drafter, kind) and isinstance(drafter, Drafter), name
        if drafter_name is not None:
            assert drafter.name == drafter_name
    assert build_drafter(parse_strategy("ngram-trie-m2"), tiny_pair).max_matches == 2
    self_spec = build_drafter("self-spec", tiny_pair)  # default: half the target's layers, a chain of 4
    assert self_spec.n_layers == tiny_pair.target.model.config.num_hidden_layers // 2
    assert self_spec.shape.budget == 4


def test_parsed_parameters_and_defaults():
    spec = parse_strategy("dynamic-w2-d3-b6")
    assert spec.params == (("topk", 2), ("depth", 3), ("budget", 6))
    assert parse_strategy("dynamic").params == ()
    assert parse_strategy("dynamic").arguments() == {"topk": 4, "depth": 5, "budget": 16, "vocab": None}
    assert parse_strategy("dynamic-w2-d3-b6-v512").params == (("topk", 2), ("depth", 3), ("budget", 6), ("vocab", 512))
    assert parse_strategy("tree-2x2x1").params == (("branching", (2, 2, 1)),)
    assert parse_strategy("adaptive-heuristic").param("schedule") == "heuristic"
    assert parse_strategy("self-spec").arguments() == {"n_layers": None, "k": 4}
    assert parse_strategy("medusa").arguments() == {"branching": (3, 2, 1, 1), "width": None, "depth": None,
                                                    "budget": None, "tree_budget": None}
    assert parse_strategy("medusa-w2-d3-b6").params == (("width", 2), ("depth", 3), ("budget", 6))
    assert parse_strategy("medusa-b6").params == (("tree_budget", 6),)
    assert parse_strategy("eagle").arguments() == {"topk": 4, "depth": 5, "budget": 16}
    assert parse_strategy("eagle-chain-k3").family == "eagle-chain"
    assert parse_strategy("eagle-chain").arguments() == {"k": 4}


def test_head_strategies_without_trained_heads_name_the_training_command(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    for name, kind in (("medusa", "medusa"), ("eagle-w2-d3-b5", "eagle"), ("eagle-chain", "eagle")):
        with pytest.raises(FileNotFoundError, match=rf"no trained {kind} heads for target 'tiny-qwen2-seed0'.*"
                                                    rf"python -m specviz.heads train --kind {kind} --tiny"):
            build_drafter(name, tiny_pair)


def test_verifier_under_sampling():
    assert parse_strategy("chain-k4").verifier(0.7) == "chain"
    assert parse_strategy("self-spec").verifier(0.7) == "chain"
    assert parse_strategy("adaptive").verifier(0.7) == "chain"
    for name in ("tree-2x1", "dynamic", "ngram", "ngram-trie", "merged", "fallback", "medusa", "eagle", "eagle-chain"):
        assert parse_strategy(name).verifier(0.7) == "topk"
        assert parse_strategy(name).verifier(0.0) == "greedy"
    assert parse_strategy("dynamic").verifier(0.7, "typical") == "typical"


def test_bad_names_and_values_are_named(tiny_pair):
    with pytest.raises(ValueError, match=r"unknown strategy 'hydra'; valid strategies: chain-k<K>"):
        parse_strategy("hydra")
    with pytest.raises(ValueError, match="unknown strategy 'plain'"):
        build_drafter("plain", tiny_pair)
    with pytest.raises(ValueError, match=r"method 'chain-k0': k must be >= 1, got 0"):
        parse_strategy("chain-k0")
    with pytest.raises(ValueError, match=r"method 'tree-2x0': branching must be >= 1, got 2x0"):
        parse_strategy("tree-2x0")
    with pytest.raises(TypeError, match="a strategy name must be a str, got int"):
        parse_strategy(4)
    layers = tiny_pair.target.model.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"n_layers must be an int in \[1, {layers - 1}\].*got 99"):
        build_drafter("self-spec-L99", tiny_pair)
    with pytest.raises(ValueError, match=r"merged strategy part 'beam': unknown strategy 'beam'"):
        build_drafter("merged-chain-k2+beam", tiny_pair)
    with pytest.raises(ValueError, match=r"part 'merged': merged trees do not nest"):
        build_drafter("merged-ngram+merged", tiny_pair)
    with pytest.raises(ValueError, match="unknown strategy 'merged-ngram'"):  # one part is not a merge
        parse_strategy("merged-ngram")


def test_budgeted_kary():
    shape = budgeted_kary(2, 3, 5)
    assert shape.parents == (-1, 0, 0, 1, 1, 2)
    assert shape.ranks == (0, 0, 1, 0, 1, 0)
    assert budgeted_kary(3, 2, 100).budget == 12
    assert budgeted_kary(1, 4, 100).parents == (-1, 0, 1, 2, 3)
    with pytest.raises(ValueError, match="width must be an int >= 1, got 0"):
        budgeted_kary(0, 2, 3)


def test_each_letter_means_one_thing_in_every_family():
    """Every single-letter parameter of every usage is in the letters table, and a letter
    names the same parameter wherever it appears (k: a chain's tokens, w: a tree's width,
    b: the budget, n: an n-gram order, ...)."""
    from specviz.draft.registry import NAME_LETTERS

    documented = {key.split("<")[0] for key, _ in NAME_LETTERS if key[0].isalpha()}
    meaning = {"k": {"k"}, "w": {"width", "topk", "window"}, "d": {"depth"}, "b": {"budget", "tree_budget"},
               "n": {"n", "ngram"}, "g": {"guesses"}, "m": {"max_matches"}, "min": {"min_n"}, "v": {"vocab"},
               "L": {"n_layers"}}
    assert documented == set(meaning)
    for family in STRATEGIES:
        letters = re.findall(r"[-|]([A-Za-z]+)\(\\d\+\)", family.pattern)
        ints = [p for p in family.params if p.kind == "int"]
        assert len(letters) == len(ints), family.name
        for letter, param in zip(letters, ints):
            assert param.name in meaning[letter], (family.name, letter, param.name)


def test_old_spellings_are_refused_with_the_current_name_and_read_from_stored_results():
    from specviz.draft.registry import current_name, rename_methods

    with pytest.raises(ValueError, match="'dynamic-k4-d5-n16' is spelt 'dynamic-w4-d5-b16' now"):
        parse_strategy("dynamic-k4-d5-n16")
    assert current_name("merged-b16-ngram-n3-k6+eagle-k8-d3-n16") == "merged-b16-ngram-n3-k6+eagle-w8-d3-b16"
    assert current_name("medusa-n16") == "medusa-b16" and current_name("cascade") == "fallback"
    for name in ("ngram-n3-k5", "ngram-trie-n3-d5-b16-m8", "lookahead-w5-n4-g5", "chain-k4", "plain"):
        assert current_name(name) == name  # current names stay
    rows = pd.DataFrame({"method": ["plain", "tree-k2-d3-n8", "tree-k2-d3-n8"], "strategy": ["static shape", "a", None]})
    assert rename_methods(rows) == {"tree-k2-d3-n8": "tree-w2-d3-b8", "static shape": "tree"}
    assert list(rows["method"]) == ["plain", "tree-w2-d3-b8", "tree-w2-d3-b8"] and rows["strategy"][0] == "tree"
    assert rename_methods(rows) == {}  # read once: nothing old is left
    parse_strategy("tree-w2-d3-b8")


def test_list_methods_prints_the_letters(capsys):
    from specviz.bench.__main__ import main

    assert main(["--list-methods"]) == 0
    out = capsys.readouterr().out
    assert "dynamic[-w<W>-d<D>-b<B>][-v<V>]" in out and "each letter of a name, in every family:" in out
    assert "b<B>  " in out and "budget" in out

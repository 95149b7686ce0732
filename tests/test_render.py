"""Renderers: node statuses and attributes, figure contents, whitespace escaping, quotes and
markup in plotly text, large trees, container-wide figures, colours, log ticks, files."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from specviz.models.tiny import tiny_tokenizer
from specviz.render import (
    COLLAPSE_ABOVE,
    FAMILY_COLORS,
    STATUS_STYLE,
    STATUSES,
    collapse_untried,
    committed_tokens,
    escape_token,
    log_ticks,
    lookahead_mask_figure,
    lookahead_step_figure,
    mask_figure,
    plot_text,
    representative_step,
    save_html,
    save_png,
    step_tree_figure,
    step_view_figure,
    strategy_color,
    strategy_colors,
    strategy_family,
    tidy_log_axes,
    to_networkx,
    tree_figure,
    tree_nodes,
)
from specviz.render.__main__ import main
from specviz.sampling import SamplingConfig, make_generator
from specviz.tree.shapes import expansion
from specviz.tree.core import DraftTree
from specviz.verify.rules import Acceptance, get_verifier

VOCAB = 16


@pytest.fixture(autouse=True)
def one_thread():
    # tiny forward passes are ~100x slower with an oversubscribed thread pool on a busy 2-core box
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _tree() -> DraftTree:
    # root; 3 children; two grandchildren under node 1 and one under node 2
    parents = [-1, 0, 0, 0, 1, 1, 2]
    tokens = [1, 2, 3, 4, 5, 6, 7]
    return DraftTree.from_lists(tokens, parents, q=[1.0, 0.5, 0.3, 0.2, 0.6, 0.4, 0.9],
                                ranks=[0, 0, 1, 2, 0, 1, 0])


def _acceptance(tree: DraftTree) -> Acceptance:
    """Greedy verification: the target's argmax after the root is token 3 (node 2), after
    node 2 it is token 9 (no child has it). Children are tried in order until one
    matches, so node 1 is rejected, node 2 accepted, node 3 (a child of the reached root)
    not chosen, node 2's child rejected and node 1's children never reached."""
    logits = torch.zeros(tree.n_nodes, VOCAB)
    logits[0, 3] = 5.0
    logits[2, 9] = 5.0
    return get_verifier("greedy")(tree, logits, SamplingConfig(), make_generator(0))


def test_escape_token_makes_whitespace_visible():
    assert escape_token(" def") == "␣def"
    assert escape_token("a\nb\tc\r") == "a\\nb\\tc\\r"
    assert escape_token("") == "∅"
    assert escape_token("\x00") == "\\x00"
    assert escape_token("x" * 20, max_chars=6) == "xxxxx…"
    assert escape_token("x" * 20, max_chars=None) == "x" * 20
    with pytest.raises(TypeError):
        escape_token(3)
    with pytest.raises(ValueError, match="max_chars"):
        escape_token("abc", max_chars=1)


def test_tree_nodes_statuses_and_bonus():
    tree = _tree()
    acc = _acceptance(tree)
    assert acc.accepted_nodes == (2,) and acc.bonus_token == 9
    nodes = tree_nodes(tree, acc, target_probs=torch.linspace(0.1, 0.7, 7))
    assert [v.status for v in nodes] == ["root", "rejected", "accepted", "not chosen",
                                         "never reached", "never reached", "rejected", "bonus"]
    bonus = nodes[-1]
    assert (bonus.index, bonus.parent, bonus.token, bonus.depth) == (7, 2, 9, 2)
    assert nodes[2].q == pytest.approx(0.3) and nodes[2].rank == 1
    assert nodes[2].p == pytest.approx(0.3)
    assert nodes[2].accept_prob == 1.0 and nodes[1].accept_prob == 0.0
    assert nodes[3].accept_prob is None  # never tried
    assert nodes[0].q is None and nodes[0].p is None
    drafted = tree_nodes(tree)
    assert [v.status for v in drafted] == ["root"] + ["drafted"] * 6


def test_not_chosen_only_under_reached_nodes():
    """Untried children of the root or of an accepted node are "not chosen" - including
    the children of the last accepted node; anything below a rejected or untried node
    is "never reached"."""
    tree = DraftTree.from_lists([1, 2, 3, 4, 5, 6, 7, 8], [-1, 0, 0, 1, 1, 3, 2, 6])
    acc = Acceptance(accepted_nodes=(1,), accepted_tokens=(2,), bonus_token=9,
                     node_accept_prob=torch.tensor([1.0, 1.0] + [float("nan")] * 6),
                     tried=torch.tensor([True, True] + [False] * 6), rule="stub", lossless=True)
    status = {v.index: v.status for v in tree_nodes(tree, acc)}
    assert status == {0: "root", 1: "accepted", 2: "not chosen", 3: "not chosen", 4: "not chosen",
                      5: "never reached", 6: "never reached", 7: "never reached", 8: "bonus"}
    assert "not chosen" in STATUSES and STATUS_STYLE["not chosen"] != STATUS_STYLE["never reached"]
    fig = tree_figure(tree, acc, collapse=False)
    assert {t.name for t in _marker_traces(fig).values()} == {"root", "accepted", "bonus", "not chosen",
                                                              "never reached"}


def test_tree_nodes_rejects_mismatches():
    tree = _tree()
    small = DraftTree.from_lists([1, 2], [-1, 0])
    acc = get_verifier("greedy")(small, torch.zeros(2, VOCAB), SamplingConfig(), make_generator(0))
    with pytest.raises(ValueError, match="2 nodes"):
        tree_nodes(tree, acc)
    with pytest.raises(ValueError, match="one value per node"):
        tree_nodes(tree, target_probs=[0.5])
    with pytest.raises(TypeError, match="DraftTree"):
        tree_nodes([-1, 0])


def test_to_networkx_attributes(tokenizer):
    tree = _tree()
    acc = _acceptance(tree)
    g = to_networkx(tree, acc, tokenizer=tokenizer, target_probs=torch.full((7,), 0.25))
    assert g.number_of_nodes() == 8 and g.number_of_edges() == 7
    for key in ("token", "text", "label", "depth", "rank", "q", "p", "accept_prob", "status"):
        assert key in g.nodes[3]
    assert g.nodes[2]["status"] == "accepted" and g.nodes[2]["depth"] == 1
    assert g.nodes[2]["text"] == tokenizer.decode([3])
    assert g.nodes[2]["p"] == pytest.approx(0.25) and g.nodes[2]["q"] == pytest.approx(0.3)
    assert g.nodes[2]["accept_prob"] == pytest.approx(1.0) and g.nodes[2]["rank"] == 1
    assert g.nodes[7]["status"] == "bonus" and list(g.predecessors(7)) == [2]
    assert sorted(e for e in g.edges if g.edges[e]["accepted_path"]) == [(0, 2), (2, 7)]


def _marker_traces(fig):
    return {t.name: t for t in fig.data if t.mode and "markers" in t.mode}


def test_tree_figure_markers_and_legend():
    tree = _tree()
    fig = tree_figure(tree, _acceptance(tree))
    traces = _marker_traces(fig)
    assert set(traces) <= set(STATUSES)
    counts = {name: len(t.x) for name, t in traces.items()}
    assert counts == {"root": 1, "accepted": 1, "bonus": 1, "rejected": 2, "not chosen": 1, "never reached": 2}
    assert sum(counts.values()) == tree.n_nodes + 1
    assert all(t.showlegend is not False for t in traces.values())
    path = [t for t in fig.data if t.name == "accepted path"]
    assert len(path) == 1 and path[0].line.width > 3
    # hover carries rank, q, p, acceptance probability and depth
    hover = traces["rejected"].hovertext[0]
    for word in ("rank", "q (draft prob)", "p (target prob)", "acceptance prob", "depth"):
        assert word in hover
    # without an acceptance: root + drafted only
    assert set(_marker_traces(tree_figure(tree))) == {"root", "drafted"}


def test_tree_figure_escapes_whitespace_and_html(tokenizer):
    ids = [tokenizer.encode(s)[0] for s in ("a", " ", "\n", "<")]
    tree = DraftTree.from_lists(ids, [-1, 0, 1, 2])
    texts = [s for t in _marker_traces(tree_figure(tree, tokenizer=tokenizer)).values() for s in t.text]
    assert "␣" in texts and "\\n" in texts and "&lt;" in texts
    assert not any(s.isspace() for s in texts)


def test_quotes_reach_plotly_as_quotes(tokenizer):
    """plotly draws ``&quot;`` and ``&#x27;`` literally: labels, hovers, titles and step
    texts keep quotes as characters and escape only ``&``, ``<`` and ``>``."""
    ids = [tokenizer.encode(s)[0] for s in ("a", '"', "'", "<")]
    tree = DraftTree.from_lists(ids, [-1, 0, 1, 2])
    fig = tree_figure(tree, tokenizer=tokenizer, title='a "quoted" title')
    texts = [s for t in _marker_traces(fig).values() for s in t.text]
    hovers = [h for t in fig.data if t.hovertext for h in t.hovertext]
    mask = mask_figure(tree, tokenizer=tokenizer)
    drawn = " ".join(texts + hovers + list(mask.data[0].y) + [fig.layout.title.text])
    assert '"' in texts and "'" in texts and "&lt;" in texts
    assert "&quot;" not in drawn and "&#x27;" not in drawn and '"quoted"' in drawn


def _figure_strings(fig) -> list[str]:
    """Every string of the figure's JSON (text, hovers, titles, ticks, names)."""
    out: list[str] = []

    def walk(value):
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(json.loads(fig.to_json()))
    return out


class _QuoteTokenizer:
    """Decodes every token to the same text with quotes and markup."""

    def __init__(self, text: str = 'say "hi" <b>') -> None:
        self.text = text

    def decode(self, ids):
        return self.text


def _assert_quotes_kept(fig) -> None:
    strings = _figure_strings(fig)
    joined = "\n".join(strings)
    assert "&quot;" not in joined and "&#x27;" not in joined and "&#34;" not in joined
    assert not re.search(r'"[␣ ]<b>', joined), "the token's tag reached plotly as markup"
    assert any('"hi"' in s and "&lt;b" in s for s in strings), "the token's quotes should arrive as quotes"


def test_plot_text_escapes_markup_and_keeps_quotes():
    assert plot_text('say "hi" <b> & \'co\'') == 'say "hi" &lt;b&gt; &amp; \'co\''
    with pytest.raises(TypeError, match="str"):
        plot_text(3)


def test_token_with_quotes_and_tags_reaches_every_figure_as_text(generation):
    """A token ``say "hi" <b>`` keeps its quotes and shows its tag as text in tree labels
    and hovers, titles, mask ticks and the step view."""
    tok = _QuoteTokenizer()
    tree = _tree()
    _assert_quotes_kept(tree_figure(tree, _acceptance(tree), tokenizer=tok, title=tok.text))
    _assert_quotes_kept(mask_figure(tree, tokenizer=tok))
    _assert_quotes_kept(step_tree_figure(generation.steps[0], tokenizer=tok))
    fig = step_view_figure(generation, tokenizer=tok)
    _assert_quotes_kept(fig)
    drawn = [s for t in fig.data if t.type == "scatter" and t.mode == "text" for s in t.text]
    assert drawn and all(s == 'say␣"hi"␣&lt;b&gt;' for s in drawn)


@pytest.fixture(scope="module")
def lookahead_generation(tiny_pair):
    from specviz.decode.engine import speculative_generate
    from specviz.draft.registry import build_drafter

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return speculative_generate(tiny_pair.target, build_drafter("lookahead-w3-n3-g3", tiny_pair),
                                    "a b a b a b a b", max_new_tokens=8)
    finally:
        torch.set_num_threads(before)


def test_lookahead_figures_keep_quotes_and_fill_width(lookahead_generation):
    tok = _QuoteTokenizer('"hi" <b>')  # short enough for lookahead's 10-character labels
    step = lookahead_generation.steps[-1]
    for fig in (lookahead_step_figure(step, tokenizer=tok), lookahead_mask_figure(step, tokenizer=tok)):
        _assert_quotes_kept(fig)
        assert fig.layout.width is None and fig.layout.autosize is True
        _assert_plotly_colors(fig)


def _greedy_logits(tree: DraftTree, choose: dict[int, int], vocab: int) -> torch.Tensor:
    """Logits whose argmax at node ``p`` is ``choose[p]`` (a token), else an unused token."""
    logits = torch.zeros(tree.n_nodes, vocab)
    logits[:, vocab - 1] = 1.0
    for node, token in choose.items():
        logits[node] = 0.0
        logits[node, token] = 5.0
    return logits


def _big_verified_tree():
    """A 128-draft-node 4-ary tree cut breadth first, tokens = node indices. Greedy: the
    root's 2nd child (node 2) and then its 1st child are accepted; nothing below matches."""
    from specviz.tree.budgets import budgeted_kary

    parents = list(budgeted_kary(4, 4, 128).parents)
    tree = DraftTree.from_lists(list(range(len(parents))), parents)
    kids = [[c for c in range(len(parents)) if parents[c] == p] for p in range(len(parents))]
    second = kids[0][1]
    logits = _greedy_logits(tree, {0: second, second: kids[second][0]}, 256)
    acc = get_verifier("greedy")(tree, logits, SamplingConfig(), make_generator(0))
    assert acc.accepted_nodes == (second, kids[second][0])
    return tree, acc


def _all_marker_xy(fig):
    return [(x, y) for t in _marker_traces(fig).values() for x, y in zip(t.x, t.y)]


def test_large_tree_collapses_untried_subtrees():
    tree, acc = _big_verified_tree()
    assert tree.n_nodes - 1 > COLLAPSE_ABOVE
    nodes = tree_nodes(tree, acc)
    fig = tree_figure(tree, acc)  # default: collapsed, the tree is large
    traces = _marker_traces(fig)
    shown = {i for name, t in traces.items() if name in STATUSES for i in t.customdata}
    tried = {i for i, t in enumerate(acc.tried.tolist()) if t}
    assert tried | {tree.n_nodes} <= shown  # every tried node, the accepted path and the bonus
    groups = traces["+N untried nodes (collapsed)"]
    hidden = sum(int(t[1:]) for t in groups.text)
    untried = sum(v.status in ("not chosen", "never reached") for v in nodes)
    assert hidden + len(shown - tried - {tree.n_nodes}) == untried
    assert len(shown) + len(groups.x) < 30  # readable instead of 129 markers
    assert all("untried nodes" in h and "never reached" in h for h in groups.hovertext)
    assert "untried nodes shown as" in fig.layout.title.subtitle.text
    # off: every node, and a small tree is not collapsed by default
    full = tree_figure(tree, acc, collapse=False)
    assert sum(len(t.x) for t in _marker_traces(full).values()) == tree.n_nodes + 1
    small = _tree()
    assert "+N untried nodes (collapsed)" not in _marker_traces(tree_figure(small, _acceptance(small)))
    assert "+N untried nodes (collapsed)" in _marker_traces(tree_figure(small, _acceptance(small), collapse=True))
    with pytest.raises(ValueError, match="collapse=True needs an acceptance"):
        tree_figure(small, collapse=True)


def test_collapse_untried_groups_per_tried_node():
    tree = _tree()
    nodes = tree_nodes(tree, _acceptance(tree))
    kept, groups = collapse_untried(nodes, min_size=1)
    assert [(g.parent, g.members, g.not_chosen) for g in groups] == [(0, (3,), 1), (1, (4, 5), 0)]
    assert [v.index for v in kept] == [0, 1, 2, 6, 7]
    kept, groups = collapse_untried(nodes)  # a single untried leaf is not worth a "+1"
    assert [(g.parent, g.size) for g in groups] == [(1, 2)] and len(kept) == 6
    with pytest.raises(ValueError, match="no acceptance"):
        collapse_untried(tree_nodes(tree))
    with pytest.raises(ValueError, match="min_size"):
        collapse_untried(nodes, min_size=0)


@pytest.mark.parametrize("n", [1, 2, 40, 128])
def test_tree_figure_fills_its_container(n):
    parents = [-1] + [max(0, i - 1 - (i % 3)) for i in range(1, n)]
    fig = tree_figure(DraftTree.from_lists(list(range(n)), parents))
    assert sum(len(t.x) for t in _marker_traces(fig).values()) == n
    # no fixed pixel width: the figure takes the notebook cell's or the page's width
    assert fig.layout.width is None and fig.layout.autosize is True and fig.layout.height >= 300
    lo, hi = fig.layout.xaxis.range
    assert all(lo < x < hi for x, _ in _all_marker_xy(fig))


def test_wide_rows_shrink_markers_and_labels():
    tree = DraftTree.from_lists(list(range(69)), [-1] + [0] * 4 + [1 + (i // 16) for i in range(64)])
    roomy = _marker_traces(tree_figure(_tree(), _acceptance(_tree())))
    crowded = _marker_traces(tree_figure(tree))
    assert roomy["accepted"].textposition == "middle right"
    assert crowded["drafted"].marker.size < STATUS_STYLE["drafted"].size
    assert crowded["drafted"].textposition == "bottom center" or not any(crowded["drafted"].text)
    assert crowded["drafted"].textfont.size <= roomy["accepted"].textfont.size
    # labels right of a node need room up to the axis' right end
    fig = tree_figure(_tree(), _acceptance(_tree()))
    assert fig.layout.xaxis.range[1] >= max(x for x, _ in _all_marker_xy(fig)) + 1.0


def test_renderers_set_no_pixel_width(generation, tokenizer):
    tree = _tree()
    for fig in (tree_figure(tree, _acceptance(tree)), mask_figure(tree),
                step_tree_figure(generation.steps[0], tokenizer=tokenizer),
                step_view_figure(generation, tokenizer=tokenizer, highlight_step=0)):
        assert fig.layout.width is None and fig.layout.autosize is True
        assert fig.layout.height and fig.layout.height >= 300


_HEX = re.compile(r"^#[0-9A-Fa-f]{6}$")
_RGBA = re.compile(r"^rgba\((\d{1,3}),\s*(\d{1,3}),\s*(\d{1,3}),\s*(0|1|0?\.\d+|1\.0+)\)$")


def _assert_plotly_colors(fig) -> None:
    """Every colour is ``#RRGGBB`` or a valid ``rgba()``, and no hatched bar has one colour
    per bar (plotly.js warns "Invalid color specifier" for those)."""
    def check(value, where):
        if isinstance(value, list):
            for v in value:
                check(v, where)
            return
        assert isinstance(value, str), f"{where}: colour {value!r} is not a string"
        m = _RGBA.match(value)
        assert _HEX.match(value) or (m and all(int(c) <= 255 for c in m.groups()[:3])), \
            f"{where}: {value!r} is not a colour plotly.js reads"

    def walk(value, path):
        if isinstance(value, dict):
            for k, v in value.items():
                if k == "template":  # plotly's own theme
                    continue
                if k.endswith("color") and v is not None:
                    check(v, f"{path}.{k}")
                elif k == "colorscale" and isinstance(v, list):
                    for _, c in v:
                        check(c, f"{path}.colorscale")
                else:
                    walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    spec = json.loads(fig.to_json())
    walk(spec, "figure")
    for trace in spec["data"]:
        pattern = trace.get("marker", {}).get("pattern", {})
        if pattern.get("shape"):
            assert isinstance(trace["marker"].get("color"), str), \
                f"trace {trace.get('name')!r}: a pattern with per-bar colours makes plotly.js warn"


def test_figures_use_only_colours_plotly_reads(generation, tokenizer):
    tree = _tree()
    big, acc = _big_verified_tree()
    for fig in (tree_figure(tree, _acceptance(tree)), tree_figure(big, acc), tree_figure(tree), mask_figure(tree),
                step_view_figure(generation, tokenizer=tokenizer, highlight_step=1)):
        _assert_plotly_colors(fig)


NOTEBOOK_STRATEGIES = ["chain", "2-ary", "4-ary", "expansion-3-2-1", "sequoia", "dynamic (EAGLE-2)",
                       "n-gram chain", "n-gram trie"]


def test_strategy_colors_follow_the_family():
    same = [("chain", "chain-k4"), ("2-ary", "tree-w2-d3-b8"), ("4-ary", "tree-w4-d3-b16"),
            ("expansion-3-2-1", "tree-2x2x1"), ("dynamic (EAGLE-2)", "dynamic-w4-d5-b16"),
            ("n-gram chain", "ngram"), ("n-gram trie", "ngram-trie-n3-d5-b16-m8"), ("lookahead", "lookahead-w5-n4-g5"),
            ("jacobi", "jacobi-k5"), ("adaptive", "adaptive-heuristic"), ("self-spec", "self-spec-L12-k4"),
            ("plain", "plain-bf16"), ("llama-plain", "llama-spec-k3"), ("sequoia", "Sequoia")]
    for a, b in same:
        assert strategy_color(a) == strategy_color(b), (a, b)
    families = [strategy_family(n) for n in NOTEBOOK_STRATEGIES + ["hf-assisted", "hf-prompt-lookup", "merged"]]
    assert families == ["chain", "2-ary", "4-ary", "expansion", "sequoia", "dynamic", "n-gram chain",
                        "n-gram trie", "hf-assisted", "hf-prompt-lookup", "merged"]
    assert strategy_family("ngram-trie") == "n-gram trie" and strategy_family("ngram") == "n-gram chain"
    assert all(re.fullmatch(r"#[0-9A-F]{6}", c) for c in FAMILY_COLORS.values())
    assert len(set(FAMILY_COLORS.values())) == len(FAMILY_COLORS)
    # the notebooks' eight strategies are eight different colours
    assert len(set(strategy_colors(NOTEBOOK_STRATEGIES).values())) == 8


def test_unknown_strategies_get_a_stable_hashed_color():
    assert strategy_family("my-drafter") is None
    # derived from sha256 of the name, not Python's per-process hash(): the same everywhere
    assert strategy_color("my-drafter") == strategy_color("My-Drafter ") == "#60B526"
    assert strategy_color("my-drafter") != strategy_color("your-drafter")
    with pytest.raises(TypeError, match="str"):
        strategy_color(4)
    with pytest.raises(ValueError, match="empty"):
        strategy_color("  ")
    with pytest.raises(TypeError, match="one str"):
        strategy_colors("chain")


def test_strategy_colors_separate_members_of_one_family():
    names = ["chain-k4", "chain-k2", "chain-k10", "dynamic"]
    colors = strategy_colors(names)
    assert colors == strategy_colors(reversed(names))  # independent of order
    assert colors["chain-k2"] == strategy_color("chain") and len(set(colors.values())) == 4
    many = strategy_colors([f"chain-k{k}" for k in range(1, 20)])
    assert len(set(many.values())) == 19 and all(re.fullmatch(r"#[0-9A-F]{6}", c) for c in many.values())


def test_strategy_colors_work_as_color_discrete_map():
    import pandas as pd
    import plotly.express as px

    table = pd.DataFrame({"budget": [4, 8] * 8, "tau": list(range(16)),
                          "strategy": [n for n in NOTEBOOK_STRATEGIES for _ in (0, 1)]})
    fig = px.line(table, x="budget", y="tau", color="strategy",
                  color_discrete_map=strategy_colors(NOTEBOOK_STRATEGIES))
    assert {t.name: t.line.color for t in fig.data} == {n: strategy_color(n) for n in NOTEBOOK_STRATEGIES}


def test_log_ticks_are_round_numbers():
    assert log_ticks(4, 64) == ([4.0, 8.0, 16.0, 32.0, 64.0], ["4", "8", "16", "32", "64"])
    vals, text = log_ticks(1, 4096)
    assert vals == [1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0] and text[-1] == "4,096"
    assert log_ticks(1, 1e6)[1] == ["1", "10", "100", "1,000", "10,000", "100,000", "1,000,000"]
    assert log_ticks(0.03, 0.6)[1] == ["0.05", "0.1", "0.2", "0.5"]
    assert log_ticks(1.2, 3.2)[1] == ["1.5", "2", "2.5", "3"]  # too narrow for powers
    for lo, hi in ((4, 64), (1, 4096), (0.03, 0.6), (7, 900), (0.001, 2)):
        vals, text = log_ticks(lo, hi, max_ticks=5)
        assert 2 <= len(vals) <= 5 and all(lo <= v <= hi for v in vals)
        assert all(re.fullmatch(r"[\d,]+(\.\d+)?", t) for t in text)
    with pytest.raises(ValueError, match="lo"):
        log_ticks(0, 10)
    with pytest.raises(ValueError, match="lo must be <= hi"):
        log_ticks(10, 1)
    with pytest.raises(ValueError, match="max_ticks"):
        log_ticks(1, 10, max_ticks=1)


def test_tidy_log_axes_sets_ticks_on_every_facet():
    import pandas as pd
    import plotly.express as px

    table = pd.DataFrame({"budget": [4, 8, 16, 32, 64] * 2, "tau": [1.5, 2, 2.5, 3, 3.2, 1.2, 1.4, 1.6, 1.7, 1.8],
                          "pair": ["a"] * 5 + ["b"] * 5})
    fig = px.line(table, x="budget", y="tau", facet_col="pair", log_x=True)
    assert fig.layout.xaxis.tickvals is None
    assert tidy_log_axes(fig) is fig
    for axis in (fig.layout.xaxis, fig.layout.xaxis2):
        assert list(axis.tickvals) == [4, 8, 16, 32, 64] and list(axis.ticktext) == ["4", "8", "16", "32", "64"]
    assert fig.layout.yaxis.tickvals is None  # linear axes are left alone


def test_tree_figure_draws_shapes():
    fig = tree_figure(expansion([2, 2]))
    texts = [s for t in _marker_traces(fig).values() for s in t.text]
    assert sorted(texts) == sorted(["root"] + ["top-1", "top-2"] * 3)


def test_mask_figure_labels(tokenizer):
    ids = [tokenizer.encode(s)[0] for s in ("a", " ", "b")]
    tree = DraftTree.from_lists(ids, [-1, 0, 0])
    fig = mask_figure(tree, tokenizer=tokenizer, prefix_len=2)
    hm = fig.data[0]
    assert list(hm.y) == ["0:a", "1:␣", "2:b"]
    assert list(hm.x) == ["ctx-2", "ctx-1", "0:a", "1:␣", "2:b"]
    assert [list(r) for r in hm.z] == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    with pytest.raises(TypeError):
        mask_figure([-1, 0])


def test_save_html_is_offline(tmp_path):
    tree = _tree()
    path = save_html(tree_figure(tree, _acceptance(tree)), tmp_path / "tree.html")
    text = path.read_text(encoding="utf-8")
    # plotly.js is embedded, nothing is loaded from a URL
    assert len(text) > 1_000_000 and "Plotly.newPlot" in text
    assert not re.search(r"<script[^>]+src=", text)
    # the bundle's only mention of the CDN is the default map-data URL of geo plots
    for m in re.finditer(r"cdn\.plot\.ly", text):
        assert "topojsonURL" in text[m.start() - 80:m.start()]


@pytest.mark.skipif(not shutil.which("chromium"), reason="PNG export needs Debian's chromium")
def test_save_png(tmp_path):
    path = save_png(tree_figure(_tree()), tmp_path / "tree.png", scale=1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="scale"):
        save_png(tree_figure(_tree()), tmp_path / "x.png", scale=0)


@pytest.fixture(scope="module")
def generation(tiny_pair):
    from specviz.decode.engine import speculative_generate
    from specviz.draft.model import TreeDrafter
    from specviz.tree.shapes import kary

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: runs before the per-test fixture
    try:
        drafter = TreeDrafter(tiny_pair.draft, kary(2, 2))
        return speculative_generate(tiny_pair.target, drafter, "def add(a, b):", max_new_tokens=10)
    finally:
        torch.set_num_threads(before)


def test_committed_tokens(generation):
    toks = committed_tokens(generation)
    assert tuple(t.token for t in toks) == generation.output_ids
    assert [t.position for t in toks] == list(range(len(toks)))
    for s, step in enumerate(generation.steps[:-1]):  # the last step may be cut by the budget
        kinds = [t.kind for t in toks if t.step == s]
        assert kinds == ["drafted"] * step.acceptance.n_accepted + ["bonus"]


def test_step_view_figure(generation, tokenizer):
    n_tok, n_steps = len(generation.output_ids), len(generation.steps)
    fig = step_view_figure(generation, tokenizer=tokenizer, highlight_step=1)
    assert len(fig.layout.shapes) == n_tok  # one box per token
    texts = {t.name: t for t in fig.data if t.type == "scatter" and t.mode == "text"}
    assert sum(len(t.text) for t in texts.values()) == n_tok
    assert len(texts["bonus token (target)"].text) == n_steps
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    assert list(bars["accepted draft tokens"].y) == [s.acceptance.n_accepted for s in generation.steps]
    # bonus bars: one trace per step colour, one bar of height 1 per step, one legend entry
    bonus = [t for t in fig.data if t.type == "bar" and t.name == "bonus token"]
    assert sorted(x for t in bonus for x in t.x) == list(range(n_steps))
    assert all(list(t.y) == [1] * len(t.x) for t in bonus)
    assert sum(t.showlegend is not False for t in bonus) == 1
    width = {x: w for t in bonus for x, w in zip(t.x, t.marker.line.width)}
    assert width[1] > width[0]
    with pytest.raises(ValueError, match="highlight_step"):
        step_view_figure(generation, highlight_step=n_steps)


def test_step_tree_figure(generation, tokenizer):
    step = generation.steps[0]
    fig = step_tree_figure(step, tokenizer=tokenizer)
    assert sum(len(t.x) for t in _marker_traces(fig).values()) == step.tree.n_nodes + 1
    assert f"step 0 · {step.drafter}" in fig.layout.title.text
    p = [v for t in _marker_traces(fig).values() for v in t.hovertext]
    assert any(f"p (target prob) {step.target_token_probs[1]:.3f}" in h for h in p)


def test_representative_step(generation):
    s = representative_step(generation)
    best = max(st.acceptance.n_accepted for st in generation.steps)
    assert generation.steps[s].acceptance.n_accepted == best


@pytest.mark.skipif(not shutil.which("chromium"), reason="PNG export needs Debian's chromium")
def test_readme_figure_command_with_tiny_pair(tmp_path, capsys):
    out = tmp_path / "draft_tree.png"
    main(["--readme-figure", "--model", "tiny", "--out", str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert str(out) in capsys.readouterr().out


def test_drafter_strip_shows_which_part_drafted_each_step(tiny_pair):
    from specviz.decode.engine import speculative_generate
    from specviz.draft import ChainDrafter, ChooserDrafter, NgramDrafter
    from specviz.render import composite_parts, drafter_strip_figure, drafting_parts

    assert composite_parts("choose(ngram(n=3,k=4)|suffix(n=8,depth=8,budget=16)|chain(k=2))") == (
        "ngram(n=3,k=4)", "suffix(n=8,depth=8,budget=16)", "chain(k=2)")
    assert composite_parts("fallback(ngram(n=3,k=4,min=2)>chain(k=2))") == ("ngram(n=3,k=4,min=2)", "chain(k=2)")
    assert composite_parts("chain(k=2)") == () and composite_parts("merged(chain(k=4)+ngram(n=3,k=8))") == ()
    chooser = ChooserDrafter([NgramDrafter(n=2, k=3), ChainDrafter(tiny_pair.draft, 2)])
    result = speculative_generate(tiny_pair.target, chooser, "the cat the cat the cat", max_new_tokens=16,
                                  stop_at_eos=False)
    parts = drafting_parts(result)
    assert parts == [part for part, _ in chooser.history]
    fig = drafter_strip_figure(result, highlight_step=0)
    shown = {trace.name: list(trace.x) for trace in fig.data}
    assert sorted(s for xs in shown.values() for s in xs) == list(range(len(result.steps)))
    assert set(shown) == set(parts) and "which part drafted each step" in fig.layout.title.text
    plain = speculative_generate(tiny_pair.target, ChainDrafter(tiny_pair.draft, 2), "hi", max_new_tokens=4)
    assert drafting_parts(plain) is None
    with pytest.raises(ValueError, match="is not a composite drafter"):
        drafter_strip_figure(plain)

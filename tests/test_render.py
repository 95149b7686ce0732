"""Renderers: node statuses and attributes, figure contents, whitespace escaping, files."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from specviz.models.loading import tiny_tokenizer
from specviz.render import (
    STATUSES,
    committed_tokens,
    escape_token,
    mask_figure,
    representative_step,
    save_html,
    save_png,
    step_tree_figure,
    step_view_figure,
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
    matches, so node 1 is rejected, node 2 accepted, node 3 never tried, node 2's child
    rejected and node 1's children never reached."""
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
    assert [v.status for v in nodes] == ["root", "rejected", "accepted", "never reached",
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
    assert counts == {"root": 1, "accepted": 1, "bonus": 1, "rejected": 2, "never reached": 3}
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


@pytest.mark.parametrize("n", [1, 2, 40, 128])
def test_tree_figure_sizes(n):
    parents = [-1] + [max(0, i - 1 - (i % 3)) for i in range(1, n)]
    fig = tree_figure(DraftTree.from_lists(list(range(n)), parents))
    assert sum(len(t.x) for t in _marker_traces(fig).values()) == n
    # wide trees get a wider figure instead of squeezed nodes
    assert fig.layout.width >= 64 * (max(fig.data[-1].x) if n > 1 else 0)


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
        assert kinds == ["drafted"] * step.acceptance.accept_length + ["bonus"]


def test_step_view_figure(generation, tokenizer):
    n_tok, n_steps = len(generation.output_ids), len(generation.steps)
    fig = step_view_figure(generation, tokenizer=tokenizer, highlight_step=1)
    assert len(fig.layout.shapes) == n_tok  # one box per token
    texts = {t.name: t for t in fig.data if t.type == "scatter" and t.mode == "text"}
    assert sum(len(t.text) for t in texts.values()) == n_tok
    assert len(texts["bonus token (target)"].text) == n_steps
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    assert list(bars["accepted draft tokens"].y) == [s.acceptance.accept_length for s in generation.steps]
    assert list(bars["bonus token"].y) == [1] * n_steps
    assert list(bars["bonus token"].marker.line.width)[1] > list(bars["bonus token"].marker.line.width)[0]
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
    best = max(st.acceptance.accept_length for st in generation.steps)
    assert generation.steps[s].acceptance.accept_length == best


@pytest.mark.skipif(not shutil.which("chromium"), reason="PNG export needs Debian's chromium")
def test_readme_figure_command_with_tiny_pair(tmp_path, capsys):
    out = tmp_path / "draft_tree.png"
    main(["--readme-figure", "--model", "tiny", "--out", str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert str(out) in capsys.readouterr().out

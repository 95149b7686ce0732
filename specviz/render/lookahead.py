"""Pictures of lookahead decoding: its two-branch mask and what one step did.

* :func:`lookahead_mask_figure` - the attention mask of one step's new tokens: the root,
  the verification branch (the pool's guesses, merged into a token tree) and the
  lookahead branch (the Jacobi window, level by level), each branch in its own colour
  and labelled;
* :func:`lookahead_step_figure` - one step laid out by position after the root: the
  window's levels, every guess with its tokens coloured by what the verifier did, and
  the tokens the step committed.

Both take a :class:`~specviz.decode.StepTrace` of a run whose drafter feeds a side branch
(:class:`~specviz.draft.LookaheadDrafter`); a step without one draws the guesses alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specviz.draft.lookahead import guesses_of
from specviz.render.trees import MONO_FONT, STATUS_STYLE, escape_token, figure_title, plot_text, token_text
from specviz.tree.core import forward_mask, path_to

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from specviz.decode.records import StepTrace

__all__ = ["BRANCH_COLORS", "lookahead_mask_figure", "lookahead_step_figure"]

#: colour of each branch's "may attend" cells (Okabe-Ito)
BRANCH_COLORS = {"root": "#000000", "verification branch": "#0072B2", "lookahead branch": "#CC79A7"}


def _label(tokenizer: Any, token: int) -> str:
    return plot_text(escape_token(token_text(tokenizer, token), 10))


def _check_step(step) -> None:
    from specviz.decode.records import StepTrace

    if not isinstance(step, StepTrace):
        raise TypeError(f"step must be a StepTrace, got {type(step).__name__}")


def lookahead_mask_figure(step: "StepTrace", *, tokenizer: Any = None, title: str | None = None,
                          cell_px: int = 16) -> "go.Figure":
    """Heatmap of one step's mask over ``[root, guess nodes, window tokens]``.

    Rows are queries, columns keys; a filled cell means "may attend". Every query also
    sees the whole committed prefix, which is left out. Guess nodes are labelled
    ``g<node>``, window tokens ``L<level>c<column>``; the colour says which branch the
    query belongs to.
    """
    import plotly.graph_objects as go

    _check_step(step)
    tree, side = step.tree, step.side
    mask = forward_mask(tree, side)  # (N+S, N+S)
    n = tree.n_nodes
    s = 0 if side is None else side.size
    width = 0
    if side is not None:
        width = int((side.groups == 0).sum())
    labels = ["root:" + _label(tokenizer, int(tree.tokens[0]))]
    labels += [f"g{i}:{_label(tokenizer, int(tree.tokens[i]))}" for i in range(1, n)]
    if side is not None:
        labels += [f"L{int(side.groups[j])}c{j - int(side.groups[j]) * width}:{_label(tokenizer, int(side.tokens[j]))}"
                   for j in range(s)]
    branch = torch.tensor([1] + [2] * (n - 1) + [3] * s, dtype=torch.int8)  # root, verification, lookahead
    z = (mask.to(torch.int8) * branch[:, None]).tolist()
    names = {0: "masked", 1: "root", 2: "verification branch", 3: "lookahead branch"}
    hover = [[f"{labels[i]} ({names[int(branch[i])]}) {'may attend to' if mask[i, j] else 'is masked from'} {labels[j]}"
              for j in range(n + s)] for i in range(n + s)]
    colors = ["#F4F4F4", BRANCH_COLORS["root"], BRANCH_COLORS["verification branch"], BRANCH_COLORS["lookahead branch"]]
    scale = []
    for k, c in enumerate(colors):
        scale += [[k / 4, c], [(k + 1) / 4, c]]
    fig = go.Figure(go.Heatmap(z=z, x=labels, y=labels, zmin=-0.5, zmax=3.5, colorscale=scale, showscale=False,
                               xgap=1, ygap=1, hovertext=hover, hoverinfo="text"))
    total = n + s
    for name, lo, hi in (("verification branch", 1, n), ("lookahead branch", n, n + s)):
        if hi <= lo:
            continue
        fig.add_shape(type="rect", x0=lo - 0.5, x1=hi - 0.5, y0=lo - 0.5, y1=hi - 0.5,
                      line=dict(color=BRANCH_COLORS[name], width=2))
        fig.add_annotation(x=hi - 0.5, y=lo - 0.5, text=f"{name} ({hi - lo})", showarrow=False, xanchor="right",
                           yanchor="bottom", font=dict(color=BRANCH_COLORS[name], size=12))
    fig.update_layout(
        title=figure_title(title or f"lookahead attention mask: 1 root, {n - 1} guess nodes, {s} window tokens\n"
                                    "filled = may attend (every query also sees the committed prefix)"),
        autosize=True, height=max(360, cell_px * total + 220),
        margin=dict(l=130, r=20, t=90, b=130), plot_bgcolor="#FFFFFF",
        xaxis=dict(tickangle=-60, tickfont=dict(family=MONO_FONT, size=10), title="key", constrain="domain"),
        yaxis=dict(autorange="reversed", tickfont=dict(family=MONO_FONT, size=10), title="query",
                   scaleanchor="x", constrain="domain"),
    )
    return fig


def lookahead_step_figure(step: "StepTrace", *, tokenizer: Any = None, title: str | None = None) -> "go.Figure":
    """One lookahead step by position after the root (x = offset, one row per item).

    Rows from the top: the window's levels (grey: tokens of the Jacobi iteration, never
    committed), then every guess the pool offered for the root (green = accepted, red =
    the token the target refused, sky blue = not chosen: not tried because another
    guess's token was accepted at that position, light grey = not reached), then the
    tokens the step committed (its accepted guess tokens and the bonus token).
    """
    import plotly.graph_objects as go

    _check_step(step)
    tree, side, acc = step.tree, step.side, step.acceptance
    xs, ys, texts, colors, hovers = [], [], [], [], []

    def put(x: int, row: str, token: int, color: str, what: str) -> None:
        label = _label(tokenizer, token)
        xs.append(x)
        ys.append(row)
        texts.append(label)
        colors.append(color)
        hovers.append(f"{row}, offset {x}: {label} ({what})")

    rows: list[str] = []
    if side is not None:
        for j in range(side.size):
            row = f"window level {int(side.groups[j])}"
            if row not in rows:
                rows.append(row)
            put(int(side.offsets[j]), row, int(side.tokens[j]), "#777777", "window token")
    guesses = guesses_of(step)
    # guesses_of lists one guess per leaf, in leaf order: the tree nodes behind each token
    inner = set(tree.parents.tolist())
    leaves = [i for i in range(1, tree.n_nodes) if i not in inner]
    tried = acc.tried.tolist()
    for g, (guess, leaf) in enumerate(zip(guesses, leaves), start=1):
        row = f"guess {g}"
        rows.append(row)
        path = path_to(tree, leaf)[1:]
        for k, token in enumerate(guess["tokens"]):
            if k < guess["accepted"]:
                status, what = "accepted", "accepted"
            elif k == guess["accepted"] and tried[path[k]]:
                status, what = "rejected", "refused by the target"
            elif k == guess["accepted"]:
                status, what = "not chosen", "not tried: another guess's token was accepted here"
            else:
                status, what = "never reached", "not reached"
            put(k + 1, row, token, STATUS_STYLE[status].color, what)
    rows.append("committed")
    for k, token in enumerate(acc.committed_tokens):
        bonus = k == len(acc.committed_tokens) - 1
        put(k + 1, "committed", token, STATUS_STYLE["bonus" if bonus else "accepted"].color,
            "bonus token" if bonus else "accepted guess token")
    put(0, "committed", int(tree.tokens[0]), STATUS_STYLE["root"].color, "root: last committed token")
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="text", text=texts, textfont=dict(family=MONO_FONT, size=13,
                                                                                   color=colors),
                               hovertext=hovers, hoverinfo="text", showlegend=False))
    for status, name in (("accepted", "accepted"), ("rejected", "refused"), ("not chosen", "not chosen"),
                         ("never reached", "not reached"), ("bonus", "bonus")):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(color=STATUS_STYLE[status].color, size=10, symbol="square")))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="window (not committed)",
                             marker=dict(color="#777777", size=10, symbol="square")))
    reach = max([1] + xs)
    n_acc = len(acc.accepted_nodes)
    fig.update_layout(
        title=figure_title(title or f"lookahead step {step.step}: {len(guesses)} guesses, "
                                    f"{n_acc} token{'s' if n_acc != 1 else ''} accepted + bonus\n"
                                    f"{step.side_tokens} window tokens and {tree.n_nodes} tree nodes in one forward"),
        height=max(260, 34 * len(rows) + 170), autosize=True,
        margin=dict(l=130, r=20, t=90, b=50), plot_bgcolor="#FFFFFF",
        xaxis=dict(title="position after the root", dtick=1, range=[-0.6, reach + 0.6], zeroline=False),
        yaxis=dict(categoryorder="array", categoryarray=rows[::-1], tickfont=dict(size=12)),
        legend=dict(orientation="h", y=-0.15),
    )
    return fig


"""Figures to files: standalone offline HTML (plotly.js embedded) and PNG through kaleido,
plus the README's picture of one verification step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from specviz.locations import output_path
from specviz.render.steps import representative_step
from specviz.render.trees import step_tree_figure

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from specviz.models.types import ModelPair

__all__ = ["save_html", "save_png", "README_FIGURE", "save_example_tree"]

# Browsers kaleido looks for on PATH (it also honours $BROWSER_PATH).
_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def save_html(fig: "go.Figure", path: str | Path) -> Path:
    """Write ``fig`` as a standalone HTML page that opens offline: plotly.js is embedded
    (no CDN), and scroll-zoom is on. Relative paths go under ``outputs/``.

    Returns:
        The path written.
    """
    dest = output_path(path)
    fig.write_html(dest, include_plotlyjs=True, full_html=True,
                   config={"scrollZoom": True, "displaylogo": False})
    return dest


def save_png(fig: "go.Figure", path: str | Path, *, scale: float = 2.0) -> Path:
    """Write ``fig`` as a PNG through kaleido. Relative paths go under ``outputs/``.

    kaleido renders with a headless Chromium it finds on ``PATH`` (Debian's
    ``chromium`` package works) or at ``$BROWSER_PATH``; nothing is downloaded.

    Returns:
        The path written.

    Raises:
        ValueError: on a non-positive scale.
        RuntimeError: if no Chromium can be found (says how to point kaleido at one).
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not (os.environ.get("BROWSER_PATH") or any(shutil.which(n) for n in _CHROMIUM_NAMES)):
        raise RuntimeError(
            "PNG export needs a Chromium for kaleido and none was found: install one (Debian: "
            "apt-get install chromium) or set BROWSER_PATH to its executable"
        )
    dest = output_path(path)
    fig.write_image(dest, format="png", scale=scale)
    return dest


# -- the README picture -------------------------------------------------------------------------

README_FIGURE = "reference/draft_tree.png"
_EXAMPLE_PROMPT = "Write a Python function that checks whether a number is prime."


def save_example_tree(path: str | Path = README_FIGURE, pair: "ModelPair | None" = None, *,
                      branching: Sequence[int] = (2, 2, 1, 1), prompt: str = _EXAMPLE_PROMPT,
                      max_new_tokens: int = 32, scale: float = 2.0) -> Path:
    """Draw one verification step as a PNG: the draft model fills a static
    ``expansion(branching)`` tree, the target verifies greedily, and the step with the
    most to show (:func:`representative_step`) is saved. Relative paths go under
    ``outputs/``.

    Args:
        path: where the PNG goes (default ``outputs/reference/draft_tree.png``).
        pair: target and draft models (default: the built-in Qwen2.5-Coder pair, fp32).
        branching: SpecInfer expansion config of the draft tree.
        prompt: the user prompt.
        max_new_tokens: tokens generated to find a telling step.
        scale: PNG pixel scale.

    Returns:
        The path written.
    """
    from specviz.decode.engine import speculative_generate
    from specviz.draft.model import TreeDrafter
    from specviz.models.loading import load_pair
    from specviz.tree.shapes import expansion

    pair = load_pair(dtype="fp32") if pair is None else pair
    drafter = TreeDrafter(pair.draft, expansion(branching))
    result = speculative_generate(pair.target, drafter, prompt, max_new_tokens=max_new_tokens)
    step = result.steps[representative_step(result)]
    return save_png(step_tree_figure(step, tokenizer=pair.target.tokenizer), path, scale=scale)

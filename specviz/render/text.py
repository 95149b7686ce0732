"""Token text as the pictures show it: readable labels and text that plotly shows as written.

Every renderer of :mod:`specviz.render` writes its tokens, hovers, titles and tick labels
through these functions (re-exported by :mod:`specviz.render.trees`):

* :func:`escape_token` - a token's text with whitespace and control characters made
  visible and cut to a label's length;
* :func:`token_text` - a token id decoded (``#id`` without a tokenizer);
* :func:`plot_text` - text made safe for plotly, which reads a small HTML subset;
* :func:`figure_title` - a plotly title whose further lines are its subtitle;
* :data:`MONO_FONT` - the monospace font token text is drawn in.

No tensors appear here: everything is text or token ids.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["MONO_FONT", "escape_token", "token_text", "plot_text", "figure_title"]

#: the font token text is drawn in (labels, tick labels, the step view's text)
MONO_FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"

_VISIBLE_WHITESPACE = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def escape_token(text: str, max_chars: int | None = 12) -> str:
    """Make a token's text readable as a label: whitespace and control characters become
    visible (``" "`` -> ``␣``, newline -> ``\\n``, tab -> ``\\t``, others -> ``\\xNN``), the
    empty string becomes ``∅``, and text longer than ``max_chars`` is cut with ``…``.

    The result is plain text; HTML escaping happens where figures are built.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if max_chars is not None and max_chars < 2:
        raise ValueError(f"max_chars must be >= 2 or None, got {max_chars}")
    if text == "":
        return "∅"
    parts = []
    for ch in text:
        if ch in _VISIBLE_WHITESPACE:
            parts.append(_VISIBLE_WHITESPACE[ch])
        elif not ch.isprintable():
            parts.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            parts.append(ch)
    out = "".join(parts)
    if max_chars is not None and len(out) > max_chars:
        out = out[: max_chars - 1] + "…"
    return out


def token_text(tokenizer: Any, token_id: int) -> str:
    """Decoded text of one token, or ``#id`` without a tokenizer."""
    if tokenizer is None:
        return f"#{int(token_id)}"
    return tokenizer.decode([int(token_id)])


def plot_text(text: str) -> str:
    """``text`` made safe for plotly's text, labels, hovers, titles and tick labels.

    plotly reads its text as a small HTML subset, decodes only a few entities (``&amp;``,
    ``&lt;``, ``&gt;`` and numeric ones) and draws any other, such as ``&quot;``, as
    written. So ``&``, ``<`` and ``>`` become entities (a token ``<b>`` is shown, not
    obeyed) and quotes stay characters.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"plot text must be a str, got {type(text).__name__}")
    return html.escape(text, quote=False)


def figure_title(text: str, **style) -> dict:
    """A plotly title from plain text: the first line is the title, further lines its
    subtitle (plotly places a subtitle correctly where a multi-line title drifts)."""
    first, _, rest = text.partition("\n")
    out = dict(text=plot_text(first), x=0.01, xanchor="left", font=dict(size=16), **style)
    if rest:
        out["subtitle"] = dict(text="<br>".join(plot_text(line) for line in rest.split("\n")),
                               font=dict(size=13))
    return out

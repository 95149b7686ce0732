"""One colour per drafting strategy, the same in every figure.

:func:`strategy_color` maps a strategy's name to a ``#RRGGBB`` colour by its family, so
"chain" in the acceptance study, ``chain-k4`` in the benchmark and "chain" in the report
are drawn alike. Names are read in every spelling specviz uses: the registry's
(``chain-k4``, ``tree-2x2x1``, ``tree-w4-d3-b16``, ``dynamic-w4-d5-b16``, ``ngram``,
``ngram-trie``, ``jacobi-k5``, ``lookahead-w5-n4-g5``, ``self-spec-L12``, ...), the
benchmark's peers (``plain``, ``hf-assisted``, ``hf-prompt-lookup``, ``llama-spec``, ...)
and the notebooks' display names ("2-ary", "4-ary", "expansion-3-2-1", "sequoia",
"dynamic (EAGLE-2)", "n-gram chain", "n-gram trie"). The family colours come from the
Okabe-Ito and Paul Tol palettes, both chosen to stay apart under the common colour-vision
deficiencies; a name of no known family gets a colour derived from a hash of the name
(the same in every session, unlike Python's ``hash``).

:func:`strategy_colors` gives a figure's mapping, ready for plotly express's
``color_discrete_map``; several names of one family in the same figure (``chain-k2``
and ``chain-k4``) get distinguishable shades of the family colour.
"""

from __future__ import annotations

import colorsys
import hashlib
import re
from typing import Iterable

__all__ = ["FAMILY_COLORS", "strategy_family", "strategy_color", "strategy_colors"]

#: colour of each strategy family (``#RRGGBB``, a format every plotly version accepts)
FAMILY_COLORS: dict[str, str] = {
    "chain": "#0072B2",              # Okabe-Ito blue
    "2-ary": "#56B4E9",              # Okabe-Ito sky blue
    "4-ary": "#332288",              # Tol indigo
    "k-ary": "#88CCEE",              # Tol cyan: other widths
    "expansion": "#009E73",          # Okabe-Ito bluish green
    "sequoia": "#CC79A7",            # Okabe-Ito reddish purple
    "dynamic": "#D55E00",            # Okabe-Ito vermillion (EAGLE-2)
    "n-gram chain": "#E69F00",       # Okabe-Ito orange (prompt lookup)
    "n-gram trie": "#999933",        # Tol olive
    "merged": "#CC6677",             # Tol rose
    "lookahead": "#882255",          # Tol wine
    "jacobi": "#44AA99",             # Tol teal
    "adaptive": "#117733",           # Tol green
    "self-spec": "#AA4499",          # Tol purple
    "plain": "#555555",              # dark grey: the baseline
    "hf-assisted": "#DDAA33",        # Tol high-contrast yellow
    "hf-prompt-lookup": "#BB5566",   # Tol high-contrast red
    "llama": "#EE3377",              # Tol vibrant magenta
}

# (family, pattern) in match order; names are lower-cased and stripped first
_FAMILY_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple((f, re.compile(p)) for f, p in (
    ("n-gram trie", r"^n-?gram[ -]?trie\b"),
    ("hf-prompt-lookup", r"^hf-prompt-lookup\b"),
    ("hf-assisted", r"^hf-"),
    ("n-gram chain", r"^(n-?gram|prompt[ -]lookup)\b"),
    ("llama", r"^llama[ -]"),
    ("plain", r"^(specviz-)?plain\b"),
    ("adaptive", r"^adaptive\b"),
    ("self-spec", r"^self-spec"),
    ("dynamic", r"^(dynamic|eagle)"),
    ("sequoia", r"^sequoia\b"),
    ("expansion", r"^(expansion\b|tree-\d+(x\d+)*$)"),
    ("k-ary", r"^(\d+-ary\b|tree-w\d+)"),
    ("chain", r"^chain\b"),
    ("lookahead", r"^lookahead\b"),
    ("jacobi", r"^jacobi\b"),
    ("merged", r"^merged\b"),
))
_WIDTH = re.compile(r"^(?:(\d+)-ary|tree-w(\d+))")


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a strategy name must be a str, got {type(name).__name__}: {name!r}")
    if not name.strip():
        raise ValueError("a strategy name must not be empty")
    return name.strip().lower()


def strategy_family(name: str) -> str | None:
    """The family of a strategy name (a key of :data:`FAMILY_COLORS`), or None if the
    name belongs to no known family. k-ary trees of width 2 and 4 are the families
    "2-ary" and "4-ary" (the study draws them side by side), other widths "k-ary"."""
    key = _check_name(name)
    for family, pattern in _FAMILY_PATTERNS:
        if pattern.search(key):
            if family == "k-ary":
                width = next(g for g in _WIDTH.match(key).groups() if g)
                return {"2": "2-ary", "4": "4-ary"}.get(width, "k-ary")
            return family
    return None


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{round(min(1.0, max(0.0, c)) * 255):02X}" for c in rgb)


def _rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def _hashed_color(key: str) -> str:
    """A mid-lightness, saturated colour from a stable hash of ``key``."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    hue = int.from_bytes(digest[:2], "big") / 65536
    lightness = 0.38 + 0.14 * digest[2] / 255
    return _hex(colorsys.hls_to_rgb(hue, lightness, 0.65))


def _shade(color: str, k: int) -> str:
    """The ``k``-th shade of ``color`` (0 = itself): darker and lighter in turn, each
    pair further from the colour (k = 1..6); beyond that a hashed colour. Always a
    valid ``#RRGGBB``."""
    if k == 0:
        return color
    if k > 6:
        return _hashed_color(f"{color}#{k}")
    amount = 0.3 + 0.2 * ((k - 1) // 2)
    r, g, b = _rgb(color)
    if k % 2:  # towards black
        return _hex((r * (1 - amount), g * (1 - amount), b * (1 - amount)))
    return _hex((r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount))


def strategy_color(name: str) -> str:
    """The colour of a strategy name, ``#RRGGBB``: its family's colour
    (:data:`FAMILY_COLORS`), or a colour derived from a hash of the name for a name of
    no known family (stable across sessions and machines).

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is empty.
    """
    family = strategy_family(name)
    if family is None:
        return _hashed_color(_check_name(name))
    return FAMILY_COLORS[family]


def _natural_key(name: str) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.split(r"(\d+)", name.lower()) if part)


def strategy_colors(names: Iterable[str]) -> dict[str, str]:
    """A colour for each of ``names`` (e.g. the strategies of one figure), usable as
    plotly express's ``color_discrete_map``.

    Every name gets :func:`strategy_color`, except where names of the figure would share
    a colour (several members of one family, such as ``chain-k2`` and ``chain-k4``): then
    the first in natural order (``k2`` before ``k10``) keeps the family colour and the
    others get darker and lighter shades of it. The mapping depends only on the set of
    names, not on their order; a repeated name is listed once.

    Raises:
        TypeError: a name is not a str (or ``names`` is a single str).
        ValueError: a name is empty.
    """
    if isinstance(names, str):
        raise TypeError(f"names must be a collection of strategy names, not one str ({names!r})")
    unique = sorted(set(names), key=lambda n: (_natural_key(_check_name(n)), n))
    out: dict[str, str] = {}
    used: set[str] = set()
    for name in unique:
        base = strategy_color(name)
        color, k = base, 0
        while color in used:
            k += 1
            color = _shade(base, k)
        used.add(color)
        out[name] = color
    return out

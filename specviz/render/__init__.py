"""Renderers: one draft tree coloured by acceptance and its mask (:mod:`~specviz.render.trees`),
whole generations (:mod:`~specviz.render.steps`), lookahead decoding's mask and steps
(:mod:`~specviz.render.lookahead`), offline HTML/PNG files
(:mod:`~specviz.render.export`), a tidy tree layout (:mod:`~specviz.render.layout`), one
colour per strategy (:mod:`~specviz.render.colors`), clean log-axis ticks
(:mod:`~specviz.render.axes`), recorded generations that draw without a model
(:mod:`~specviz.render.traces`) and the interactive explorer (:mod:`~specviz.render.explorer`,
imported on its own: it needs ipywidgets)."""

from specviz.render.axes import *  # noqa: F401,F403
from specviz.render.colors import *  # noqa: F401,F403
from specviz.render.export import *  # noqa: F401,F403
from specviz.render.lookahead import *  # noqa: F401,F403
from specviz.render.steps import *  # noqa: F401,F403
from specviz.render.trees import *  # noqa: F401,F403

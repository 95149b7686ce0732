"""Renderers: one draft tree coloured by acceptance and its mask (:mod:`~specviz.render.trees`,
with each node's status and hover text in :mod:`~specviz.render.nodes`), whole generations
(:mod:`~specviz.render.steps`), tokens as readable text (:mod:`~specviz.render.text`),
lookahead decoding's mask and steps (:mod:`~specviz.render.lookahead`), offline HTML/PNG
files (:mod:`~specviz.render.export`), a tidy tree layout (:mod:`~specviz.render.layout`),
one colour per strategy (:mod:`~specviz.render.colors`), clean log-axis ticks
(:mod:`~specviz.render.axes`), recorded generations that draw without a model
(:mod:`~specviz.render.traces`, :mod:`~specviz.render.recording`) and the interactive
explorer (:mod:`~specviz.render.explorer` with its settings in
:mod:`~specviz.render.explorer_settings`, imported on its own: it needs ipywidgets)."""

from specviz.render.axes import *  # noqa: F401,F403
from specviz.render.colors import *  # noqa: F401,F403
from specviz.render.export import *  # noqa: F401,F403
from specviz.render.lookahead import *  # noqa: F401,F403
from specviz.render.steps import *  # noqa: F401,F403
from specviz.render.trees import *  # noqa: F401,F403

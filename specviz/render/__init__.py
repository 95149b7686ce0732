"""Renderers: draft trees coloured by acceptance, masks, step views, offline HTML/PNG export
(:mod:`~specviz.render.figures`), a tidy tree layout (:mod:`~specviz.render.layout`) and the
interactive explorer (:mod:`~specviz.render.explorer`)."""

from specviz.render.figures import *  # noqa: F401,F403

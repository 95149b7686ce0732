"""Metrics: acceptance rate, tau (tokens per target call) and per-depth acceptance, from
live traces and from tables of replayed steps alike (:mod:`~specviz.metrics.acceptance`)."""

from specviz.metrics.acceptance import *  # noqa: F401,F403

"""Decoding: the speculative engine on real models (:mod:`~specviz.decode.engine`) and greedy
replay of any drafter along a recorded continuation (:mod:`~specviz.decode.replay`)."""

from specviz.decode.engine import *  # noqa: F401,F403

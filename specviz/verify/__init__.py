"""Verification: which drafted tokens the target keeps (:mod:`~specviz.verify.rules`), and the
verification lab that proves which rules are lossless (:mod:`~specviz.verify.lab`)."""

from specviz.verify.rules import *  # noqa: F401,F403

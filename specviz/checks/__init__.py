"""Exactness checks on real models: greedy identity of every drafter with target-only decoding
(:mod:`~specviz.checks.identity`), and teacher-forced top-1 agreement of a weight mode with fp32
(:mod:`~specviz.checks.accuracy`)."""

from specviz.checks.accuracy import *  # noqa: F401,F403
from specviz.checks.identity import *  # noqa: F401,F403

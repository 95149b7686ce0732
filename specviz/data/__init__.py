"""The ground floor, imported by every other layer: the shipped prompt set
(:mod:`~specviz.data.prompts`), resumable result stores and atomic writes
(:mod:`~specviz.data.store`) and the machine a measurement ran on
(:mod:`~specviz.data.machine`)."""

from specviz.data.machine import *  # noqa: F401,F403
from specviz.data.prompts import *  # noqa: F401,F403
from specviz.data.store import *  # noqa: F401,F403

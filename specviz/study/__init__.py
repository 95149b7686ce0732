"""The study: prompts (:mod:`~specviz.data.prompts`), result stores and tables
(:mod:`~specviz.data.store`), presets (:mod:`~specviz.study.presets`), the headless notebook
runner (:mod:`~specviz.study.runner`), notebook files (:mod:`~specviz.study.notebooks`), the
units of work the notebooks run (:mod:`~specviz.study.units`; the batch sweep's:
:mod:`~specviz.study.serving_units`), and where they run: in the
notebook's process or on a Dask cluster (:mod:`~specviz.study.work`, :mod:`~specviz.study.cluster`)."""

from specviz.study.cluster import *  # noqa: F401,F403
from specviz.study.notebooks import *  # noqa: F401,F403
from specviz.study.presets import *  # noqa: F401,F403
from specviz.study.runner import *  # noqa: F401,F403
from specviz.study.work import *  # noqa: F401,F403

"""Wall-clock measurement: end-to-end speed against transformers' own decoding
(:mod:`~specviz.bench.e2e`), cost curves and the step-cost model (:mod:`~specviz.bench.cost`),
tree-attention timing (:mod:`~specviz.bench.attention`), where a run's time goes
(:mod:`~specviz.bench.profile`), and llama.cpp as a measured peer (:mod:`~specviz.bench.llama`)."""

from specviz.bench.attention import *  # noqa: F401,F403
from specviz.bench.cost import *  # noqa: F401,F403
from specviz.bench.e2e import *  # noqa: F401,F403
from specviz.bench.llama import *  # noqa: F401,F403
from specviz.bench.profile import *  # noqa: F401,F403

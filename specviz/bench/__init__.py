"""Wall-clock measurement: end-to-end speed against transformers' own decoding
(:mod:`~specviz.bench.e2e`), cost curves and the step-cost model (:mod:`~specviz.bench.cost`),
tree-attention timing (:mod:`~specviz.bench.attention`), batches and memory
(:mod:`~specviz.bench.serving`), where a run's time goes
(:mod:`~specviz.bench.profile`), and llama.cpp as a measured peer (:mod:`~specviz.bench.llama`);
the command line's options (:mod:`~specviz.bench.cli_args`) and a run's cost passes
(:mod:`~specviz.bench.cost_passes`)."""

from specviz.bench.attention import *  # noqa: F401,F403
from specviz.bench.cost import *  # noqa: F401,F403
from specviz.bench.e2e import *  # noqa: F401,F403
from specviz.bench.llama import *  # noqa: F401,F403
from specviz.bench.profile import *  # noqa: F401,F403
from specviz.bench.serving import *  # noqa: F401,F403

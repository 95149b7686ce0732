"""Decoding: what a run records and when it stops (:mod:`~specviz.decode.records`), the
speculative engine on real models (:mod:`~specviz.decode.engine`), greedy replays of any
drafter along a recorded continuation (:mod:`~specviz.decode.replay`), teacher-forced
draft ranks (:mod:`~specviz.decode.ranks`) and the target's view of draft trees for
scoring sampling rules (:mod:`~specviz.decode.scoring`)."""

from specviz.decode.engine import *  # noqa: F401,F403
from specviz.decode.phases import *  # noqa: F401,F403
from specviz.decode.ranks import *  # noqa: F401,F403
from specviz.decode.records import *  # noqa: F401,F403
from specviz.decode.replay import *  # noqa: F401,F403
from specviz.decode.scoring import *  # noqa: F401,F403

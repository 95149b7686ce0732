"""Models: load a target/draft pair (built-in GGUF pair, any Hub id or local directory, tiny
random pairs for tests) and drive transformers' own KV cache.

* :mod:`~specviz.models.loading` - :func:`load_model`, :func:`load_pair`, :func:`tiny_pair`;
* :mod:`~specviz.models.kvcache` - one forward of new tokens with an explicit mask and positions,
  and the cache bookkeeping tree verification needs (compaction, batching rows);
* :mod:`~specviz.models.weights` - weight modes: fp32 (the exactness reference), bf16, fp16,
  fp32-wx (a small-batch-friendly fp32 product), int8 and int4 weight-only, w8a8;
* :mod:`~specviz.models.auto` - ``dtype="auto"``: the fastest weight mode that passes the
  accuracy bar on this machine, probed once and cached;
* :mod:`~specviz.models.device` - device names (``auto``, ``cpu``, ``cuda``, ``mps``) and
  synchronised timing.
"""

from specviz.models.auto import *  # noqa: F401,F403
from specviz.models.device import *  # noqa: F401,F403
from specviz.models.kvcache import *  # noqa: F401,F403
from specviz.models.loading import *  # noqa: F401,F403
from specviz.models.loading import BUILTIN_MODELS  # noqa: F401
from specviz.models.weights import *  # noqa: F401,F403

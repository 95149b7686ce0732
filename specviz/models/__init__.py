"""Models: load a target/draft pair (built-in GGUF pair, any Hub id or local directory, tiny
random pairs for tests) and drive transformers' own KV cache.

* :mod:`~specviz.models.loading` - :func:`load_model`, :func:`load_pair`, :func:`tiny_pair`;
* :mod:`~specviz.models.kvcache` - one forward of new tokens with an explicit mask and positions,
  and the cache bookkeeping tree verification needs (compaction, batching rows).
"""

from specviz.models.kvcache import *  # noqa: F401,F403
from specviz.models.loading import *  # noqa: F401,F403
from specviz.models.loading import BUILTIN_MODELS  # noqa: F401

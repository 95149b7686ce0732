"""Models: load a target/draft pair (the built-in GGUF pair, any Hub id or local directory,
tiny random pairs for tests) and run forwards of new tokens over transformers' own KV cache.

* :mod:`~specviz.models.types` - :class:`LoadedModel`, :class:`ModelPair`;
* :mod:`~specviz.models.loading` - :func:`load_model`, :func:`load_pair`;
* :mod:`~specviz.models.builtin` - the built-in pair assembled from its data packages, and
  the cache (:func:`cache_dir`, :func:`prepare_builtin`);
* :mod:`~specviz.models.tiny` - :func:`tiny_model`, :func:`tiny_pair`;
* :mod:`~specviz.models.convert` - a model put into a weight mode of :mod:`specviz.quant`;
* :mod:`~specviz.models.kvcache` - one forward of new tokens with an explicit mask and
  positions, and the cache bookkeeping tree verification needs (compaction, batching rows);
  :mod:`~specviz.models.slots` (in-place cache appends) and :mod:`~specviz.models.decoder`
  (which decoders the direct forward runs) serve it and the fused layers
  (:mod:`~specviz.models.fused`);
* :mod:`~specviz.models.heads`, :mod:`~specviz.models.features`,
  :mod:`~specviz.models.saved_heads` - draft-head modules over the target's features, the
  features themselves, and trained heads on disk;
* :mod:`~specviz.models.device` - device names (``auto``, ``cpu``, ``cuda``, ``mps``) and
  synchronised timing.

The weight mode ``"auto"`` is not resolved here: it needs a probe of this machine, which
:func:`specviz.bench.auto.resolve_auto` runs (the command lines and the study call it).
"""

from specviz.models.builtin import *  # noqa: F401,F403
from specviz.models.device import *  # noqa: F401,F403
from specviz.models.kvcache import *  # noqa: F401,F403
from specviz.models.loading import *  # noqa: F401,F403
from specviz.models.tiny import *  # noqa: F401,F403
from specviz.models.types import *  # noqa: F401,F403

"""Drafters: everything that proposes a draft tree.

* :mod:`~specviz.draft.base` - the :class:`Drafter` interface and the draft model's KV cache;
* :mod:`~specviz.draft.composite` - what drafters made of other drafters share;
* :mod:`~specviz.draft.model` - draft-model trees, chains and EAGLE-2 dynamic trees;
* :mod:`~specviz.draft.adaptive` - chains whose length follows recent acceptance;
* :mod:`~specviz.draft.self_spec` - the target's own first layers as the draft;
* :mod:`~specviz.draft.ngram` - prompt lookup, as a chain or a trie;
* :mod:`~specviz.draft.merged` - SpecInfer's merge of several drafters;
* :mod:`~specviz.draft.fallback` - a cascade: later drafters run only where earlier ones propose nothing;
* :mod:`~specviz.draft.switch` - prompt lookup or a draft-model chain, whichever promises more each step;
* :mod:`~specviz.draft.chooser` - whichever of many drafters promises the most tokens per second each step;
* :mod:`~specviz.draft.lookahead` - Jacobi and lookahead decoding: no draft model, guesses from the
  target's own outputs;
* :mod:`~specviz.draft.suffix` - SuffixDecoding: trees of the most frequent continuations in suffix
  trees over the request and over earlier requests' outputs;
* :mod:`~specviz.draft.vocab` - a draft vocabulary reduced to a ranking's most frequent tokens plus
  the sequence's own (strategy names ending in ``-v<N>``; counted by
  ``python -m specviz.heads.vocab``, so its names are imported from the module itself);
* :mod:`~specviz.draft.heads` - drafters of trained Medusa heads and EAGLE feature heads;
* :mod:`~specviz.draft.registry` - every strategy by name, built from a model pair.
"""

from specviz.draft.adaptive import *  # noqa: F401,F403
from specviz.draft.base import *  # noqa: F401,F403
from specviz.draft.composite import *  # noqa: F401,F403
from specviz.draft.fallback import *  # noqa: F401,F403
from specviz.draft.heads import *  # noqa: F401,F403
from specviz.draft.lookahead import *  # noqa: F401,F403
from specviz.draft.merged import *  # noqa: F401,F403
from specviz.draft.model import *  # noqa: F401,F403
from specviz.draft.ngram import *  # noqa: F401,F403
from specviz.draft.registry import *  # noqa: F401,F403
from specviz.draft.self_spec import *  # noqa: F401,F403
from specviz.draft.suffix import *  # noqa: F401,F403
from specviz.draft.switch import *  # noqa: F401,F403
from specviz.draft.chooser import *  # noqa: F401,F403

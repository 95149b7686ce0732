"""Draft trees: the one representation (token ids plus a parent per node) and everything
derived from it.

* :mod:`~specviz.tree.core` - :class:`DraftTree`, depths, paths, ancestor masks, position ids,
  padded batches, and the tree algorithms every drafter and verifier shares;
* :mod:`~specviz.tree.shapes` - token-free shapes: chains, k-ary trees, expansion configs,
  Medusa-style path lists;
* :mod:`~specviz.tree.sequoia` - Sequoia's dynamic program for the best tree per budget;
* :mod:`~specviz.tree.budgets` - one static shape per family at an exact draft budget;
* :mod:`~specviz.tree.side` - side branches: tokens a step feeds beside its tree (lookahead's window).
"""

from specviz.tree.budgets import *  # noqa: F401,F403
from specviz.tree.core import *  # noqa: F401,F403
from specviz.tree.sequoia import *  # noqa: F401,F403
from specviz.tree.shapes import *  # noqa: F401,F403
from specviz.tree.side import *  # noqa: F401,F403
from specviz.tree.trie import *  # noqa: F401,F403

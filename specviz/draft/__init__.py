"""Drafters: everything that proposes a draft tree."""

from specviz.draft.base import *  # noqa: F401,F403
from specviz.draft.merge import *  # noqa: F401,F403
from specviz.draft.ngram import *  # noqa: F401,F403

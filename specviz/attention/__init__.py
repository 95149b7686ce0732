"""Tree attention in pure PyTorch: the kernels (:mod:`~specviz.attention.kernels`) and their use
as the attention implementation of a transformers model during verification (:mod:`~specviz.attention.hf`)."""

from specviz.attention.kernels import *  # noqa: F401,F403
from specviz.attention.hf import *  # noqa: F401,F403

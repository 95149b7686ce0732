"""Tree attention in pure PyTorch: the kernels (:mod:`~specviz.attention.kernels`) and their use
as the attention implementation of a transformers model during verification."""

from specviz.attention.kernels import *  # noqa: F401,F403

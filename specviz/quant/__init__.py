"""Weight modes: how a model's linear layers store and multiply their weights.

* :mod:`~specviz.quant.weights` - the modes by name (:func:`parse_weight_mode`), their linear
  layers and the conversion of a model's layers;
* :mod:`~specviz.quant.w8a8` - ``w8a8-token``'s layer, its VNNI weight layout and the
  shared-input groups (all imported from :mod:`~specviz.quant.weights`);
* :mod:`~specviz.quant.w4a8` - ``w4a8-token``: 4-bit groups with per-token 8-bit activations
  (a draft's mode);
* :mod:`~specviz.quant.extension` - the compiled operators those layers call where a C++
  compiler is at hand;
* :mod:`~specviz.quant.passes` - which rows of a forward belong to the prompt pass (the
  per-pass activation scales).
"""

from specviz.quant.weights import *  # noqa: F401,F403

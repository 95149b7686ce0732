"""specviz: see, measure and compare speculative decoding.

The subpackages follow one step of speculative decoding from left to right::

    models ──> draft ──> tree ──> attention ──> verify ──> decode ──> metrics ──> render
    (target,   (chain,    (token ids  (tree mask,    (which draft   (engine:    (acceptance  (trees by
     draft,     trees,     + parent    pure-PyTorch   tokens the     KV cache,   rate, tau,   status, masks,
     KV cache,  EAGLE-2,   per node;   tree attention target keeps;  traces,     per depth)   step views,
     weight     n-gram,    shapes,     inside the     lossless and   replay)                  explorer)
     modes)     registry)  Sequoia)    target)        lossy rules)

and three more measure and report it:

* ``bench``  - wall-clock speed against transformers' own decoding, cost curves, attention timing;
* ``checks`` - long exactness checks on real models (greedy identity, reduced-precision match);
* ``study``  - prompts, resumable result stores and the headless notebook runner.

Shared by all: ``sampling`` (temperature / top-k / top-p and sibling sampling modes),
``validate`` (argument checks) and ``locations`` (the repository's data and output folders).
Each subpackage's ``__init__`` re-exports its public names, so ``from specviz.tree import
DraftTree`` and ``from specviz.tree.core import DraftTree`` are the same; ``import specviz``
alone imports nothing heavy.
"""

__version__ = "0.1.0"

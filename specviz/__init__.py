"""specviz: see, measure and compare speculative decoding.

The package follows one step of speculative decoding from left to right::

    models ──> drafters ──> tree ──> mask / attention ──> verify ──> decode ──> metrics ──> render
    (target,   (chain,      (token ids +  (which node sees    (which draft   (KV cache,  (acceptance  (networkx /
     draft)     static tree, parent per    which, pure         tokens the     traces,     rate, tau,   plotly trees,
                dynamic,     node)         PyTorch)            target keeps)  batches)    per depth)   explorer)
                n-gram, ...)

``study`` runs the notebooks headlessly and ``bench`` measures wall-clock speedups.
Modules are imported lazily by the user (``from specviz.tree.core import DraftTree``) so that
``import specviz`` stays cheap.
"""

__version__ = "0.1.0"

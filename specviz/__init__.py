"""specviz: see, measure and compare speculative decoding.

One step of speculative decoding, left to right: a drafter proposes a tree of tokens, the
target scores the whole tree in one forward with a tree mask, a verification rule keeps a
path of it, and the engine records what was kept::

    draft ──> tree ──> attention ──> verify ──> decode ──> metrics ──> render
    (chain,    (token ids  (tree mask,    (which draft   (engine:    (acceptance  (trees by
     trees,     + parent    pure-PyTorch   tokens the     KV cache,   rate, tau,   status, masks,
     EAGLE-2,   per node;   tree attention target keeps;  traces,     per depth)   step views,
     n-gram,    shapes,     inside the     lossless and   replay)                  explorer)
     heads)     Sequoia)    target)        lossy rules)

The subpackages sit in one layer order. A module imports only from its own layer and the
layers below it, imports inside functions included; ``pyproject.toml``'s import-linter
contract states the same list and the test command checks it. From the top:

1. ``study`` - presets, the headless notebook runner, units of work, a Dask cluster, the
   results page;
2. ``render`` - trees by status, masks, step views, the interactive explorer;
3. ``bench`` - wall-clock speed, the step-cost model (one stream and batches), memory,
   profiles, llama.cpp as a peer, and the ``auto`` weight-mode choice
   (:mod:`specviz.bench.auto`);
4. ``checks | heads`` - exactness checks on real models | training Medusa and EAGLE heads
   and counting draft vocabularies;
5. ``metrics`` - acceptance rate, tau, per-depth acceptance, intervals, calibration,
   other tools' logs;
6. ``decode`` - the engine, replays, records;
7. ``draft`` - every drafter (the trained heads' too) and the strategy registry;
8. ``models`` - loading (built-in GGUF pair, Hub ids, local paths, tiny random pairs), the
   KV cache and forward, fused layers, head modules;
9. ``quant`` - weight modes, their linear layers and compiled kernels;
10. ``attention | verify`` - tree attention | verification rules;
11. ``tree | sampling`` - the draft tree and everything derived from it | sampling rules;
12. ``data`` - the prompt set, result stores, atomic writes, the machine label;
13. ``locations | validate`` - the repository's folders | argument checks.

Each subpackage's ``__init__`` re-exports its public names, so ``from specviz.tree import
DraftTree`` and ``from specviz.tree.core import DraftTree`` are the same; ``import specviz``
alone imports nothing heavy.
"""

__version__ = "0.1.0"

"""Wall-clock measurement: end-to-end speed against transformers' own decoding
(:mod:`~specviz.bench.e2e`), cost curves and the step-cost model (:mod:`~specviz.bench.cost`),
and tree-attention timing (:mod:`~specviz.bench.attention`)."""

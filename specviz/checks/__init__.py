"""Long exactness checks on real models (:mod:`~specviz.checks.identity`)."""

"""Metrics: acceptance rate, tau (tokens per target call) and per-depth acceptance, from
live traces and from tables of replayed steps alike (:mod:`~specviz.metrics.acceptance`);
bootstrap intervals over prompts (:mod:`~specviz.metrics.intervals`); the draft's
calibration (:mod:`~specviz.metrics.calibration`); other tools' results (Spec-Bench answers,
vLLM, SGLang, llama.cpp and llama-server logs, vLLM's Prometheus counters) in the same tables (:mod:`~specviz.metrics.external`)."""

from specviz.metrics.acceptance import *  # noqa: F401,F403
from specviz.metrics.calibration import *  # noqa: F401,F403
from specviz.metrics.intervals import *  # noqa: F401,F403
from specviz.metrics.external import *  # noqa: F401,F403

"""The study: prompts (:mod:`~specviz.study.prompts`), result stores and tables
(:mod:`~specviz.study.store`) and the headless notebook runner (:mod:`~specviz.study.runner`)."""

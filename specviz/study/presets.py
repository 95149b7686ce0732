"""Study presets: which notebooks a study runs, in which order, with which parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["StudyConfigError", "NotebookRun", "Preset", "PRESETS", "get_preset"]


class StudyConfigError(ValueError):
    """A study that cannot start: unknown preset or notebook, bad prompt file or limit,
    a preset parameter the notebook does not declare, or the wrong Jupyter kernel."""


@dataclass(frozen=True)
class NotebookRun:
    """One notebook of a preset and the papermill parameters it runs with.

    Attributes:
        notebook: file name under ``notebooks/``, e.g. ``"05_tree_attention_timing.ipynb"``.
        parameters: values for the notebook's ``parameters`` cell (only names the
            notebook declares; the pipeline adds ``out_dir``, ``prompts_path`` and
            ``prompt_limit`` itself).
    """

    notebook: str
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.notebook.endswith(".ipynb") or "/" in self.notebook:
            raise ValueError(f"notebook must be a file name ending in .ipynb, got {self.notebook!r}")
        clash = sorted(set(self.parameters) & {"out_dir"})
        if clash:
            raise ValueError(f"{self.notebook}: {clash} is set by the pipeline, not by presets")
        object.__setattr__(self, "parameters", MappingProxyType(dict(self.parameters)))

    @property
    def stem(self) -> str:
        """File name without ``.ipynb``, e.g. ``"05_tree_attention_timing"``."""
        return self.notebook[: -len(".ipynb")]

    @property
    def number(self) -> str:
        """The two-digit prefix, e.g. ``"05"``."""
        return self.notebook.split("_", 1)[0]


@dataclass(frozen=True)
class Preset:
    """A named study configuration: which notebooks run, in order, with what parameters.

    Attributes:
        name: the ``--preset`` value.
        description: one line for ``--list`` and the README.
        runs: the notebooks in execution order.
        report: stem of the notebook exported as ``report.html`` (None: no report). It
            must be the last of ``runs``: it reads the tables of every notebook before it,
            and the runner re-runs it whenever one of those finished after it did.
        dtype: the weight mode of the real models in every notebook with a ``dtype``
            parameter when the command names none (``auto``: the fastest mode that passes
            the accuracy bar on this machine); None keeps each notebook's own (fp32).
        draft_dtypes: the draft's weight mode in every notebook with a ``draft_dtype``
            parameter when the command names none, by the target's resolved mode (``quick``:
            a ``w4a8-token`` draft beside a ``w8a8-token`` target); a target mode not listed
            keeps the draft in the target's mode.
    """

    name: str
    description: str
    runs: tuple[NotebookRun, ...]
    report: str | None = None
    dtype: str | None = None
    draft_dtypes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError(f"preset {self.name!r} runs no notebooks")
        names = [r.notebook for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"preset {self.name!r} lists a notebook twice: {names}")
        if self.report is not None and self.report not in {r.stem for r in self.runs}:
            raise ValueError(f"preset {self.name!r}: report notebook {self.report!r} is not among its runs")
        if self.report is not None and self.runs[-1].stem != self.report:
            raise ValueError(f"preset {self.name!r}: report notebook {self.report!r} must run last (it reads the "
                             f"tables of the notebooks before it), not before {self.runs[-1].notebook}")


_QUICKSTART = "01_quickstart.ipynb"
_TREES = "02_trees_masks_attention.ipynb"
_ACCEPTANCE = "03_chain_tree_dynamic.ipynb"
_RULES = "04_verification_rules.ipynb"
_TIMING = "05_tree_attention_timing.ipynb"
_SPEED = "06_end_to_end_speed.ipynb"
_REPORT = "08_report.ipynb"
_LOOKAHEAD = "09_lookahead.ipynb"
_HEADS = "10_draft_heads.ipynb"
_SERVING = "11_serving.ipynb"

#: The default study's notebook runs, the report last; ``standard`` replaces its acceptance study (03).
#: A notebook's own defaults are the small run nbval re-executes in the test command; the presets name
#: the study's sizes wherever they differ from those.
_QUICK_RUNS = (
    NotebookRun(_QUICKSTART, {"threads": 0}),
    NotebookRun(_TREES),
    NotebookRun(_ACCEPTANCE, {"prompt_limit": 7, "max_new_tokens": 32, "budgets": [4, 8, 16, 32, 64],
                              "dynamic_prompts": 0, "cross_check": False, "sampled_stride": 16, "threads": 0}),
    NotebookRun(_RULES, {"trials": 2000, "expected_trees": 100, "prompt_limit": 2, "real_max_new_tokens": 32,
                         "real_stride": 16}),
    NotebookRun(_TIMING, {"batch_sizes": [1, 2, 4], "prefix_lens": [128, 512, 1024],
                          "budgets": [4, 8, 16, 32, 64], "warmup": 2, "repeats": 5}),
    NotebookRun(_SPEED, {"prompt_limit": 2, "max_new_tokens": 32,
                         "methods": ["chain-k4", "dynamic-w4-d5-b16", "ngram", "switch", "choose"],
                         "sequoia_budgets": [8], "cost_sizes": [1, 2, 4, 8, 16, 64], "cost_prefix": 200,
                         "profile_tokens": 8,
                         "probe_dtypes": [], "threads": 0}),
    NotebookRun(_LOOKAHEAD, {"prompt_limit": 2, "max_new_tokens": 32, "sweep_windows": [5], "sweep_ngrams": [4],
                             "sweep_guesses": [5], "others": ["ngram"], "cost_sizes": [1, 2, 4, 8, 16, 32],
                             "cost_prefix": 128}),
    NotebookRun(_HEADS, {"prompt_limit": 2, "max_new_tokens": 32, "train_prompts": 2, "train_tasks": 8,
                         "train_tokens": 48, "train_steps": 0, "train_minutes": 0.5, "budgets": [4, 16],
                         "others": ["chain-k4", "ngram"]}),
    NotebookRun(_SERVING, {"prompt_limit": 2, "batches": [1, 4], "max_new_tokens": 12, "repeats": 2,
                           "methods": ["chain-k2", "ngram"], "adaptive_max_k": 4, "cost_tokens": [1, 3, 6],
                           "cost_prefix": 128, "threads": 0}),
    NotebookRun(_REPORT),
)

#: Notebook 03 in ``standard``: every prompt x 128 tokens. References are decoded 63 at a
#: time and the dynamic-tree replays (on every third prompt) 21 at a time, with all cores.
_STANDARD_ACCEPTANCE = {"prompt_limit": 0, "max_new_tokens": 128, "budgets": [4, 8, 16, 32, 64],
                        "threads": 0, "reference_batch": 63, "dynamic_prompts": 21, "dynamic_batch": 21,
                        "cross_check": False, "sampled_prompts": 4, "sampled_stride": 32}

#: Notebook 11 in ``standard``: the batch sweep of every strategy family (chain, static tree, dynamic tree,
#: n-gram, Medusa heads, the default cascade) on 16 prompts, two rounds, in fp32 (every row is checked token for
#: token); ``full`` adds batch 32, three rounds, 32 prompts and 64 tokens
_STANDARD_SERVING = {"prompt_limit": 16, "batches": [1, 2, 4, 8, 16], "max_new_tokens": 32, "repeats": 2,
                     "methods": ["chain-k2", "tree-2x2x1", "dynamic-w4-d5-b16", "ngram", "medusa", "fallback"],
                     "adaptive_max_k": 4, "cost_tokens": [1, 2, 3, 5, 8, 13, 22], "cost_prefix": 128,
                     "cost_repeats": 1, "threads": 0}
_FULL_SERVING = {**_STANDARD_SERVING, "batches": [1, 2, 4, 8, 16, 32], "max_new_tokens": 64, "repeats": 3,
                 "prompt_limit": 32}

#: Every notebook at its smallest size, the report last (``smoke``, and ``tiny`` on the tiny pair).
_SMOKE_RUNS = (
    NotebookRun(_QUICKSTART, {"max_new_tokens": 8, "tree_branching": [2, 1], "threads": 0}),
    NotebookRun(_TREES),
    NotebookRun(_ACCEPTANCE, {"prompt_limit": 1, "max_new_tokens": 8, "budgets": [4], "layer_sweep": [],
                              "cross_check": False, "sampled_budget": 4, "sampled_stride": 8, "threads": 0}),
    NotebookRun(_RULES, {"trials": 100, "expected_trees": 10, "real_max_new_tokens": 8,
                         "real_temperatures": [0.0, 1.0], "real_tree_branching": [2, 1],
                         "real_chain_length": 2}),
    NotebookRun(_TIMING, {"batch_sizes": [1], "prefix_lens": [16], "budgets": [8],
                          "warmup": 0, "repeats": 1}),
    NotebookRun(_SPEED, {"max_new_tokens": 8, "methods": ["chain-k2", "ngram"], "sequoia_budgets": [4],
                         "cost_sizes": [1, 4], "cost_prefix": 32, "cost_repeats": 1, "plan_budgets": [1, 2, 4],
                         "plan_depths": [1, 2], "probe_dtypes": [],
                         "profiled": ["chain-k2"], "profile_tokens": 4, "threads": 0}),
    NotebookRun(_LOOKAHEAD, {"max_new_tokens": 8, "sweep_windows": [5], "sweep_ngrams": [4],
                             "sweep_guesses": [5], "context_pool": False, "others": ["ngram"],
                             "cost_sizes": [1, 16], "cost_prefix": 32, "cost_repeats": 1, "lab_trials": 200,
                             "threads": 0}),
    NotebookRun(_HEADS, {"max_new_tokens": 8, "train_prompts": 1, "train_tasks": 2, "train_tokens": 16,
                         "train_steps": 5, "budgets": [4], "others": [], "timed": False, "threads": 0}),
    NotebookRun(_SERVING, {"batches": [1, 2], "max_new_tokens": 4, "methods": ["chain-k2"], "adaptive_max_k": 2,
                           "cost_tokens": [1, 3], "cost_prefix": 16, "model_batches": [1, 8, 64], "threads": 0}),
    NotebookRun(_REPORT),
)

#: Notebooks that take ``models="tiny"`` (the random tiny pair instead of the built-in one), with
#: what else they need on its 2 layers
_TINY_CAPABLE: Mapping[str, Mapping[str, Any]] = {_QUICKSTART: {}, _ACCEPTANCE: {"self_spec_layers": 1}, _RULES: {},
                                                  _SPEED: {}, _LOOKAHEAD: {}, _HEADS: {"vocab": 0}, _SERVING: {}}


def _on_tiny_models(runs: tuple[NotebookRun, ...]) -> tuple[NotebookRun, ...]:
    """``runs`` with every notebook that can use it on the random tiny pair."""
    return tuple(NotebookRun(r.notebook, {**r.parameters, "models": "tiny", **_TINY_CAPABLE[r.notebook]})
                 if r.notebook in _TINY_CAPABLE else r for r in runs)


#: The presets, by name. ``smoke`` is the smallest run of every notebook (its notebooks use all of
#: torch's threads, as it times nothing worth keeping), ``tiny`` smoke on the random tiny pair
#: in every notebook that loads models (the tests run it), ``quick`` the default study, ``standard``
#: quick with the acceptance study (03) on every prompt x 128 tokens (the committed reference
#: results), ``full`` everything at full size. The notebooks run in the order of their numbers
#: except the report (08), which runs last, after 09 and 10, and reads the tables of all the others.
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (
    Preset("smoke", "every notebook at its smallest size: checks an installation in a few minutes", _SMOKE_RUNS,
           report="08_report"),
    Preset("tiny", "smoke on the random tiny pair in every notebook that loads models: "
           "checks the pipeline in about two minutes", _on_tiny_models(_SMOKE_RUNS), report="08_report"),
    Preset("quick", "the default study, in auto's weight mode (the speed notebook's draft in w4a8-token beside a "
           "w8a8-token target): 10-12 minutes on a 2-core CPU in w8a8-token once the models are converted (28 in "
           "fp32), plus auto's one-time probe of the machine", _QUICK_RUNS,
           report="08_report", dtype="auto", draft_dtypes=MappingProxyType({"w8a8-token": "w4a8-token"})),
    Preset("standard", "the acceptance study (03) on every prompt x 128 tokens, the rest as in quick, all in "
           "fp32, the exactness reference: the committed reference results (outputs/reference)", tuple(
               NotebookRun(_ACCEPTANCE, _STANDARD_ACCEPTANCE) if r.notebook == _ACCEPTANCE
               else NotebookRun(_SERVING, _STANDARD_SERVING) if r.notebook == _SERVING else r
               for r in _QUICK_RUNS), report="08_report"),
    Preset("full", "every prompt and budget, longer generations, more repeats and trials", (
        NotebookRun(_QUICKSTART, {"max_new_tokens": 128}),
        NotebookRun(_TREES),
        NotebookRun(_ACCEPTANCE, {"prompt_limit": 0, "max_new_tokens": 128, "budgets": [4, 8, 16, 32, 64],
                                  "dynamic_depth": 6, "dynamic_prompts": 0, "sampled_prompts": 7, "sampled_stride": 16,
                                  "threads": 0, "reference_batch": 32, "dynamic_batch": 16}),
        NotebookRun(_RULES, {"trials": 10000, "expected_trees": 400, "prompt_limit": 7, "real_max_new_tokens": 128,
                             "real_stride": 16}),
        NotebookRun(_TIMING, {"batch_sizes": [1, 2, 4, 8], "prefix_lens": [128, 512, 1024, 2048],
                              "budgets": [4, 8, 16, 32, 64, 128], "warmup": 3, "repeats": 10}),
        NotebookRun(_SPEED, {"prompt_limit": 7, "max_new_tokens": 128,
                             "methods": ["chain-k2", "chain-k2-v32768", "chain-k4", "chain-k8", "tree-2x2x1",
                                         "dynamic-w4-d5-b16", "adaptive", "ngram", "ngram-trie", "merged", "switch", "choose",
                                         "self-spec-L24-k2"],
                             "sequoia_budgets": [4, 8, 16, 32], "probe_dtypes": ["bf16"],
                             "cost_sizes": [1, 2, 4, 8, 16, 32, 64, 128], "cost_prefix": 200,
                             "cost_repeats": 3, "profiled": ["specviz-plain", "chain-k2", "chain-k4",
                                                             "dynamic-w4-d5-b16", "ngram", "merged"],
                             "profile_tokens": 64}),
        NotebookRun(_LOOKAHEAD, {"prompt_limit": 14, "max_new_tokens": 128, "sweep_windows": [3, 5, 7, 10],
                                 "sweep_ngrams": [3, 4, 5], "sweep_guesses": [2, 5, 10], "sweep_prompts": 2,
                                 "others": ["ngram", "ngram-trie", "chain-k4", "dynamic-w4-d5-b16", "jacobi-k5"],
                                 "cost_sizes": [1, 2, 4, 8, 16, 32, 64], "cost_prefix": 128, "cost_repeats": 3,
                                 "lab_trials": 10000}),
        NotebookRun(_HEADS, {"prompt_limit": 0, "max_new_tokens": 128, "train_prompts": 64, "train_tasks": 256,
                             "train_tokens": 256, "train_steps": 0, "train_minutes": 30.0, "vocab": 16384, "train_batch": 8,
                             "train_window": 128, "train_precision": "auto", "budgets": [4, 8, 16, 32, 64],
                             "others": ["chain-k4", "ngram", "ngram-trie"]}),
        NotebookRun(_SERVING, _FULL_SERVING),
        NotebookRun(_REPORT),
    ), report="08_report"),
)})


def get_preset(name: str | Preset) -> Preset:
    """The preset called ``name`` (a :class:`Preset` is returned as it is)."""
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise StudyConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]

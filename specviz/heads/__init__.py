"""Trained draft heads: Medusa heads and an EAGLE-style feature head on the target's own
hidden states, trained by self-distillation without downloading anything.

* :mod:`~specviz.heads.features` - the target's last hidden states (:func:`target_features`),
  cached on disk for a training set (:func:`extract_features`, which takes those the
  corpus kept while the target decoded it);
* :mod:`~specviz.heads.corpus` - training prompts of the study's task kinds
  (:func:`task_prompts`), written by the target itself (:func:`self_prompts`) and from
  the Python standard library (and optionally a Spec-Bench file minus the evaluation
  categories) continued by the target
  (:func:`build_corpus` -> :class:`Corpus`);
* :mod:`~specviz.heads.modules` - :class:`MedusaHeads`, :class:`EagleHead` and the reduced
  draft vocabulary (:func:`reduced_vocab`, :func:`out_of_vocab_share`);
* :mod:`~specviz.heads.training` - :func:`train_heads` with checkpoints, resume and a cache
  keyed by target, kind, configuration and data; :func:`load_heads`; :func:`head_accuracy`;
* :mod:`~specviz.heads.drafters` - :class:`MedusaDrafter` and :class:`EagleDrafter`, also
  registered as the ``medusa``, ``eagle`` and ``eagle-chain`` strategies of
  :mod:`specviz.draft.registry`.

Command line: ``python -m specviz.heads train --kind medusa|eagle --target NAME
--minutes N`` trains into the cache; ``python -m specviz.heads info DIR`` describes a
result.
"""

from specviz.heads.corpus import *  # noqa: F401,F403
from specviz.heads.drafters import *  # noqa: F401,F403
from specviz.heads.features import *  # noqa: F401,F403
from specviz.heads.modules import *  # noqa: F401,F403
from specviz.heads.training import *  # noqa: F401,F403

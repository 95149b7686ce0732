"""Training draft heads: Medusa heads and an EAGLE-style feature head on the target's own
hidden states, trained by self-distillation without downloading anything, and the draft
vocabulary counted the same way.

* :mod:`~specviz.heads.corpus` - training prompts of the study's task kinds
  (:func:`task_prompts`), written by the target itself (:func:`self_prompts`) and from
  the Python standard library (and optionally a Spec-Bench file minus the evaluation
  categories) continued by the target (:func:`build_corpus` -> :class:`Corpus`);
* :mod:`~specviz.heads.tasks` - the templates of the task-kind prompts (:data:`TASK_KINDS`,
  slot values, word problems, prose passages of the Python reference);
* :mod:`~specviz.heads.training` - :func:`train_heads` with checkpoints, resume and a cache
  keyed by target, kind, configuration and data; :func:`head_accuracy`;
* :mod:`~specviz.heads.config` - :class:`HeadConfig`, the training settings, and
  :func:`training_precision`;
* :mod:`~specviz.heads.losses` - the batches and the Medusa and EAGLE losses a training
  step computes;
* :mod:`~specviz.heads.distill` - :func:`distill_draft`, a draft model fine-tuned towards
  its target's distributions (LoRA, a choice of divergence, held-out agreement), saved
  as a model directory that goes wherever a draft goes;
* :mod:`~specviz.heads.vocab` - :func:`~specviz.heads.vocab.build_draft_vocabulary`, the
  ranking behind the ``-v<N>`` strategies (also ``python -m specviz.heads.vocab``, so its
  names are imported from the module itself).

What training produces is used below this layer: the head modules
(:mod:`specviz.models.heads`), the target's features (:mod:`specviz.models.features`),
results on disk (:mod:`specviz.models.saved_heads`) and the drafters
(:mod:`specviz.draft.heads`, the registry's ``medusa``, ``eagle`` and ``eagle-chain``
strategies); this package re-exports their public names.

Command line: ``python -m specviz.heads train --kind medusa|eagle --target NAME
--minutes N`` trains into the cache; ``python -m specviz.heads distill --target NAME --draft
NAME`` distils a draft; ``python -m specviz.heads info DIR`` describes a
result; ``python -m specviz.heads.vocab`` counts a draft vocabulary.
"""

from specviz.draft.heads import *  # noqa: F401,F403
from specviz.heads.corpus import *  # noqa: F401,F403
from specviz.heads.distill import *  # noqa: F401,F403
from specviz.heads.training import *  # noqa: F401,F403
from specviz.models.features import *  # noqa: F401,F403
from specviz.models.heads import *  # noqa: F401,F403
from specviz.models.saved_heads import *  # noqa: F401,F403

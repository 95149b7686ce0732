"""Distilling a draft model towards its target (DistillSpec, Zhou et al., ICLR 2024).

A draft proposes and the target keeps what it agrees with, so a draft trained to imitate
the target's next-token distributions is accepted more often. :func:`distill_draft`
fine-tunes a draft model on its target's own distributions:

* data: the heads' self-distilled corpus (:func:`~specviz.heads.corpus.build_corpus`:
  prompts continued by the target) and, with ``on_policy``, continuations of the same
  prompts written by the draft itself before training (:func:`draft_written`), which
  DistillSpec finds often transfer better than the teacher's own text;
* teacher: the target's next-token distribution at every continuation position: its LM
  head over its last hidden states, computed once and cached
  (:func:`~specviz.models.features.extract_features`);
* student: the draft with LoRA adapters (``peft``) on every projection of its decoder
  layers, trained in fp32 with AdamW on whole sequences (a causal model needs its prefix);
* loss: a divergence between the target's and the draft's distributions
  (:data:`DIVERGENCES`: forward KL, reverse KL, Jensen-Shannon or total variation),
  averaged over continuation positions;
* held-out measure: on a held-out share of the sequences, the share of
  positions where the draft's top token is the target's (how often a greedy chain's token
  is accepted) and the mean ``1 - TVD`` (the acceptance probability of a sampled draft
  token), before training and at every evaluation; the adapters of the best evaluation
  are the ones kept.

The result is a transformers model directory (adapters merged into the weights, the
tokenizer beside them, ``specviz_distill.json`` naming the target, the draft, the data and
the settings) in the specviz cache, keyed by all of them. It goes wherever a draft goes:
``load_pair(target, draft=path)``, ``--draft PATH`` of the benchmark, the study's models;
:func:`~specviz.models.loading.load_pair` refuses it beside another target. A checkpoint
(adapters, optimizer, step, sampler state) is written every ``checkpoint_minutes`` and on
Ctrl-C, and the same call resumes from it; a finished result is returned as it is.

Dimension legend: B = sequences per step, T = tokens of a padded batch, H = hidden size,
V = vocabulary, n = continuation positions.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from specviz.data.store import atomic_write_bytes, atomic_write_text
from specviz.heads.corpus import Corpus
from specviz.heads.training import validation_split
from specviz.models.features import extract_features, load_features
from specviz.models.loading import DISTILLED_META
from specviz.models.saved_heads import name_slug
from specviz.models.types import LoadedModel
from specviz.validate import check_choice, check_int

__all__ = ["DIVERGENCES", "LORA_TARGETS", "DistillConfig", "DistillResult", "divergence",
           "draft_written", "distill_draft"]

#: the losses :func:`divergence` computes, teacher ``p`` (the target) and student ``q``
#: (the draft): forward KL(p || q), reverse KL(q || p), Jensen-Shannon and total variation
DIVERGENCES: tuple[str, ...] = ("fkl", "rkl", "jsd", "tvd")
#: the draft's projections that get LoRA adapters
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DistillConfig:
    """How :func:`distill_draft` trains.

    Attributes:
        divergence: the loss, one of :data:`DIVERGENCES`.
        lora_rank, lora_alpha: the adapters' rank and scale (``alpha / rank`` multiplies them).
        lr: AdamW's learning rate.
        batch_size: sequences per optimizer step.
        max_tokens: the longest sequence trained on (prompt and continuation); longer ones
            are cut at the end.
        validation: share of the sequences held out to measure agreement (0: none; the
            last adapters are kept).
        eval_every: optimizer steps between held-out evaluations.
        seed: the adapters' initialisation, the split and the order of the batches.
        checkpoint_minutes: time between checkpoints.
    """

    divergence: str = "fkl"
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lr: float = 2e-4
    batch_size: int = 2
    max_tokens: int = 768
    validation: float = 0.1
    eval_every: int = 20
    seed: int = 0
    checkpoint_minutes: float = 2.0

    def __post_init__(self) -> None:
        check_choice("divergence", self.divergence, DIVERGENCES)
        for name in ("lora_rank", "batch_size", "eval_every"):
            check_int(name, getattr(self, name))
        check_int("max_tokens", self.max_tokens, 2)
        check_int("seed", self.seed, 0)
        for name in ("lora_alpha", "lr", "checkpoint_minutes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.validation < 1:
            raise ValueError(f"validation must be a share in [0, 1), got {self.validation!r}")


@dataclass(frozen=True)
class DistillResult:
    """A finished distillation: the model directory, its training and its held-out
    agreement (top-1 and 1-TVD) before training and with the adapters kept (None without validation)."""

    path: Path
    step: int
    loss: float
    before: dict | None
    after: dict | None


def divergence(teacher: torch.Tensor, student: torch.Tensor, kind: str) -> torch.Tensor:
    """The mean over positions of a divergence between two next-token distributions given
    as logits ``(n, V)`` (the teacher's is not differentiated through): ``kind`` one of
    :data:`DIVERGENCES`."""
    check_choice("divergence", kind, DIVERGENCES)
    lp = torch.log_softmax(teacher.detach().float(), dim=-1)  # (n, V)
    lq = torch.log_softmax(student.float(), dim=-1)
    if kind == "fkl":
        per = (lp.exp() * (lp - lq)).sum(-1)
    elif kind == "rkl":
        per = (lq.exp() * (lq - lp)).sum(-1)
    elif kind == "jsd":
        lm = torch.logaddexp(lp, lq) - math.log(2.0)
        per = 0.5 * ((lp.exp() * (lp - lm)).sum(-1) + (lq.exp() * (lq - lm)).sum(-1))
    else:
        per = 0.5 * (lp.exp() - lq.exp()).abs().sum(-1)
    return per.mean()


@dataclass(frozen=True)
class _Example:
    ids: torch.Tensor  # (T,) token ids
    start: int  # the first position whose next token is trained (the prompt's last)
    feats: torch.Tensor  # (T, H) the target's last hidden states


def _examples(corpus: Corpus, feats: Sequence[torch.Tensor], max_tokens: int) -> list[_Example]:
    out = []
    for seq, prompt, f in zip(corpus.sequences, corpus.prompt_lengths, feats):
        n = min(len(seq), max_tokens)
        start = max(prompt, 1) - 1
        if n - 1 > start:
            out.append(_Example(torch.tensor(seq[:n]), start, f[:n]))
    return out


def _logits(student, teacher, batch: Sequence[_Example], grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's and the target's logits ``(n, V)`` at every trained position of ``batch``
    (one right-padded forward of the draft; ``teacher``, the target's LM head, over its
    features)."""
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for b, e in enumerate(batch):
        ids[b, :len(e.ids)], mask[b, :len(e.ids)] = e.ids, 1
    base = student.get_base_model()
    with torch.set_grad_enabled(grad):
        hidden = base.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
        kept = torch.cat([hidden[b, e.start:len(e.ids) - 1] for b, e in enumerate(batch)])  # (n, H)
        drafted = base.lm_head(kept)  # (n, V)
    with torch.no_grad():
        wanted = teacher(torch.cat([e.feats[e.start:len(e.ids) - 1] for e in batch]).float())  # (n, V)
    return drafted, wanted


@torch.no_grad()
def _agreement(student, teacher, examples: Sequence[_Example], batch_size: int = 2) -> dict:
    """``{"top1", "accept", "positions"}`` on ``examples``: the share of positions where the
    draft's top token is the target's, and the mean ``1 - TVD`` between their distributions."""
    same = accept = positions = 0
    for i in range(0, len(examples), batch_size):
        drafted, wanted = _logits(student, teacher, examples[i:i + batch_size], grad=False)
        same += int((drafted.argmax(-1) == wanted.argmax(-1)).sum())
        accept += float((1 - divergence(wanted, drafted, "tvd")) * len(wanted))
        positions += len(wanted)
    return {"top1": same / max(positions, 1), "accept": accept / max(positions, 1), "positions": positions}


def draft_written(draft: LoadedModel, corpus: Corpus, n: int, max_new_tokens: int, store: Path,
                  batch_size: int = 16) -> Corpus:
    """The prompts of ``corpus``'s first ``n`` sequences continued greedily by ``draft``
    (``max_new_tokens`` each), kept in ``store`` (a JSON file; a rerun reads it back)."""
    from specviz.decode.plain import plain_generate_batch

    check_int("n", n)
    prompts = [list(corpus.sequences[i][:corpus.prompt_lengths[i]]) for i in range(min(n, len(corpus)))]
    if store.exists():
        seqs = json.loads(store.read_text())["sequences"]
    else:
        results = plain_generate_batch(draft, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                       chat=False)
        seqs = [p + list(r.output_ids) for p, r in zip(prompts, results)]
        atomic_write_text(store, json.dumps({"draft": draft.name, "sequences": seqs}) + "\n")
    keep = [(s, len(p)) for s, p in zip(seqs, prompts) if len(s) > len(p)]
    return Corpus.from_sequences([s for s, _ in keep], [n for _, n in keep])


def _slug(name: str) -> str:
    """A model's name (a directory: its last part) for a cache directory's name."""
    return name_slug(Path(name).name or name)[:48]


def _key(target: LoadedModel, draft: LoadedModel, data: Corpus, config: DistillConfig) -> dict:
    return {"target": target.name, "target_weight_mode": target.weight_mode, "draft": draft.name,
            "data_sha256": data.sha256, "config": asdict(config)}


def _split(examples: list[_Example], share: float, seed: int) -> tuple[list[_Example], list[_Example]]:
    """Training and held-out examples, held out as the heads' training holds out sequences."""
    held = set(validation_split(len(examples), share, seed)) if examples else set()
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


class _Run:
    """One distillation's student, optimizer, sampler and progress, resumed from ``out``'s
    checkpoint where it has one; :meth:`train` runs the steps, :meth:`finish` writes the model."""

    def __init__(self, target: LoadedModel, draft: LoadedModel, config: DistillConfig, out: Path, meta: dict,
                 held: list[_Example]) -> None:
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

        self.config, self.out, self.meta, self.held, self.draft = config, out, meta, held, draft
        self._adapters, self._set_adapters = get_peft_model_state_dict, set_peft_model_state_dict
        torch.manual_seed(config.seed)
        with warnings.catch_warnings():  # peft asks transformers a question transformers has renamed
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.student = get_peft_model(copy.deepcopy(draft.model).float().cpu().train(),
                                          LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                                     lora_dropout=0.0, target_modules=list(LORA_TARGETS)))
        head = target.model.get_output_embeddings()
        self.teacher = lambda feats: head(feats.to(target.device)).float().cpu()  # (n, H) -> (n, V)
        self.optimizer = torch.optim.AdamW([p for p in self.student.parameters() if p.requires_grad], lr=config.lr)
        self.order = torch.Generator().manual_seed(config.seed)
        self.state = {"step": 0, "elapsed_s": 0.0, "loss": math.nan, "history": [], "best": None, "before": None}
        ckpt = out / "checkpoint.pt"
        if ckpt.exists():
            saved = torch.load(ckpt, map_location="cpu", weights_only=False)
            self._set_adapters(self.student, saved["adapters"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.order.set_state(saved["order"])
            self.state = saved["state"]
        elif held:  # the untrained adapters (their second factor is zero) stand for the draft itself
            self.state["before"] = _agreement(self.student, self.teacher, held, config.batch_size)
            self.state["best"] = (self.state["before"]["top1"], 0, copy.deepcopy(self._adapters(self.student)))

    def save(self) -> None:
        """The checkpoint and the unfinished run's metadata, written atomically."""
        buf = io.BytesIO()
        torch.save({"adapters": self._adapters(self.student), "optimizer": self.optimizer.state_dict(),
                    "order": self.order.get_state(), "state": self.state}, buf)
        atomic_write_bytes(self.out / "checkpoint.pt", buf.getvalue())
        atomic_write_text(self.out / DISTILLED_META, json.dumps(
            {**self.meta, **{k: self.state[k] for k in ("step", "loss", "before")}, "finished": False}, indent=1) + "\n")

    def evaluate(self) -> None:
        found = _agreement(self.student, self.teacher, self.held, self.config.batch_size)
        self.state["history"].append({"step": self.state["step"], **found})
        if self.state["best"] is None or found["top1"] > self.state["best"][0]:
            self.state["best"] = (found["top1"], self.state["step"], copy.deepcopy(self._adapters(self.student)))

    def train(self, train: list[_Example], steps: int | None, minutes: float | None, progress: bool) -> None:
        """Optimizer steps until the budget is spent; a checkpoint every ``checkpoint_minutes``
        and on Ctrl-C (then the ``KeyboardInterrupt`` propagates)."""
        from tqdm import tqdm

        cfg, state = self.config, self.state
        start, last_save = time.monotonic() - state["elapsed_s"], time.monotonic()
        with tqdm(total=steps, initial=state["step"], desc=f"distilling {self.draft.name}", unit="step",
                  file=sys.stderr, disable=not progress) as bar:
            try:
                while (steps is None or state["step"] < steps) and \
                        (minutes is None or time.monotonic() - start < minutes * 60):
                    picks = torch.randint(len(train), (cfg.batch_size,), generator=self.order).tolist()
                    drafted, wanted = _logits(self.student, self.teacher, [train[i] for i in picks], grad=True)
                    loss = divergence(wanted, drafted, cfg.divergence)
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    self.optimizer.step()
                    state.update(step=state["step"] + 1, loss=float(loss.detach()),
                                 elapsed_s=time.monotonic() - start)
                    if self.held and state["step"] % cfg.eval_every == 0:
                        self.evaluate()
                    bar.update(1)
                    bar.set_postfix(loss=f"{state['loss']:.4f}", **({"held_out_top1": f"{state['history'][-1]['top1']:.3f}"}
                                                                   if state["history"] else {}))
                    if time.monotonic() - last_save >= cfg.checkpoint_minutes * 60:
                        self.save()
                        last_save = time.monotonic()
            except KeyboardInterrupt:
                self.save()
                raise

    def finish(self) -> DistillResult:
        """The best adapters merged into the draft's weights, saved with its tokenizer and
        the finished metadata; the checkpoint removed."""
        state, held = self.state, self.held
        if held and (not state["history"] or state["history"][-1]["step"] != state["step"]):
            self.evaluate()
        self.save()
        if held:
            self._set_adapters(self.student, state["best"][2])
        after = next((h for h in state["history"] if h["step"] == state["best"][1]), state["before"]) if held else None
        self.student.merge_and_unload().eval().save_pretrained(self.out)
        self.draft.tokenizer.save_pretrained(self.out)
        atomic_write_text(self.out / DISTILLED_META, json.dumps(
            {**self.meta, "step": state["step"], "loss": state["loss"], "elapsed_s": round(state["elapsed_s"], 1),
             "before": state["before"], "after": after, "kept_step": state["best"][1] if held else state["step"],
             "history": state["history"], "finished": True}, indent=1) + "\n")
        (self.out / "checkpoint.pt").unlink(missing_ok=True)  # the model directory is the result
        return DistillResult(self.out, state["step"], state["loss"], state["before"], after)


def distill_draft(target: LoadedModel, draft: LoadedModel, corpus: Corpus, *, on_policy: int = 0,
                  on_policy_tokens: int = 128, minutes: float | None = None, steps: int | None = None,
                  config: DistillConfig | None = None, out_dir: str | os.PathLike | None = None,
                  progress: bool = True) -> DistillResult:
    """Distil ``draft`` towards ``target`` on ``corpus`` (and, with ``on_policy`` > 0, on
    that many of its prompts continued by the draft, ``on_policy_tokens`` each) until
    ``steps`` optimizer steps or ``minutes`` of training (over every call on the result
    directory) are done.

    Args:
        target: the target (any weight mode: its LM head and features are the teacher).
        draft: the draft, loaded in fp32 (it is copied; the copy is trained).
        corpus: target-written sequences (:func:`~specviz.heads.corpus.build_corpus`).
        out_dir: the result directory (default: the specviz cache, keyed by target, draft,
            data and ``config``).

    Returns:
        the :class:`DistillResult`; its ``path`` is the model directory to load as a draft.

    Raises:
        ValueError: neither ``steps`` nor ``minutes``, a draft not in fp32, tokenizers or
            vocabularies that differ, or an ``out_dir`` holding another run.
    """
    from specviz.models.builtin import cache_dir
    from specviz.models.loading import check_same_tokenizer

    config = config or DistillConfig()
    if steps is None and minutes is None:
        raise ValueError("give steps or minutes (or both)")
    if steps is not None:
        check_int("steps", steps)
    if minutes is not None and not minutes > 0:
        raise ValueError(f"minutes must be > 0, got {minutes!r}")
    if draft.weight_mode != "fp32":
        raise ValueError(f"distil the draft in fp32 (got {draft.weight_mode}); load it with dtype='fp32'")
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"target and draft vocabularies differ in size: {target.vocab_size} vs {draft.vocab_size}")
    root, data = cache_dir() / "distill", corpus
    if on_policy:
        written = draft_written(draft, corpus, on_policy, on_policy_tokens,
                                root / "on-policy" / f"{_slug(draft.name)}-{corpus.sha256[:16]}-{on_policy}"
                                f"-{on_policy_tokens}.json")
        data = Corpus.from_sequences(corpus.sequences + written.sequences,
                                     corpus.prompt_lengths + written.prompt_lengths,
                                     lambda i: corpus.features(i) if corpus.features and i < len(corpus) else None)
    key = _key(target, draft, data, config)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(out_dir) if out_dir is not None else \
        root / f"{_slug(draft.name)}-for-{_slug(target.name)}-{config.divergence}-{digest}"
    out.mkdir(parents=True, exist_ok=True)
    if (out / DISTILLED_META).exists():
        meta = json.loads((out / DISTILLED_META).read_text())
        if meta.get("key") != key:
            raise ValueError(f"{out} holds a distillation of other settings or data; give another out_dir")
        if meta.get("finished"):
            return DistillResult(out, meta["step"], meta["loss"], meta.get("before"), meta.get("after"))
    feats_dir = root / "features" / f"{_slug(target.name)}-{target.weight_mode}-{data.sha256[:16]}"
    extract_features(target, data.sequences, feats_dir, sha256=data.sha256, progress=progress, kept=data.features)
    train, held = _split(_examples(data, load_features(feats_dir, sha256=data.sha256), config.max_tokens),
                         config.validation, config.seed)
    if not train:
        raise ValueError("no sequence has a continuation to train on")
    run = _Run(target, draft, config, out, {"key": key, "target": target.name, "draft": draft.name,
                                           "data": data.summary(), "on_policy": on_policy, "config": asdict(config)},
               held)
    run.train(train, steps, minutes, progress)
    return run.finish()

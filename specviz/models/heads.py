"""The trained draft heads: Medusa heads and an EAGLE-style feature head, plus the
reduced draft vocabulary both can score.

* :class:`MedusaHeads` - K residual blocks over the target's last hidden state at a
  position ``t``; head ``k`` (1-based) scores the token at ``t + 1 + k`` (the target's
  own LM head already gives ``t + 1``) through the target's frozen LM head;
* :class:`EagleHead` - one decoder layer of the target's own architecture over
  ``fc(concat(feature_t, embedding(token_{t+1})))`` that predicts the target's next
  feature ``feature_{t+1}``; the target's LM head turns a predicted feature into draft
  logits, and drafting feeds predicted features back in;
* :func:`reduced_vocab`, :func:`out_of_vocab_share` - the ``N`` most frequent tokens of
  the training data, the only ones a head with a ``vocab_map`` scores (verification
  still uses the target's full vocabulary, so decoding stays lossless).

Both modules share the target's frozen weights (LM head, and the embeddings for EAGLE)
without copying them (an integer-mode target's packed LM head is dequantized once instead):
those are non-persistent buffers, so a module's ``state_dict``
holds only what training changed (plus the ``vocab_map``). Build them from a target with
``from_target``.

Dimension legend: B = batch, T = positions, H = hidden size, K = Medusa heads,
V = full vocabulary, W = scored vocabulary (V, or the reduced N), S = cached slots,
n = new positions.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specviz.quant.extension import vnni_kernel
from specviz.models.fused import FUSED_MAX_TOKENS, causal_over_cache
from specviz.models.kvcache import additive_mask, crop_cache, decoder_of, reserve_slots
from specviz.models.types import LoadedModel
from specviz.quant.weights import weight_mode_of
from specviz.validate import check_int

__all__ = [
    "MedusaHeads",
    "EagleHead",
    "reduced_vocab",
    "out_of_vocab_share",
]


def _lm_head(target: LoadedModel) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM head weight ``(V, H)`` and bias (or None), detached: the target's own
    tensors (shared storage), or, for an LM head in an integer weight mode (w8a8-token, w4a8-token),
    the weights its kernel multiplies by, dequantized into the target's activation dtype."""
    head = target.model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    bias = None if bias is None else bias.detach()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.detach(), bias
    if head is not None and hasattr(head, "dequantized_weight"):
        dtype = target.model.dtype
        return head.dequantized_weight().to(dtype), (None if bias is None else bias.to(dtype))
    raise ValueError(f"target {target.name!r} has no linear LM head to share with draft heads")


def _check_vocab_map(vocab_map: torch.Tensor | Sequence[int] | None, vocab_size: int) -> torch.Tensor | None:
    if vocab_map is None:
        return None
    ids = torch.as_tensor(vocab_map)
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"vocab_map must be a non-empty 1-D tensor of token ids, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    ids = ids.to(torch.long).cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"vocab_map holds ids outside the target's vocabulary [0, {vocab_size}): "
                         f"min {int(ids.min())}, max {int(ids.max())}")
    if ids.unique().numel() != ids.numel():
        raise ValueError("vocab_map repeats a token id")
    return ids


class _ScoredVocab(nn.Module):
    """The output layer both heads share: the target's LM head rows for the scored tokens."""

    def _init_output(self, target: LoadedModel, vocab_map) -> None:
        weight, bias = _lm_head(target)
        self.vocab_size = int(weight.shape[0])
        ids = _check_vocab_map(vocab_map, self.vocab_size)
        if ids is None:
            self.register_buffer("vocab_map", None)
            self.register_buffer("out_weight", weight, persistent=False)  # (V, H), the target's own tensor
            self.register_buffer("out_bias", bias, persistent=False)
        else:
            self.register_buffer("vocab_map", ids)  # (W,)
            self.register_buffer("out_weight", weight[ids.to(weight.device)].clone(), persistent=False)  # (W, H)
            self.register_buffer("out_bias", None if bias is None else bias[ids.to(bias.device)].clone(),
                                 persistent=False)

    def _cast(self, mode: torch.dtype | str, names: tuple[str, ...],
              calibration: tuple[torch.Tensor, torch.Tensor] | None) -> "_ScoredVocab":
        """A copy of this module with its trained submodules ``names`` in weight mode
        ``mode`` (see :meth:`EagleHead.cast`); ``self`` when they already are in it."""
        from specviz.quant.weights import input_absmax, parse_weight_mode, quantize_model, weight_mode_of

        if isinstance(mode, torch.dtype) and not mode.is_floating_point:
            raise ValueError(f"the {self.kind} heads draft in a floating-point dtype or a weight mode, got {mode!r}")
        wm = parse_weight_mode(mode)
        trained = nn.ModuleDict({name: getattr(self, name) for name in names})
        current = weight_mode_of(trained)
        if current == wm.name:
            return self
        if current != "fp32":  # converted layers cannot be converted again
            raise ValueError(f"these {self.kind} heads' layers are in {current}; cast the float32 heads instead")
        ranges = None
        if wm.calibrated:  # SmoothQuant's input ranges, from the heads over the target's features of a text
            if calibration is None:
                raise ValueError(f"{wm.name} needs the input ranges of the {self.kind} heads' layers: pass "
                                 "calibration=(features, tokens), the target's features of a text and its next "
                                 "tokens (the drafters do)")
            features, tokens = calibration
            if features.dim() != 2 or features.shape[-1] != self.hidden_size or tokens.shape != features.shape[:1]:
                raise ValueError(f"calibration must be (T, {self.hidden_size}) features and (T,) tokens, got "
                                 f"{tuple(features.shape)} and {tuple(tokens.shape)}")
            scored_inputs = []
            with torch.no_grad():
                ranges = input_absmax(trained, run=lambda: scored_inputs.append(self._calibrate(features, tokens)))
            ranges = {name: r.cpu() for name, r in ranges.items()}
            ranges["out"] = scored_inputs[0].reshape(-1, self.hidden_size).abs().amax(0).float().cpu()  # (H,)
        shared = {id(t): t for t in (getattr(self, "embed_weight", None), self.out_weight, self.out_bias,
                                     self.vocab_map) if t is not None}
        clone = copy.deepcopy(self, memo=dict(shared))  # the target's tensors are not copied
        layers = nn.ModuleDict({name: getattr(clone, name) for name in names})
        if wm.convert is None:
            layers.to(wm.activation_dtype)
        else:
            quantize_model(layers, wm, input_ranges=ranges)
        for name in names:
            setattr(clone, name, layers[name])
        if wm.convert is not None:  # the output rows too: at a reduced vocabulary they cost about what the layers do
            out = nn.Linear(self.hidden_size, self.scored_vocab, bias=self.out_bias is not None)
            out.weight.data = self.out_weight.detach().float()
            if self.out_bias is not None:
                out.bias.data = self.out_bias.detach().float()
            clone.scorer = quantize_model(nn.ModuleDict({"out": out}), wm,
                                          input_ranges=None if ranges is None else {"out": ranges["out"]})["out"]
            clone.scorer_dtype = wm.activation_dtype
        return clone

    @property
    def scored_vocab(self) -> int:
        """How many tokens the head scores (W)."""
        return int(self.out_weight.shape[0])

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., W)`` float32 logits over the scored vocabulary for ``(..., H)`` states."""
        scorer = getattr(self, "scorer", None)  # the output rows in a converted weight mode (EagleHead.cast)
        if scorer is not None:
            return scorer(hidden.to(self.scorer_dtype)).float()
        w = self.out_weight
        out = F.linear(hidden.to(w.dtype), w, None if self.out_bias is None else self.out_bias.to(w.dtype))
        return out.float()

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., V)`` float32 logits over the target's vocabulary; tokens outside the
        reduced vocabulary get ``-inf`` (probability 0)."""
        scores = self.scores(hidden)  # (..., W)
        if self.vocab_map is None:
            return scores
        out = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))  # (..., V)
        out[..., self.vocab_map.to(out.device)] = scores
        return out

    def label_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> their index in the scored vocabulary (-100, ignored by the loss,
        for tokens outside it)."""
        if self.vocab_map is None:
            return tokens
        lookup = torch.full((self.vocab_size,), -100, dtype=torch.long, device=tokens.device)
        lookup[self.vocab_map.to(tokens.device)] = torch.arange(self.vocab_map.numel(), device=tokens.device)
        return torch.where(tokens >= 0, lookup[tokens.clamp(min=0)], tokens)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices in the scored vocabulary -> token ids."""
        return index if self.vocab_map is None else self.vocab_map.to(index.device)[index]


class MedusaHeads(_ScoredVocab):
    """Medusa heads: ``n_heads`` residual blocks ``h + SiLU(W_k h)`` on the target's last
    hidden state ``h`` at position ``t``, each followed by the target's frozen LM head (or
    its rows for a reduced vocabulary); head ``k`` (1-based) predicts the token at
    ``t + 1 + k``. ``W_k`` starts at zero, so an untrained head repeats the target's
    next-token prediction.

    Build one with :meth:`from_target`; the module is trained with
    :func:`specviz.heads.train_heads` and drafts with
    :class:`specviz.heads.MedusaDrafter`.

    Args:
        target: the target model whose LM head the heads share.
        n_heads: K, the number of heads (draft depth).
        vocab_map: ``(W,)`` token ids the heads score (None: the full vocabulary).
    """

    kind = "medusa"

    def __init__(self, target: LoadedModel, n_heads: int = 4, vocab_map: torch.Tensor | None = None) -> None:
        super().__init__()
        check_int("n_heads", n_heads)
        self.hidden_size = int(target.model.config.hidden_size)
        self.n_heads = n_heads
        self.blocks = nn.ModuleList(nn.Linear(self.hidden_size, self.hidden_size) for _ in range(n_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self._init_output(target, vocab_map)
        self.to(target.device)

    @classmethod
    def from_target(cls, target: LoadedModel, n_heads: int = 4,
                    vocab_map: torch.Tensor | None = None) -> "MedusaHeads":
        """Heads for ``target`` (see the class)."""
        return cls(target, n_heads, vocab_map)

    def states(self, hidden: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """``(..., K, H)`` each head's state for ``(..., H)`` last hidden states (``(..., n, H)``:
        the first ``n`` heads only)."""
        block = self.blocks[0]  # a packed block (cast) takes the activations of its mode, kept as scorer_dtype
        h = hidden.to(block.weight.dtype if isinstance(block, nn.Linear) else self.scorer_dtype)
        blocks = self.blocks if n is None else self.blocks[:n]
        return torch.stack([h + F.silu(block(h)) for block in blocks], dim=-2)  # (..., K, H)

    def cast(self, mode: torch.dtype | str,
             calibration: tuple[torch.Tensor, torch.Tensor] | None = None) -> "MedusaHeads":
        """These heads with their residual blocks in weight mode ``mode`` (a float dtype or
        a weight-mode name; the integer modes also pack the scored LM-head rows, and the
        calibrated ones need ``calibration``, as :meth:`EagleHead.cast` does). The target's
        LM head stays shared; ``self`` is left as it is.

        Raises:
            ValueError: as :meth:`EagleHead.cast`.
        """
        return self._cast(mode, ("blocks",), calibration)

    def _calibrate(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The scored states of a calibration pass over ``(T, H)`` features."""
        return self.states(features.to(self.out_weight.device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., K, W)`` float32 logits of every head over the scored vocabulary."""
        return self.scores(self.states(hidden))


class EagleHead(_ScoredVocab):
    """An EAGLE-style feature head: one decoder layer of the target's own class.

    At position ``t`` it reads ``fc(concat(feature_t, embedding(token_{t+1})))``, where
    ``feature_t`` is the target's last hidden state (or the head's own prediction of it),
    attends causally over the earlier positions with rotary positions, and outputs its
    prediction of ``feature_{t+1}``; :meth:`scores` / :meth:`full_logits` apply the
    target's frozen LM head (or its reduced rows) to a predicted feature. The embeddings
    are the target's, shared and frozen.

    :meth:`forward` runs a training window; :meth:`step` runs new positions on top of a
    KV cache (:func:`new_cache`) with an explicit mask, which is how drafting feeds the
    committed context and then the draft tree.

    Args:
        target: the target model (its decoder-layer class, configuration, embeddings and
            LM head are used).
        vocab_map: ``(W,)`` token ids the head scores (None: the full vocabulary).
        mlp_size: the width of the layer's MLP (None: the target's own
            ``intermediate_size``). A narrower MLP reads fewer weight bytes per draft
            forward: at 2,048 instead of 8,960, a Qwen2.5-1.5B head's trained weights
            (``fc`` and the layer) number about 20M instead of 52M.

    Raises:
        ValueError: ``mlp_size`` not a positive integer.
    """

    kind = "eagle"
    #: whether :meth:`step` may run the layer as one compiled call (a ``w4a8-token`` head on
    #: the CPU); off, it always runs the modules
    fused_layer: bool = True

    def __init__(self, target: LoadedModel, vocab_map: torch.Tensor | None = None,
                 mlp_size: int | None = None) -> None:
        super().__init__()
        if mlp_size is not None:
            check_int("mlp_size", mlp_size, note="(or None for the target's MLP width)")
        decoder = decoder_of(target.model)
        config = copy.deepcopy(target.model.config)
        config.num_hidden_layers = 1
        if mlp_size is not None:
            config.intermediate_size = int(mlp_size)
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types)[:1]
        config._attn_implementation = "sdpa"
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size)
        self.layer = type(decoder.layers[0])(config, layer_idx=0)
        self.rotary = type(decoder.rotary_emb)(config=config)
        self.register_buffer("embed_weight", target.model.get_input_embeddings().weight.detach(), persistent=False)
        self._init_output(target, vocab_map)
        for module in (self.fc, self.layer, self.rotary):  # trained in float32 whatever the target's dtype
            module.float()
        self.to(target.device)

    @classmethod
    def from_target(cls, target: LoadedModel, vocab_map: torch.Tensor | None = None,
                    mlp_size: int | None = None) -> "EagleHead":
        """A head for ``target`` (see the class)."""
        return cls(target, vocab_map, mlp_size)

    @property
    def mlp_size(self) -> int:
        """The width of the layer's MLP."""
        return int(self.config.intermediate_size)

    def cast(self, mode: torch.dtype | str,
             calibration: tuple[torch.Tensor, torch.Tensor] | None = None) -> "EagleHead":
        """This head with its trained layers (``fc`` and the decoder layer) in weight mode
        ``mode``: a float dtype (``torch.bfloat16`` drafts at half the weight bytes on CPUs
        with bf16 instructions) or a weight-mode name of
        :data:`~specviz.quant.weights.WEIGHT_MODES` (``"w8a8-token"`` / ``"w4a8-token"``: a
        quarter / an eighth of float32's bytes with int8 activations, the target's and the
        draft's own CPU kernels; the scored LM-head rows get their own packed copy,
        :attr:`scorer`). The calibrated modes (both) smooth each layer by its input range,
        measured on ``calibration``: ``(T, H)`` target features of a text and the ``(T,)``
        tokens after them (:class:`~specviz.heads.EagleDrafter` passes those of the
        calibration text of the target's weight modes). The target's embeddings and LM head
        stay shared, the rotary frequencies stay float32. Returns ``self`` when the layers
        already are in that mode, else a copy (``self`` is left as it is).

        Raises:
            ValueError: not a float dtype or a weight mode; a calibrated mode without
                ``calibration``, or ``calibration`` of the wrong shape.
        """
        return self._cast(mode, ("fc", "layer"), calibration)

    def _calibrate(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The predicted features of a calibration pass: one window over ``(T, H)``
        features and their ``(T,)`` next tokens."""
        positions = torch.arange(tokens.shape[0])[None]
        return self(features[None], tokens[None], positions)[0]

    def _layer_param(self) -> torch.Tensor:
        """A parameter of the decoder layer in its activation dtype: its input norm's weight
        (norms stay in the activation dtype in every weight mode), read directly, since
        listing the layer's parameters costs more than a draft step's small operators."""
        norm = getattr(self.layer, "input_layernorm", None)
        weight = getattr(norm, "weight", None)
        return weight if isinstance(weight, torch.Tensor) else next(self.layer.parameters())

    def _inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(tokens.to(self.embed_weight.device), self.embed_weight)  # (B, n, H)
        dtype = self._layer_param().dtype  # the activation dtype (integer layers hold no float weight)
        return self.fc(torch.cat([features.to(dtype), emb.to(dtype)], dim=-1))  # (B, n, H)

    def _fused_params(self) -> tuple | None:
        """The arguments of the compiled decoder-layer operator for the head's layer
        (:mod:`specviz.models.fused`), or None where it cannot run it: the layer is not in
        ``w4a8-token`` on the CPU with the compiled operator, has a forward hook, or
        :attr:`fused_layer` is off. Recorded per layer object and its modules."""
        from specviz.models.fused import fusable, layers_params

        if not self.fused_layer or self.training:
            return None

        def refuse() -> str | None:
            if weight_mode_of(self.layer) != "w4a8-token" or not fusable("w4a8-token", self._layer_param().device):
                return "the layer is not in w4a8-token on the CPU with the compiled operator"
            act = getattr(self.config, "hidden_act", "silu")
            return None if act == "silu" else f"its activation is {act}, not silu"

        recorded, params = layers_params([self.layer], self.config, self.__dict__.get("_fused"), refuse)
        if recorded is not None:  # a float head is not scanned again every step; a hooked one is
            self.__dict__["_fused"] = (recorded, params)
        return None if isinstance(params, str) else params[0]

    def step(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache,
             allowed: torch.Tensor) -> torch.Tensor:
        """Run ``n`` new positions after the ``S`` slots of ``cache`` (which grows by n).

        A head in ``w4a8-token`` on the CPU runs its layer as one call of the compiled
        decoder-layer operator (:mod:`specviz.models.fused`; with the mask, so a draft
        tree's nodes see their ancestors only) when the cache is given and ``n`` is at most
        :data:`~specviz.models.fused.FUSED_MAX_TOKENS`, without gradients: the same four
        integer products, the norms, rotary embedding and attention the operator's own
        float arithmetic, so the predicted features differ from the modules' by rounding.
        They only shape proposals, which the target verifies.

        Args:
            features: ``(B, n, H)`` the feature at each position (the target's or a prediction).
            tokens: ``(B, n)`` the token after each position.
            positions: ``(B, n)`` rotary positions.
            cache: a ``DynamicCache`` of the head's one layer, or None (no cache, S = 0).
            allowed: ``(B, n, S + n)`` bool, which slots each new position may attend to.

        Returns:
            ``(B, n, H)`` the predicted next features.
        """
        device = self._layer_param().device
        x = self._inputs(features.to(device), tokens.to(device))  # (B, n, H)
        positions = positions.to(device)
        b, n = tokens.shape
        params = None if cache is None or n > FUSED_MAX_TOKENS or torch.is_grad_enabled() else self._fused_params()
        if params is not None:
            cos, sin = self.rotary(x, positions)  # (B, n, D) each
            keys, values, held = reserve_slots(cache, 0, n, b, params[16], params[17], x)
            if allowed.shape[-1] != held + n:
                crop_cache(cache, held)  # leave the cache as it was
                raise ValueError(f"allowed covers {allowed.shape[-1]} slots, the cache holds {held} + {n} new")
            mask = None if causal_over_cache(allowed, held) else allowed.to(device)
            return torch.ops.specviz.w4a8_decoder_layer(x.contiguous(), keys, values, held, cos, sin, *params,
                                                         vnni_kernel(), mask)
        mask = additive_mask(allowed.to(device), x.dtype)  # (B, 1, n, S + n)
        out = self.layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=cache is not None, position_embeddings=self.rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                valid: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """A training window: ``(B, T, H)`` features, ``(B, T)`` next tokens and positions,
        causal attention (restricted to ``valid`` ``(B, T)`` positions when given) ->
        ``(B, T, H)`` predicted next features; with an empty ``cache`` the window's keys and
        values stay in it (for passes that attend to them)."""
        b, t = tokens.shape
        allowed = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril().expand(b, t, t)  # (B, T, T)
        if valid is not None:
            allowed = allowed & valid[:, None, :]
            allowed = allowed | torch.eye(t, dtype=torch.bool, device=tokens.device)  # padding sees itself
        return self.step(features, tokens, positions, cache, allowed)


def reduced_vocab(sequences: Iterable[Sequence[int]], size: int, always: Iterable[int] = (),
                  fill_to: int | None = None) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``sequences`` (ties: the smaller id first),
    plus every id of ``always`` (e.g. end-of-sequence ids), as a sorted ``(N,)`` long
    tensor to pass as ``vocab_map``.

    A small training set holds far fewer distinct tokens than ``size`` (a few thousand in
    a few tens of thousands of tokens), and text of other kinds than the training data
    uses many of the rest. With ``fill_to`` (the target's vocabulary size) the remaining
    slots take the smallest ids below it that are not chosen yet: a BPE tokenizer numbers
    its merges in the order it learned them, roughly by frequency in its own training
    text, so its first ids are a data-independent guess at the common tokens. Without
    it the result has fewer than ``size`` ids when the data has fewer distinct tokens.
    """
    check_int("size", size)
    if fill_to is not None:
        check_int("fill_to", fill_to)
    counts = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    extra = sorted({int(t) for t in always})
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    chosen = list(extra)
    taken = set(extra)
    for t in ranked:
        if len(chosen) >= size:
            break
        if t not in taken:
            chosen.append(t)
            taken.add(t)
    t = 0
    while fill_to is not None and len(chosen) < size and t < fill_to:
        if t not in taken:
            chosen.append(t)
            taken.add(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def out_of_vocab_share(vocab_map: torch.Tensor | Sequence[int] | None, sequences: Iterable[Sequence[int]]) -> float:
    """Share of the tokens of ``sequences`` that a head with ``vocab_map`` cannot propose
    (0.0 for the full vocabulary, nan when there are no tokens)."""
    tokens = [int(t) for seq in sequences for t in seq]
    if not tokens:
        return float("nan")
    if vocab_map is None:
        return 0.0
    allowed = set(torch.as_tensor(vocab_map).tolist())
    return sum(t not in allowed for t in tokens) / len(tokens)

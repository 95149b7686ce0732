"""Tiny random models for tests: a random-weight Qwen2 with a byte tokenizer built in code
(:func:`tiny_model`), and a pair whose draft is the target with noise on its weights
(:func:`tiny_pair`); built in milliseconds, with no file and no download."""

from __future__ import annotations

import copy

import torch

from specviz.models.convert import convert_model
from specviz.models.device import resolve_device
from specviz.models.fused import DRAFT_LAYERS
from specviz.models.loading import load_model, with_draft_layers
from specviz.models.types import LoadedModel, ModelPair
from specviz.quant.weights import WeightMode, parse_weight_mode
from specviz.validate import check_choice

__all__ = ["tiny_tokenizer", "tiny_model", "tiny_pair"]


_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")



_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)



def tiny_tokenizer():
    """A byte-level tokenizer with 256 byte tokens plus Qwen-style chat specials, built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = _TINY_CHAT_TEMPLATE
    return tok



def tiny_model(seed: int = 0, n_layers: int = 2, hidden: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
               dtype: WeightMode | torch.dtype | str = torch.float32, max_context: int = 1024,
               tokenizer=None, device: "str | torch.device" = "cpu") -> LoadedModel:
    """A random-weight ``Qwen2ForCausalLM`` with :func:`tiny_tokenizer`, for fast tests.

    Same architecture family and vocabulary interface as the built-in pair (grouped-query
    attention, rotary positions, tied embeddings), a few hundred thousand parameters.
    ``dtype`` takes the weight modes of :func:`load_model`; its dimensions (64, 128) suit
    ``w4a8-token``'s group size of 64. The weights are drawn on the CPU (the same on
    every device), then moved to ``device``.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by n_heads ({n_heads}), and n_heads by n_kv_heads ({n_kv_heads})")
    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=max_context,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        # Re-scaled init: unit-variance embeddings, small block weights and a wide LM head give
        # peaked, position-dependent next-token distributions (mean top-1 probability ~0.7), so
        # drafts are sometimes accepted, as with a real pair. The default init is near-uniform.
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("embed_tokens.weight"):
                    param.normal_(0.0, 1.0)
                elif pname.endswith("lm_head.weight"):
                    param.normal_(0.0, 1.0)
                elif param.dim() == 2:
                    param.normal_(0.0, 0.05)
    mode = parse_weight_mode(dtype)
    dev = resolve_device(device, mode)
    model = convert_model(model, mode, tok).eval().to(dev)
    return LoadedModel(name=f"tiny-qwen2-seed{seed}", model=model, tokenizer=tok, dtype=mode.activation_dtype,
                       weight_mode=mode.name)



def tiny_pair(seed: int = 0, noise: float = 0.1, dtype: WeightMode | torch.dtype | str = torch.float32,
              device: "str | torch.device" = "cpu",
              draft_dtype: WeightMode | torch.dtype | str | None = None,
              draft_layers: str = "fused-one-pass") -> ModelPair:
    """A tiny target and a draft that is the target with relative Gaussian noise on every
    weight matrix, so the draft's top-1 agrees with the target's often but not always
    (about two tokens in three at the default ``noise``). In a converted mode (w8a8-token,
    w4a8-token) both are built in fp32, then converted. Both are drawn on the CPU, then
    moved to ``device``.
    ``draft_dtype`` puts the draft in another mode (None: ``dtype``); ``draft_layers`` as for
    :func:`load_pair`."""
    mode = parse_weight_mode(dtype)
    draft_mode = mode if draft_dtype is None else parse_weight_mode(draft_dtype)
    check_choice("draft_layers", draft_layers, DRAFT_LAYERS)
    dev = resolve_device(device, mode)
    resolve_device(dev, draft_mode)  # the draft's mode must run there too
    target = tiny_model(seed=seed, dtype=dtype if mode.convert is None and draft_mode is mode else "fp32")
    draft_model = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft_model.parameters():
            if p.dim() == 2:
                p.add_((torch.randn(p.shape, generator=gen) * p.float().std() * noise).to(p.dtype))
    draft = LoadedModel(name=f"tiny-qwen2-seed{seed}-draft", model=draft_model.eval(),
                        tokenizer=target.tokenizer, dtype=target.dtype)
    target, draft = load_model(target, mode, device=dev), load_model(draft, draft_mode, device=dev)
    return with_draft_layers(ModelPair(target=target, draft=draft), draft_layers)

"""The token modes' prompt rule: prompt positions in one activation pass, later ones in the
layers' own passes, the same in specviz's forwards and in transformers' generate()."""

import pytest
import torch

from specviz.decode.engine import plain_generate
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.tiny import tiny_model, tiny_pair
from specviz.quant.passes import prompt_in_one_pass, prompt_positions, prompt_rows
from specviz.quant.w4a8 import W4A8TokenLinear
from specviz.quant.weights import W8A8TokenLinear
from specviz.sampling import GREEDY

PROMPT = [5, 17, 2, 40, 33, 8, 12, 90, 61]


def _layers():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    return [W8A8TokenLinear.from_linear(lin), W4A8TokenLinear.from_linear(lin)]


@pytest.mark.parametrize("layer", _layers(), ids=["w8a8-token", "w4a8-token"])
def test_prompt_rows_run_in_one_pass_the_rest_in_both(layer):
    x = torch.randn(1, 5, 64)
    one, two = layer.forward_pytorch(x, False), layer.forward_pytorch(x, True)
    assert not torch.equal(one, two)
    assert torch.equal(layer(x), two)  # outside a forward's positions: the layer's own passes
    with prompt_positions(3, 0, 5):  # positions 0..4, the first 3 the prompt's
        assert prompt_rows(x) == 3
        mixed = layer(x)
        head = layer(x[:, -2:])  # an LM head's kept rows are the forward's last: positions 3 and 4
        assert prompt_rows(x[:, -2:]) == 0
    assert torch.equal(mixed[:, :3], one[:, :3]) and torch.equal(mixed[:, 3:], two[:, 3:])
    assert torch.equal(head, two[:, -2:])
    with prompt_positions(4, 0, 5):
        assert torch.equal(layer(x[:, -2:]), torch.cat([one[:, 3:4], two[:, 4:]], dim=1))
    with prompt_positions(3, 3, 2):  # a later forward: no prompt position
        assert prompt_rows(x[:, :2]) == 0 and torch.equal(layer(x[:, :2]), two[:, :2])
    layer.residual = False  # a one-pass layer stays one pass everywhere
    try:
        with prompt_positions(3, 0, 5):
            assert torch.equal(layer(x), one)
    finally:
        layer.residual = True


def test_blocks_nest_and_reset():
    x = torch.randn(1, 4, 8)
    with prompt_positions(4, 0, 4):
        assert prompt_rows(x) == 4
        with prompt_positions(0, 4, 1):  # an inner forward after the prompt
            assert prompt_rows(x[:, :1]) == 0
        assert prompt_rows(x) == 4
    assert prompt_rows(x) == 0


def _one_pass_copy(model):
    import copy

    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, (W8A8TokenLinear, W4A8TokenLinear)):
            m.residual = False
    return twin


@pytest.mark.parametrize("mode", ["w8a8-token", "w4a8-token"])
def test_a_forward_onto_an_empty_cache_is_one_pass_later_ones_are_not(mode):
    model = tiny_model(dtype="fp32")
    from specviz.models.loading import load_model

    model = load_model(model, mode).model
    twin = _one_pass_copy(model)
    ids = torch.tensor([PROMPT])
    n = ids.shape[1]
    cache, twin_cache = new_cache(model), new_cache(twin)
    first = forward_tokens(model, cache, ids, torch.arange(n)[None], None)
    assert torch.equal(first, forward_tokens(twin, twin_cache, ids, torch.arange(n)[None], None))
    step = forward_tokens(model, cache, torch.tensor([[3, 4]]), torch.tensor([[n, n + 1]]), None)
    # the later forward runs both passes: it differs from the one-pass model's on the same cache
    assert not torch.equal(step, forward_tokens(twin, twin_cache, torch.tensor([[3, 4]]),
                                                torch.tensor([[n, n + 1]]), None))


@pytest.mark.parametrize("mode", ["w8a8-token", "fp32"])
def test_generate_follows_the_prompt_rule_bit_for_bit(mode):
    """transformers' greedy generate() under prompt_in_one_pass computes the logits of
    specviz's own prefill and decoding steps bit for bit (without it, its prefill runs both
    passes and its first logits differ in a token mode)."""
    pair = tiny_pair(dtype=mode)
    model = pair.target.model
    prompt = torch.tensor([PROMPT])
    n = prompt.shape[1]
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                  output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    with prompt_in_one_pass([model], n):
        out = model.generate(prompt, **kwargs)
    free = model.generate(prompt, **kwargs)
    cache = new_cache(model)
    logits = [forward_tokens(model, cache, prompt, torch.arange(n)[None], None, logits_to_keep=1)[0, -1]]
    for i, token in enumerate(out.sequences[0, n:-1].tolist()):
        logits.append(forward_tokens(model, cache, torch.tensor([[token]]), torch.tensor([[n + i]]), None)[0, -1])
    for ours, theirs in zip(logits, out.logits):
        assert torch.equal(ours, theirs[0].float())
    assert torch.equal(out.logits[0], free.logits[0]) == (mode == "fp32")
    run = plain_generate(pair.target, PROMPT, max_new_tokens=6, config=GREEDY, chat=False, stop_at_eos=False)
    assert list(run.output_ids) == out.sequences[0, n:].tolist()


def test_assisted_generation_keeps_its_drafts_out_of_the_prompt_pass():
    """Assisted generation's first forward holds the prompt and the first drafted tokens:
    only the prompt's rows run in one pass, so its output is plain decoding's."""
    pair = tiny_pair(dtype="w8a8-token")
    model = pair.target.model
    prompt = torch.tensor([PROMPT])
    n = prompt.shape[1]
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    fed = []
    handle = model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        with prompt_in_one_pass([model, pair.draft.model], n):
            assisted = model.generate(prompt, assistant_model=pair.draft.model, **kwargs)
    finally:
        handle.remove()
    assert fed[0] > n  # the prompt and a draft in one forward
    with prompt_in_one_pass([model], n):
        plain = model.generate(prompt, **kwargs)
    assert assisted[0].tolist() == plain[0].tolist()
    run = plain_generate(pair.target, PROMPT, max_new_tokens=12, config=GREEDY, chat=False, stop_at_eos=False)
    assert list(run.output_ids) == plain[0, n:].tolist()

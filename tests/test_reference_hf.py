"""The reference model through transformers' API, as Trainer, generate and lm-eval call it."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import spec_oracle


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ref_logits(tiny_ckpt, model):
    """Float64 logits of `ids` straight from docs/model.md."""
    tensors = {k: v.double() for k, v in load_file(tiny_ckpt / "model.safetensors").items()}
    return lambda ids: spec_oracle.forward(model.config, tensors, ids)


def ids_of(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_loss_over_num_items_in_batch(model, ref_logits):
    """Trainer passes num_items_in_batch (the forward takes **kwargs) and then does not divide the
    loss by the gradient accumulation steps: the loss must be the summed NLL over that count."""
    ids = ids_of(12)
    labels = ids.clone()
    labels[:4] = -100
    nll = -torch.log_softmax(ref_logits(ids), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    kept = labels[1:] != -100
    summed = nll[kept].sum()
    with torch.no_grad():
        mean = model(ids[None], labels=labels[None]).loss
        over_items = model(ids[None], labels=labels[None], num_items_in_batch=torch.tensor(20)).loss
    assert mean.item() == pytest.approx(summed.item() / kept.sum().item(), rel=1e-5)
    assert over_items.item() == pytest.approx(summed.item() / 20, rel=1e-5)


def test_logits_to_keep_as_positions(model):
    """An int keeps the last positions; a tensor (transformers' other form) names the positions."""
    ids = ids_of(9)[None]
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, logits_to_keep=2).logits
        picked = model(ids, logits_to_keep=torch.tensor([0, 3, 8])).logits
    torch.testing.assert_close(last, full[:, -2:])
    torch.testing.assert_close(picked, full[:, [0, 3, 8]])


def test_return_dict_false_gives_a_tuple(model):
    """A ModelOutput came back: unpacking it gave its field names."""
    ids = ids_of(6)[None]
    with torch.no_grad():
        out = model(ids, labels=ids)
        loss, logits = model(ids, labels=ids, return_dict=False)
        hidden, = model.model(ids, return_dict=False)
    assert torch.equal(loss, out.loss) and torch.equal(logits, out.logits)
    assert torch.equal(hidden, model.model(ids).last_hidden_state)


def test_return_dict_false_in_the_config_gives_a_tuple(tiny_ckpt):
    """The config's return_dict=False made the inner model return a tuple too, which the causal LM
    read as an output: AttributeError 'tuple' object has no attribute 'last_hidden_state'."""
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32, return_dict=False).eval()
    ids = ids_of(6)[None]
    with torch.no_grad():
        logits, _ = model(ids, use_cache=True)
        assert torch.equal(logits, model(ids, return_dict=True).logits)


def test_gradient_checkpointing(tiny_ckpt):
    """Fine-tuning with activation checkpointing: the layers are recomputed in the backward pass
    and the gradients are those of the plain backward pass."""
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).train()
    ids = torch.stack([ids_of(10, 1), ids_of(10, 2)])

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    plain = grads()
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    model.gradient_checkpointing_enable()
    checkpointed = grads()
    assert len(calls) == 2   # forward, then the recompute in backward
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, msg=name)


def test_output_hidden_states(model, tiny_ckpt):
    """As transformers' models: the embeddings, then each layer's output, the last one after the
    final norm. Layer 1's output, through the final norm and the head, is a 1-layer model's logits."""
    ids = ids_of(8)
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
        one_layer = model.lm_head(model.model.norm(out.hidden_states[1]))[0]
        assert model(ids[None]).hidden_states is None
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(ids[None]))
    assert torch.equal(out.hidden_states[-1], model.model(ids[None]).last_hidden_state)
    tensors = {k: v.double() for k, v in load_file(tiny_ckpt / "model.safetensors").items()}
    config = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 1})
    torch.testing.assert_close(one_layer.double(), spec_oracle.forward(config, tensors, ids), rtol=1e-4, atol=1e-4)


def left_padded(prompts, pad=257):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("padded", [True, False])
def test_generate_with_a_static_cache(model, padded):
    """cache_implementation="static" (the torch.compile path) failed deep in AsyncI: generate
    passed a 4D mask, and the cache returns all its slots."""
    prompts = [ids_of(n, n) for n in (3, 8, 5)] if padded else [ids_of(8)]
    ids, mask = left_padded(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=257)
    dynamic = model.generate(ids, **kw)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kw), dynamic)


def test_output_attentions_is_refused(model):
    """It was ignored: attentions came back None, read as "no attention" by interpretability code."""
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids_of(4)[None], output_attentions=True)


def test_layer_outputs_are_freed_without_output_hidden_states(model):
    """Every layer's output was kept to the end of the forward, asked for or not: under no_grad
    (lm-eval, generate) that is a copy of the hidden state per layer, so lm-eval's batch_size auto
    and bench's largest batch that fits were smaller."""
    import weakref
    first, alive = [], []
    hooks = [model.model.layers[0].register_forward_hook(lambda m, a, out: first.append(weakref.ref(out))),
             model.model.norm.register_forward_pre_hook(lambda m, a: alive.append(first[-1]() is not None))]
    try:
        with torch.no_grad():
            model(ids_of(6)[None])
            model(ids_of(6)[None], output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    assert alive == [False, True]

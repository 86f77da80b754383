"""The step on a transformers LlamaForCausalLM built from a small config (the `hf` extra)."""

from __future__ import annotations

import pytest
import torch

from trainfold import adamw, chain, clip_by_global_norm, decay_mask, fit, init_state, make_step, sgd
from trainfold.core.losses import causal_lm

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int = 0, tie: bool = False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def batch_of(seed: int, n: int = 4, t: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, t), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


@pytest.mark.parametrize("tie", [False, True])
def test_llama_gradients_equal_eager_backward_bitwise(tie):
    model = tiny_llama(tie=tie)
    ids, labels = batch_of(0)
    opt = sgd(1.0)
    new = make_step(model, causal_lm, opt)(init_state(model, opt), [{"input_ids": ids, "labels": labels}])
    out = model(input_ids=ids, labels=labels)  # HF's own loss: ForCausalLMLoss, mean over shifted labels
    out.loss.backward()
    assert new.metrics["loss"].item() == pytest.approx(out.loss.item(), rel=1e-6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert torch.equal(new.params[name], p - p.grad), name


def test_llama_trains_with_accumulation_and_the_hf_default_chain():
    model = tiny_llama(1)
    opt = chain(clip_by_global_norm(1.0), adamw(3e-3, weight_decay=0.01, mask=decay_mask(model)))
    step = make_step(model, causal_lm, opt)
    ids, labels = batch_of(1, 8)
    batch = [{"input_ids": ids[:4], "labels": labels[:4]}, {"input_ids": ids[4:], "labels": labels[4:]}]
    s0 = init_state(model, opt)
    first = step(s0, batch).metrics["loss"].item()
    last = fit(step, s0, [batch] * 15).metrics["loss"].item()
    assert last < first - 0.5

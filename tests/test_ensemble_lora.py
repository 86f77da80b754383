"""K LoRA adapters on one frozen base in one step: each adapter equals its own make_step run (SGD with momentum:
the update is linear in the gradients, so the batched matmuls' rounding stays at float32 rounding), each is saved
as a PEFT adapter directory PeftModel.from_pretrained loads, and optimizers that would mix members are refused."""

from __future__ import annotations

import pytest
import torch

from trainfold import init_state, make_step, sgd
from trainfold.core.losses import causal_lm
from trainfold.optim import chain, clip_by_global_norm
from trainfold.step import ensemble as ens
from trainfold.step.ensemble.lora import (
    adapter_count,
    init_adapter_ensemble,
    make_adapter_ensemble_step,
    save_adapters,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, K, STEPS = 64, 3, 3


def base():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation="eager",  # CPU sdpa has no vmap batching rule
    )
    return transformers.LlamaForCausalLM(config)


def lora(seed: int):
    torch.manual_seed(seed)  # each adapter its own initial lora_A (and, so that it trains, a nonzero lora_B)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def member_batches(m: int):
    g = torch.Generator().manual_seed(100 + m)
    return [[{"input_ids": (ids := torch.randint(0, VOCAB, (2, 8), generator=g)), "labels": ids}] for _ in range(STEPS)]


@pytest.fixture(scope="module")
def trained():
    models = [lora(seed) for seed in range(K)]
    opt = sgd(0.5, momentum=0.9)
    singles = []
    for m, model in enumerate(models):
        step, state = make_step(model, causal_lm, opt), init_state(model, opt)
        for batch in member_batches(m):
            state = step(state, batch)
        singles.append(state)
    state = init_adapter_ensemble(models[0], opt, [init_state(mm, opt).params for mm in models])
    step = make_adapter_ensemble_step(models[0], causal_lm, opt)
    for i in range(STEPS):
        state = step(state, ens.stack_batches([member_batches(m)[i] for m in range(K)]))
    return models, singles, state


def test_each_adapter_equals_its_own_run(trained):
    _, singles, state = trained
    assert adapter_count(state) == K and int(state.step) == STEPS
    for m, single in enumerate(singles):
        assert float(state.metrics["loss"][m]) == pytest.approx(float(single.metrics["loss"]), abs=1e-6)
        for name, p in single.params.items():
            assert torch.allclose(state.params[name][m], p, rtol=0, atol=1e-6), (m, name)
        assert not torch.equal(single.params[name], singles[0].params[name]) or m == 0  # members really differ


def test_the_base_is_held_once_and_left_unchanged(trained):
    models, _, state = trained
    frozen = dict(models[0].named_parameters())
    for name, b in state.buffers.items():
        if name in frozen:
            assert b.shape == frozen[name].shape and torch.equal(b, frozen[name])


def test_each_adapter_saves_as_a_peft_directory_that_from_pretrained_loads(trained, tmp_path):
    models, singles, state = trained
    dirs = save_adapters(state, models[0], [tmp_path / f"adapter-{m}" for m in range(K)])
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    for m, d in enumerate(dirs):
        loaded = peft.PeftModel.from_pretrained(base(), d)
        expected = torch.func.functional_call(
            models[m], {**dict(models[m].named_parameters()), **singles[m].params}, (ids,)
        )
        assert torch.allclose(loaded(ids).logits, expected.logits, atol=1e-5)
        for name, p in loaded.named_parameters():
            if "lora_" in name:
                assert torch.equal(p, state.params[name][m]), name


def test_an_optimizer_that_mixes_members_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\['clip_by_global_norm'\] would mix the members"):
        make_adapter_ensemble_step(lora(0), causal_lm, chain(clip_by_global_norm(1.0), sgd(0.1)))

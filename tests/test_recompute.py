"""Activation checkpointing: the same update, fewer saved activations, the model left as it was."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from trainfold import TrainingArguments, adamw, init_state, make_step, sgd, train
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.step.recompute import checkpoint_blocks, recomputing
from trainfold.testing import saved_for_backward

CFG = TinyLMConfig(vocab_size=32, d_model=32, n_layers=4, n_heads=4, max_len=32, dropout=0.1)


def lm(**over) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(attrs.evolve(CFG, **over))


def batch(seed: int, rows: int = 4, seq: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (2, rows, seq), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]  # two micro-batches


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), every=st.sampled_from([1, 2, 3]))
def test_checkpointing_gives_the_same_update_with_dropout(seed, every):
    model, opt = lm(), adamw(1e-2)
    state = init_state(model, opt, seed=seed)
    plain = make_step(model, causal_lm, opt)(state, batch(seed))
    recomputed = make_step(model, causal_lm, opt, gradient_checkpointing=every)(state, batch(seed))
    for k in plain.params:  # dropout is replayed exactly in the recomputation
        assert torch.equal(plain.params[k], recomputed.params[k]), k
    assert torch.equal(plain.metrics["loss"], recomputed.metrics["loss"])


def saved_bytes(step, state, micro_batches) -> int:
    """Bytes autograd saves for the backward pass during one step."""
    return saved_for_backward(lambda: step(state, micro_batches))[1]


def test_checkpointing_saves_far_fewer_activations():
    model, opt = lm(dropout=0.0), adamw(1e-2)
    state = init_state(model, opt)
    data = batch(1, rows=8, seq=32)
    plain = saved_bytes(make_step(model, causal_lm, opt), state, data)
    every_block = saved_bytes(make_step(model, causal_lm, opt, gradient_checkpointing=True), state, data)
    every_other = saved_bytes(make_step(model, causal_lm, opt, gradient_checkpointing=2), state, data)
    assert every_block < 0.45 * plain  # the hooks also count the recomputation's own saves, once per block
    assert every_block < every_other < plain


def test_the_model_is_left_as_it_was_even_when_the_step_raises():
    model, opt = lm(), adamw(1e-2)
    step = make_step(model, causal_lm, opt, gradient_checkpointing=True)
    with pytest.raises(IndexError):
        step(init_state(model, opt), [{"input_ids": torch.full((2, 8), 99), "labels": torch.zeros(2, 8).long()}])
    assert not any("forward" in vars(m) for m in model.modules())


def test_hugging_face_llama_blocks_are_its_decoder_layers():
    model = _llama(pytest.importorskip("transformers"))
    assert [n for n, _ in checkpoint_blocks(model)] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    opt = adamw(1e-2)
    state = init_state(model, opt)
    plain = make_step(model, causal_lm, opt)(state, batch(3))
    recomputed = make_step(model, causal_lm, opt, gradient_checkpointing=True)(state, batch(3))
    for k in plain.params:
        assert torch.equal(plain.params[k], recomputed.params[k]), k


def test_train_takes_the_hf_names_and_refuses_what_it_cannot_do(tmp_path):
    rows = [{"input_ids": list(range(i, i + 12)), "labels": list(range(i, i + 12))} for i in range(16)]
    base = {
        "output_dir": str(tmp_path),
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "learning_rate": 1e-2,
    }
    plain = train(lm(), TrainingArguments(**base), rows)
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        again = train(lm(), TrainingArguments(**base, **{name: True}), rows)
        assert [h.get("loss") for h in again.log_history] == [h.get("loss") for h in plain.log_history]
    assert (
        TrainingArguments(
            activation_checkpointing=True, activation_checkpointing_kwargs={"every_n_layers": 2}
        ).checkpoint_every
        == 2
    )
    for settings_, message in [
        ({"activation_checkpointing": True, "torch_compile": True}, "with torch_compile is not supported yet"),
        (
            {"activation_checkpointing": True, "gradient_checkpointing": False},
            "activation_checkpointing=True and its older name gradient_checkpointing=False disagree; set only it",
        ),
        ({"gradient_checkpointing_kwargs": {"use_reentrant": True}}, "use_reentrant=True is not supported"),
        ({"activation_checkpointing_kwargs": {"offload": True}}, r"\['offload'\] are not supported"),
        ({"activation_checkpointing_kwargs": {"every_n_layers": 0}}, "every_n_layers must be an int >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrainingArguments(**settings_)


def test_a_model_without_blocks_is_named():
    with pytest.raises(ValueError, match="found no blocks in Linear"), recomputing(torch.nn.Linear(2, 2)):
        pass


def test_an_objective_with_a_frozen_reference_forward_checkpoints_too():
    from trainfold.dpo.objective import dpo_objective, preference_collate

    policy, ref = lm(), lm(dropout=0.0)
    pairs = [{"prompt_ids": [1, 5, 6], "chosen_ids": [7, 8, 9], "rejected_ids": [10, 11]} for _ in range(4)]
    micro = [preference_collate(2)(pairs)]
    opt = adamw(1e-2)
    objective = dpo_objective(0.1, ref_params={k: v.detach().clone() for k, v in ref.named_parameters()})
    state = init_state(policy, opt, seed=1)
    plain = make_step(policy, optimizer=opt, objective=objective)(state, micro)
    recomputed = make_step(policy, optimizer=opt, objective=objective, gradient_checkpointing=True)(state, micro)
    for k in plain.params:
        assert torch.equal(plain.params[k], recomputed.params[k]), k


# -- stock HF models keep their KV cache on: the step turns it off --------------------------------


def _hf(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=32,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=32,
                attention_dropout=0.1,
                pad_token_id=0,
            )
        )
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(  # dropout 0.1 everywhere, as GPT-2's defaults
            vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=1, eos_token_id=2
        )
    )
    gpt2.config.pad_token_id = 0  # ragged rows: the default collator pads with the model's pad id
    return gpt2


def padded(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):  # two micro-batches, each with a padded row
        ids = torch.randint(1, 32, (3, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        mask[2, 13:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_checkpointing_a_stock_hf_model_with_its_cache_on_gives_the_same_update(kind):
    model, opt = _hf(kind), adamw(1e-2)
    assert model.config.use_cache is True  # the default: recomputation would append to the cache twice
    state = init_state(model, opt, seed=3)
    plain = make_step(model, causal_lm, opt)(state, padded(1))
    recomputed = make_step(model, causal_lm, opt, gradient_checkpointing=True)(state, padded(1))
    for k in plain.params:
        assert torch.equal(plain.params[k], recomputed.params[k]), k
    assert torch.equal(plain.metrics["loss"], recomputed.metrics["loss"])
    assert model.config.use_cache is True  # restored after the step
    assert not any("forward" in vars(m) for m in model.modules())


def test_train_with_gradient_checkpointing_on_gpt2_matches_the_run_without(tmp_path):
    g = torch.Generator().manual_seed(4)
    rows = [
        {"input_ids": (ids := torch.randint(1, 32, (int(n),), generator=g).tolist()), "labels": ids}
        for n in torch.randint(4, 14, (12,), generator=g)
    ]  # ragged: the collator pads
    base = {
        "output_dir": str(tmp_path),
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "learning_rate": 1e-2,
    }
    plain = train(_hf("gpt2"), TrainingArguments(**base), rows)
    again = train(_hf("gpt2"), TrainingArguments(**base, gradient_checkpointing=True), rows)
    for k in plain.state.params:
        assert torch.equal(plain.state.params[k], again.state.params[k]), k


def test_dpo_with_checkpointing_on_a_stock_hf_model_gives_the_same_update():
    from trainfold.dpo.objective import dpo_objective, preference_collate

    policy = _hf("llama")
    ref = {k: v.detach().clone() for k, v in policy.named_parameters()}
    pairs = [
        {"prompt_ids": [3, 5, 6], "chosen_ids": [7, 8, 9, 4], "rejected_ids": [10, 11]},
        {"prompt_ids": [3], "chosen_ids": [12], "rejected_ids": [13, 14, 15, 16, 17]},
    ]
    micro = [preference_collate(2)(pairs)]  # padded: chosen and rejected rows differ in length
    opt = adamw(1e-2)
    objective = dpo_objective(0.1, ref_params=ref)
    state = init_state(policy, opt, seed=1)
    plain = make_step(policy, optimizer=opt, objective=objective)(state, micro)
    recomputed = make_step(policy, optimizer=opt, objective=objective, gradient_checkpointing=True)(state, micro)
    for k in plain.params:
        assert torch.equal(plain.params[k], recomputed.params[k]), k
    assert policy.config.use_cache is True


def test_a_block_called_with_a_cache_gets_none_inside_the_scope():
    seen = []

    class Block(torch.nn.Module):
        def forward(self, x, cache=None, use_cache=False):
            seen.append((cache, use_cache))
            return x * x  # saves x: the backward recomputes the block

    model = torch.nn.Sequential(torch.nn.ModuleList([Block(), Block()]))
    x = torch.ones(2, requires_grad=True)
    with recomputing(model):
        out = model[0][0](x, cache=object(), use_cache=True)
    out.sum().backward()
    assert seen == [(None, False), (None, False)]  # the forward and its recomputation


def _steps(model, opt, n: int, **options):
    step, state = make_step(model, causal_lm, opt, **options), init_state(model, opt)  # a copied state
    for i in range(n):
        state = step(state, batch(i))
    return state


def test_a_copied_state_recomputes_with_its_own_weights_not_the_modules():
    # the recomputation in backward ran after the step had unbound its tensors, so from the second step on it
    # read the module's (initial) weights: silently wrong gradients (the reference: the step without checkpointing)
    opt = sgd(0.1, momentum=0.9)
    plain = _steps(lm(), opt, 3)
    recomputed = _steps(lm(), opt, 3, gradient_checkpointing=True)
    for k in plain.params:
        assert torch.equal(plain.params[k], recomputed.params[k]), k


def _llama(transformers):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_with_its_own_hf_checkpointing_on_trains_as_without_it(reentrant):
    # transformers' gradient_checkpointing_enable() recomputed with the module's own weights (reentrant: and put
    # the gradients in the module's .grad); the step now checkpoints those blocks itself, the flags off meanwhile
    transformers = pytest.importorskip("transformers")
    opt = sgd(0.1, momentum=0.9)
    plain = _steps(_llama(transformers), opt, 3)
    model = _llama(transformers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    model.model.layers[1].mlp.register_forward_hook(lambda *a: calls.append(1))
    own = _steps(model, opt, 3)
    for k in plain.params:
        assert torch.equal(plain.params[k], own.params[k]), k
    assert len(calls) == 6  # each step: the forward and the recomputation
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # restored
    assert all(p.grad is None for p in model.parameters())


def test_peft_with_reentrant_hf_checkpointing_and_no_input_grads_trains_its_adapter():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    opt = sgd(0.1, momentum=0.9)

    def lora():
        config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return peft.get_peft_model(_llama(transformers), config)

    plain = _steps(lora(), opt, 2)
    model = lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    own = _steps(model, opt, 2)
    for k in plain.params:
        assert torch.equal(plain.params[k], own.params[k]), k


@pytest.mark.parametrize("option", [{"differentiable": True}, {"compile": True}])
def test_own_hf_checkpointing_is_refused_by_name_where_the_step_cannot_take_it_over(option):
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="its own gradient checkpointing on.*gradient_checkpointing_disable"):
        make_step(model, causal_lm, sgd(0.1, momentum=0.9), **option)


class _OwnFlag(torch.nn.Module):
    """A module with transformers' flag and its own torch checkpoint, and no blocks the step could checkpoint."""

    def __init__(self, on: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        self.gradient_checkpointing = on

    def forward(self, input):
        h = checkpoint(self.a, input, use_reentrant=False) if self.gradient_checkpointing else self.a(input)
        return self.b(torch.tanh(h))


def test_a_module_whose_own_checkpointing_has_no_blocks_runs_whole_with_the_states_weights():
    loss = lambda out, labels, n: ((out - labels) ** 2).sum() / n
    g = torch.Generator().manual_seed(0)
    data = [[{"input": torch.randn(8, 4, generator=g), "labels": torch.randn(8, 1, generator=g)}] for _ in range(3)]
    states = []
    for on in (False, True):
        model, opt = _OwnFlag(on), sgd(0.1, momentum=0.9)
        step, state = make_step(model, loss, opt), init_state(model, opt)
        for batch in data:
            state = step(state, batch)
        states.append(state)
        assert model.gradient_checkpointing is on  # restored
    for k in states[0].params:
        assert torch.equal(states[0].params[k], states[1].params[k]), k

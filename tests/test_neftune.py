"""NEFTune: the per-sequence bound, no noise at padding or in evaluation, exact resume, no hooks left."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from trainfold import init_state, make_step, sgd
from trainfold.core.fold import fit
from trainfold.core.forward import make_forward, train_mode
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.neftune import input_embedding, neftune_forward, neftune_noise, neftune_objective
from trainfold.core.tree import flatten, unflatten

SMALL = TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=16)


def lm(seed: int = 0, dropout: float = 0.0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(attrs.evolve(SMALL, dropout=dropout))


def padded_batch(seed: int, lengths: list[int], seq: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SMALL.vocab_size, (len(lengths), seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(n: int, seed: int = 0) -> list[list[dict]]:
    return [[padded_batch(seed + k, [10, 6, 3]), padded_batch(seed + 100 + k, [4, 9])] for k in range(n)]


def hook_snapshot(model: nn.Module) -> list:
    names = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
    )
    return [(name, sorted(vars(m)), [len(getattr(m, h)) for h in names]) for name, m in model.named_modules()]


# -- the noise -----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    d=st.integers(1, 24),
    alpha=st.floats(0.1, 20),
    seed=st.integers(0, 2**31),
    left=st.booleans(),
)
def test_noise_bound_holds_per_sequence_and_pads_are_untouched(lengths, d, alpha, seed, left):
    seq = 12
    pos = torch.arange(seq)[None, :]
    ls = torch.tensor(lengths)[:, None]
    mask = (pos >= seq - ls) if left else (pos < ls)
    noise = neftune_noise(torch.zeros(len(lengths), seq, d), mask.long(), alpha, torch.Generator().manual_seed(seed))
    for i, length in enumerate(lengths):
        bound = alpha / math.sqrt(max(length, 1) * d)
        assert noise[i].abs().max().item() <= bound * (1 + 1e-6)
        assert torch.all(noise[i][~mask[i]] == 0)


def test_noise_fills_the_bound_uniformly():
    alpha, d = 5.0, 32
    mask = torch.tensor([[1] * 40, [1] * 10 + [0] * 30])
    noise = neftune_noise(torch.zeros(2, 40, d), mask, alpha, torch.Generator().manual_seed(0))
    for i, length in enumerate([40, 10]):
        bound = alpha / math.sqrt(length * d)
        real = noise[i, :length]
        assert real.abs().max().item() > 0.98 * bound  # the whole interval is used, not a smaller one
        assert real.var().item() == pytest.approx(bound**2 / 3, rel=0.1)  # Var U(-a, a) = a^2 / 3


def test_same_key_same_noise_and_the_noise_follows_the_dtype():
    mask = torch.tensor([[1, 1, 1, 0]])
    a = neftune_noise(torch.zeros(1, 4, 8), mask, 5.0, torch.Generator().manual_seed(7))
    b = neftune_noise(torch.zeros(1, 4, 8), mask, 5.0, torch.Generator().manual_seed(7))
    c = neftune_noise(torch.zeros(1, 4, 8), mask, 5.0, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (
        neftune_noise(torch.zeros(1, 4, 8, dtype=torch.bfloat16), mask, 5.0, torch.Generator()).dtype == torch.bfloat16
    )


# -- the forward transformation ------------------------------------------------------------------


def test_noisy_forward_passes_embeddings_plus_the_keyed_noise():
    model = lm()
    batch = padded_batch(0, [7, 3])
    seen = {}

    def recording_forward(params, inputs):
        seen.update(inputs)
        return torch.zeros(())

    params = {k: v.detach() for k, v in model.named_parameters()}
    with train_mode(model, True):
        neftune_forward(model, recording_forward, 5.0, torch.Generator().manual_seed(3))(params, batch)
    assert "input_ids" not in seen and torch.equal(seen["attention_mask"], batch["attention_mask"])
    clean = params["tok.weight"][batch["input_ids"]]
    expected = neftune_noise(clean, batch["attention_mask"], 5.0, torch.Generator().manual_seed(3))
    torch.testing.assert_close(seen["inputs_embeds"] - clean, expected, rtol=0, atol=1e-6)
    assert expected.abs().max() > 0


def test_no_noise_in_evaluation():
    model = lm()
    batch = {k: v for k, v in padded_batch(1, [8, 5]).items() if k != "labels"}
    params = {k: v.detach() for k, v in model.named_parameters()}
    forward = make_forward(model, {})
    noisy = neftune_forward(model, forward, 10.0, torch.Generator().manual_seed(0))
    with train_mode(model, False):
        assert torch.equal(noisy(params, batch), forward(params, batch))
    with train_mode(model, True):
        assert not torch.allclose(noisy(params, batch), forward(params, batch))


def test_noise_uses_the_step_params_not_the_model_weights():
    model = lm()
    batch = padded_batch(2, [6])
    params = {k: v.detach() + 1.0 for k, v in model.named_parameters()}  # differ from the module's weights
    seen = {}
    with train_mode(model, True):
        neftune_forward(model, lambda p, i: seen.update(i), 1e-3, torch.Generator())(params, batch)
    torch.testing.assert_close(seen["inputs_embeds"], params["tok.weight"][batch["input_ids"]], atol=1e-3, rtol=0)


# -- training with it ----------------------------------------------------------------------------


def test_training_with_neftune_resumes_exactly_and_differs_from_plain():
    def train(state, data):
        model = lm()
        step = make_step(model, optimizer=sgd(0.5), objective=neftune_objective(model, alpha=15.0))
        return fit(step, state, data)

    data = batches(4)
    model = lm()
    start = init_state(model, sgd(0.5), seed=11)
    straight = train(start, data)
    mid = train(start, data[:2])
    resumed = train(unflatten(flatten(mid), init_state(lm(), sgd(0.5))), data[2:])
    for key, value in straight.params.items():
        assert torch.equal(value, resumed.params[key]), key
    plain = fit(make_step(model, optimizer=sgd(0.5)), start, data)
    assert not torch.equal(plain.params["tok.weight"], straight.params["tok.weight"])
    assert straight.metrics["num_items"].item() == plain.metrics["num_items"].item()


def test_no_hooks_or_attributes_remain_after_training_ends_or_raises():
    model = lm(dropout=0.1)
    before, weights = hook_snapshot(model), {k: v.clone() for k, v in model.state_dict().items()}
    step = make_step(model, optimizer=sgd(0.1), objective=neftune_objective(model, alpha=5.0))
    fit(step, init_state(model, sgd(0.1)), batches(2))
    assert hook_snapshot(model) == before

    def failing(outputs, labels, num_items):
        raise RuntimeError("loss exploded")

    failing.count_items = lambda labels: (labels != -100).sum()
    bad = make_step(model, optimizer=sgd(0.1), objective=neftune_objective(model, alpha=5.0, loss=failing))
    with pytest.raises(RuntimeError, match="loss exploded"):
        fit(bad, init_state(model, sgd(0.1)), batches(1))
    assert hook_snapshot(model) == before
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert model.training  # the flag is as it was


def test_wraps_another_objective_and_frozen_embeddings():
    model = lm()
    model.tok.weight.requires_grad_(False)  # e.g. LoRA: the embedding is frozen, so not among params
    calls = []

    def inner(forward, params, micro, num_items, key):
        calls.append(1)
        out = forward(params, {"input_ids": micro["input_ids"], "attention_mask": micro["attention_mask"]})
        return out.float().pow(2).mean(), {"aux": torch.tensor(1.0)}

    inner.count_items = lambda micro: torch.tensor(micro["input_ids"].shape[0])
    objective = neftune_objective(model, 5.0, objective=inner)
    assert input_embedding(model) == (model.tok, "tok.weight")
    state = fit(make_step(model, optimizer=sgd(0.1), objective=objective), init_state(model, sgd(0.1)), batches(1))
    assert calls == [1, 1] and state.metrics["aux"].item() == 1.0 and state.metrics["num_items"].item() == 5
    inner.aux_reduction = "sum"  # carried by the wrapper: its aux summed over the micro-batches
    wrapped = neftune_objective(model, 5.0, objective=inner)
    state = fit(make_step(model, optimizer=sgd(0.1), objective=wrapped), init_state(model, sgd(0.1)), batches(1))
    assert wrapped.aux_reduction == "sum" and state.metrics["aux"].item() == 2.0


def test_hugging_face_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    emb, name = input_embedding(model)
    assert emb is model.model.embed_tokens and name == "model.embed_tokens.weight"
    before = hook_snapshot(model)
    batch = padded_batch(0, [10, 4])
    params = {k: v.detach() for k, v in model.named_parameters()}
    with train_mode(model, True):
        out = neftune_forward(
            model, make_forward(model, dict(model.named_buffers())), 5.0, torch.Generator().manual_seed(1)
        )(params, {k: batch[k] for k in ("input_ids", "attention_mask")})
        clean = emb(batch["input_ids"])
        noise = neftune_noise(clean, batch["attention_mask"], 5.0, torch.Generator().manual_seed(1))
        expected = model(inputs_embeds=clean + noise, attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(out.logits, expected)
    state = fit(
        make_step(model, optimizer=sgd(0.1), objective=neftune_objective(model, 5.0)),
        init_state(model, sgd(0.1)),
        batches(1),
    )
    assert int(state.step) == 1 and hook_snapshot(model) == before


# -- errors --------------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match=r"neftune_noise_alpha=0 must be a positive"):
        neftune_objective(lm(), 0)
    with pytest.raises(TypeError, match=r"Linear.get_input_embeddings\(\)"):
        neftune_objective(nn.Linear(2, 2), 5.0)
    with pytest.raises(ValueError, match=r"attention_mask of shape \(1, 3\) does not fit"):
        neftune_noise(torch.zeros(1, 4, 2), torch.ones(1, 3), 1.0, torch.Generator())
    with pytest.raises(ValueError, match=r"shaped \(batch, seq, d\), got \(4, 2\)"):
        neftune_noise(torch.zeros(4, 2), None, 1.0, torch.Generator())
    model = lm()
    with train_mode(model, True), pytest.raises(KeyError, match="'input_ids' or 'inputs_embeds'"):
        neftune_forward(model, make_forward(model, {}), 1.0, torch.Generator())(
            {}, {"attention_mask": torch.ones(1, 2)}
        )


def test_missing_labels_are_named():
    model = lm()
    step = make_step(model, optimizer=sgd(0.1), objective=neftune_objective(model, 5.0, label_key="targets"))
    with pytest.raises(KeyError, match=r"no 'targets' key \(keys: \['attention_mask', 'input_ids', 'labels'\]\)"):
        step(init_state(model, sgd(0.1)), [padded_batch(0, [3])])


def test_a_losss_own_metrics_are_kept_and_summed_as_without_noise():
    # sft_loss's entropy and mean_token_accuracy are such metrics: TRL logs them with NEFTune on
    def loss(outputs, labels, num_items):
        return causal_lm(outputs, labels, num_items)

    loss.metrics = lambda outputs, labels, num_items: {"item_share": (labels != -100).sum() / num_items}
    batch = batches(1)[0]  # two micro-batches of 19 and 13 items: a mean weighted by items would not give 1
    noisy = make_step(lm(), loss, sgd(0.1), objective=neftune_objective(lm(), 5.0, loss))(
        init_state(lm(), sgd(0.1)), batch
    )
    plain = make_step(lm(), loss, sgd(0.1))(init_state(lm(), sgd(0.1)), batch)
    assert plain.metrics["item_share"].item() == pytest.approx(1.0)
    assert noisy.metrics["item_share"].item() == pytest.approx(1.0)

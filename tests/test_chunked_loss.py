"""Chunked cross-entropy: the plain loss's value and gradients without the full logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import EPS, causal_lm_step_abs_grads, grad_atol, reordered, sgd_rtol

from trainfold import init_state, make_step, sgd
from trainfold.core.chunked_loss import chunked_causal_lm, chunked_cross_entropy, chunked_token_logps
from trainfold.core.losses import causal_lm, count_shifted_labels

transformers = pytest.importorskip("transformers")


def labelled(seed: int, shape: tuple[int, ...], vocab: int, masked: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, shape, generator=g)
    return labels.masked_fill(torch.rand(shape, generator=g) < masked, -100)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(2, 9), st.integers(1, 20), st.sampled_from([0.0, 0.1]), st.integers(0, 99))
def test_value_and_gradients_equal_the_plain_loss(batch, length, chunk, smoothing, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, requires_grad=True)
    bias = torch.randn(13, generator=g, requires_grad=True)
    labels = labelled(seed, (batch, length), 13)
    n = (labels != -100).sum()
    plain = torch.nn.functional.cross_entropy(
        (hidden @ weight.T + bias).reshape(-1, 13), labels.reshape(-1), reduction="sum", label_smoothing=smoothing
    ) / n.clamp(min=1)
    ours = chunked_cross_entropy(hidden, weight, labels, n, bias=bias, chunk_size=chunk, label_smoothing=smoothing)
    # Bounds from float32 rounding (tests/tolerance.py), sizes from the exact terms. A logit is a dot product of
    # 8 terms plus the bias, which a chunk's matmul may add in another order: off by dz; softmax passes on at most
    # 2 dz relative. The loss adds m positive token terms; the weight's and bias's gradients add m token terms
    # |p - y| |h| / n, in chunks; the hidden's gradient adds 13 vocabulary terms |p - y| |w| / n per token.
    with torch.no_grad():
        m, z = labels.numel(), hidden @ weight.T + bias
        dz = reordered(9, ((hidden.abs() @ weight.abs().T) + bias.abs()).max().item())
        y = torch.nn.functional.one_hot(labels.clamp(min=0), 13) * (1 - smoothing) + smoothing / 13
        a = ((z.softmax(-1) - y).abs() * (labels != -100)[..., None] / n.clamp(min=1)).reshape(m, 13)
        h = hidden.reshape(m, 8).abs()
        sizes = {"hidden": (a @ weight.abs()).max(), "weight": (a.T @ h).max(), "bias": a.sum(0).max()}
        atol = [reordered(13 if k == "hidden" else m, v.item()) + 2 * dz * v.item() for k, v in sizes.items()]
    torch.testing.assert_close(ours, plain, rtol=reordered(m, 1.0) + 2 * dz, atol=0)
    grads = zip(torch.autograd.grad(ours, (hidden, weight, bias)), torch.autograd.grad(plain, (hidden, weight, bias)))
    for (a, b), tol in zip(grads, atol):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


def test_token_logps_equal_log_softmax_gathered():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 6, 8, generator=g, requires_grad=True), torch.randn(17, 8, generator=g)
    labels = labelled(1, (2, 6), 17)
    plain = torch.log_softmax(hidden @ weight.T / 0.7, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    plain = plain * (labels != -100)
    ours = chunked_token_logps(hidden, weight, labels, chunk_size=5, temperature=0.7)
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), hidden)[0], torch.autograd.grad(plain.sum(), hidden)[0])


def llama(tie: bool = False, vocab: int = 64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, use_cache=False, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)  # ties lm_head to wte


def step_batch(seed: int, micro: int = 2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro):
        ids = torch.randint(0, 64, (3, 10), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        mask = torch.ones_like(ids)
        mask[0, 7:] = 0  # a padded row
        labels[0, 7:] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


@pytest.mark.parametrize("build", [llama, lambda: llama(tie=True), gpt2], ids=["llama", "llama-tied", "gpt2"])
def test_steps_match_the_plain_causal_lm_loss(build):
    model = build()
    opt = sgd(0.5)
    plain = make_step(model, causal_lm, opt)
    chunked = make_step(model, causal_lm, opt, objective=chunked_causal_lm(model, chunk_size=7))
    a = b = init_state(model, opt)
    bound = dict.fromkeys(a.params, 0.0)  # how far the runs' params may be apart (tests/tolerance.py)
    for seed in range(3):  # accumulation 2: the chunked loss divides by the whole step's count too
        # The chunks add the head's token terms in another order: each gradient within grad_atol of the
        # step's measured sizes (at the first params: the rest is second order); SGD moves by 0.5 of it.
        # The loss: its positive token terms reordered, plus its change at params within the bound.
        sizes, terms = causal_lm_step_abs_grads(model, step_batch(seed), a.params)
        shift = sum((sizes[k] * bound[k]).sum().item() for k in bound)
        a, b = plain(a, step_batch(seed)), chunked(b, step_batch(seed))
        loss = a.metrics["loss"].item()
        assert b.metrics["loss"].item() == pytest.approx(loss, abs=reordered(terms, loss) + shift, rel=0)
        bound = {k: bound[k] + 0.5 * v for k, v in grad_atol(sizes, terms).items()}
    for k in a.params:
        torch.testing.assert_close(b.params[k], a.params[k], rtol=sgd_rtol(3), atol=bound[k])


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward, each storage once (a checkpointed chunk re-saves the same weight)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_the_loss_keeps_a_fraction_of_the_plain_memory_at_vocab_32k():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 256, 64, generator=g, requires_grad=True)
    weight = torch.randn(32_000, 64, generator=g, requires_grad=True)
    labels = labelled(0, (2, 256), 32_000)
    n = count_shifted_labels(labels)
    plain = saved_bytes(lambda: causal_lm(hidden @ weight.T, labels, n))
    chunked = saved_bytes(lambda: chunked_cross_entropy(hidden[:, :-1], weight, labels[:, 1:], n, chunk_size=64))
    # what stays is the hidden states and the weight, which exist anyway; the logits never do
    assert chunked <= 0.25 * plain
    assert chunked <= (hidden.numel() + weight.numel()) * 4 + 4096


def test_models_whose_logits_are_not_a_linear_map_are_refused():
    with pytest.raises(ValueError, match="no output embedding"):
        chunked_causal_lm(torch.nn.Linear(2, 2))
    cfg = transformers.Gemma2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        chunked_causal_lm(transformers.Gemma2ForCausalLM(cfg))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_chunk_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunked_causal_lm(llama(), chunk_size=bad)


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit labels"):
        chunked_cross_entropy(torch.randn(2, 5, 4), torch.randn(7, 4), torch.zeros(2, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="outside the 7 rows"):
        chunked_cross_entropy(torch.randn(1, 2, 4), torch.randn(7, 4), torch.tensor([[1, 9]]), 2)


def test_dpo_log_probs_chunk_by_chunk_equal_the_logits_path():
    from trainfold.dpo.objective import dpo_objective, preference_collate

    model = llama()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    ref = {k: v.detach() + 0.01 * torch.randn_like(v) for k, v in model.named_parameters()}
    items = [
        {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6, 7, 8, 9]},
        {"prompt_ids": [10], "chosen_ids": [11, 12, 13], "rejected_ids": [14]},
    ]
    batch = preference_collate(eos_token_id=2)(items)

    def forward(p, inputs):
        return torch.func.functional_call(model, p, args=(), kwargs=dict(inputs))

    plain, chunked = dpo_objective(0.1, ref_params=ref), dpo_objective(0.1, ref_params=ref, model=model, chunk_size=3)
    n = plain.count_items(batch)
    (la, aux_a), (lb, aux_b) = plain(forward, params, batch, n), chunked(forward, params, batch, n)
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=1e-6)
    for k in aux_a:
        torch.testing.assert_close(aux_b[k], aux_a[k], rtol=1e-5, atol=1e-5)
    ga, gb = torch.autograd.grad(la, list(params.values())), torch.autograd.grad(lb, list(params.values()))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs model="):
        dpo_objective(0.1, chunk_size=3)


def test_grpo_log_probs_chunk_by_chunk_equal_the_logits_path():
    from trainfold.grpo.objective import grpo_objective

    model = llama()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (4, 9), generator=g)
    completion = torch.zeros_like(ids)
    completion[:, 4:] = 1
    completion[1, 7:] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": completion,
        "advantages": torch.tensor([1.0, -0.5, 0.25, 0.0]),
        "old_logps": -4.0 + 0.1 * torch.randn(4, 8, generator=g),
        "ref_logps": -4.0 + 0.1 * torch.randn(4, 8, generator=g),
    }

    def forward(p, inputs):
        return torch.func.functional_call(model, p, args=(), kwargs=dict(inputs))

    for loss_type in ("grpo", "bnpo"):
        plain = grpo_objective(loss_type, beta=0.04, temperature=0.9)
        chunked = grpo_objective(loss_type, beta=0.04, temperature=0.9, model=model, chunk_size=5)
        n = plain.count_items(batch)
        (la, aux_a), (lb, aux_b) = plain(forward, params, batch, n), chunked(forward, params, batch, n)
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
        for k in aux_a:
            torch.testing.assert_close(aux_b[k], aux_a[k], rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(la, list(params.values())), torch.autograd.grad(lb, list(params.values()))):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4).filter(lambda s: sum(s) <= 6), st.integers(0, 5))
def test_the_chunked_update_does_not_depend_on_how_the_step_is_split(split, seed):
    model = llama()
    opt = sgd(0.5)
    step = make_step(model, causal_lm, opt, objective=chunked_causal_lm(model, chunk_size=4))
    g = torch.Generator().manual_seed(seed)
    rows = sum(split)
    ids = torch.randint(0, 64, (rows, 8), generator=g)
    labels = labelled(seed, (rows, 8), 64)
    whole = step(init_state(model, opt), [{"input_ids": ids, "labels": labels}])
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    parts = [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(bounds, bounds[1:])]
    cut = step(init_state(model, opt), parts)
    # the same token terms in another order: within grad_atol, moved by 0.5 of it (tests/tolerance.py)
    atol = grad_atol(*causal_lm_step_abs_grads(model, parts, init_state(model, opt).params))
    for k, v in whole.params.items():
        torch.testing.assert_close(cut.params[k], v, rtol=EPS, atol=0.5 * atol[k])


@pytest.mark.slow  # inductor's C++ kernels: reduced, the graph is traced and run by aot_eager (no codegen)
def test_the_compiled_step_gives_the_eager_update(full_slow):
    from trainfold.core import losses

    model = llama()
    opt = sgd(0.5)  # linear: compiled kernels may sum in other orders, which AdamW would amplify (tolerance.py)
    batch = step_batch(0)
    objective = losses.chunked_causal_lm(model, 5)
    eager = make_step(model, causal_lm, opt, objective=objective)(init_state(model, opt), batch)
    compile = True if full_slow else "aot_eager"  # True: inductor
    out = make_step(model, causal_lm, opt, objective=objective, compile=compile)(init_state(model, opt), batch)
    atol = grad_atol(*causal_lm_step_abs_grads(model, batch, init_state(model, opt).params))
    for k, v in eager.params.items():
        torch.testing.assert_close(out.params[k], v, rtol=EPS, atol=0.5 * atol[k])


def test_a_model_whose_hidden_states_are_not_its_logits_input_is_refused():
    model = llama()
    model.get_output_embeddings().register_forward_hook(lambda mod, args, out: out * 2.0)  # logits scaled later
    with pytest.raises(ValueError, match="are not its logits"):
        chunked_causal_lm(model)

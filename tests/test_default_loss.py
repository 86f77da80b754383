"""The default loss comes from the model's task, as transformers' own loss would be chosen.

Examples per head (the loss equals the model's own HF loss), the shape checks, a Hypothesis
property (every built-in loss is invariant to the micro-batch × accumulation × world-size split),
then ``train`` against a real ``transformers.Trainer`` on tiny BERT / Llama heads.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume_fixture import ListDataset as Rows
from tolerance import EPS, assert_trees_within, grad_atol, reordered, row_abs_grads, sgd_atol, sgd_rtol
from torch import nn

from trainfold import TrainingArguments, adamw, init_state, make_step, sgd, train
from trainfold.core.forward import make_forward
from trainfold.core.losses import (
    bce_with_logits,
    causal_lm,
    cross_entropy,
    default_loss_for,
    mse,
    sequence_classification,
)
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.testing import on_simulated_ranks

transformers = pytest.importorskip("transformers")

V, T = 40, 6


def bert(head: str = "ForSequenceClassification", **config):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **config,
    )
    return getattr(transformers, f"Bert{head}")(cfg)


def llama(head: str = "ForSequenceClassification", **config):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        pad_token_id=0,
        **config,
    )
    return getattr(transformers, f"Llama{head}")(cfg)


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    )


def labels_for(kind: str, n: int, g: torch.Generator, num_labels: int = 3) -> torch.Tensor:
    if kind == "class":
        return torch.randint(0, num_labels, (n,), generator=g)
    if kind == "regression":
        return torch.randn(n, generator=g)
    if kind == "multi":
        return (torch.rand(n, num_labels, generator=g) < 0.5).float()
    labels = torch.randint(0, num_labels, (n, T), generator=g)  # tokens
    labels[torch.rand(n, T, generator=g) < 0.3] = -100
    return labels


def inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (n, T), generator=g), g


# -- which loss, per head ----------------------------------------------------------------------------


def test_the_default_loss_follows_the_head():
    tiny = TinyLM(TinyLMConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=1, max_len=4))
    assert default_loss_for(tiny) is causal_lm
    assert default_loss_for(llama("ForCausalLM")) is causal_lm
    assert default_loss_for(gpt2()) is causal_lm  # an LMHeadModel: HF's loss_type is None, still a causal LM
    assert default_loss_for(bert("ForTokenClassification", num_labels=3)) is cross_entropy
    assert default_loss_for(bert("ForMaskedLM")) is cross_entropy
    assert default_loss_for(bert(num_labels=3)) is sequence_classification
    assert default_loss_for(llama(num_labels=3)) is sequence_classification
    assert default_loss_for(bert(num_labels=1)) is mse
    assert default_loss_for(bert(num_labels=3, problem_type="regression")) is mse
    assert default_loss_for(bert(num_labels=3, problem_type="multi_label_classification")) is bce_with_logits
    assert default_loss_for(bert(num_labels=3, problem_type="single_label_classification")) is cross_entropy


@pytest.mark.parametrize(
    "make, kind, num_labels",
    [
        (lambda: bert(num_labels=3), "class", 3),
        (lambda: llama(num_labels=3), "class", 3),
        (lambda: bert(num_labels=1), "regression", 1),
        (lambda: llama(num_labels=1), "regression", 1),
        (lambda: bert(num_labels=3), "multi", 3),  # float labels: HF picks multi-label BCE at run time
        (lambda: bert("ForTokenClassification", num_labels=3), "tokens", 3),
        (lambda: bert("ForMaskedLM"), "tokens", V),
        (lambda: llama("ForCausalLM"), "tokens", V),
    ],
)
def test_the_default_loss_equals_the_models_own_loss(make, kind, num_labels):
    model = make()
    ids, g = inputs(4)
    labels = labels_for(kind, 4, g, num_labels)
    loss = default_loss_for(model)
    with torch.no_grad():
        hf = model(input_ids=ids, labels=labels).loss
        ours = loss(model(input_ids=ids), labels, loss.count_items(labels))
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-6)


def test_a_sequence_classifier_no_longer_learns_its_neighbours_label(tmp_path):
    model = bert(num_labels=3)
    ids, g = inputs(8)
    rows = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels_for("class", 8, g))]
    args = dict(
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        train_sampling_strategy="sequential",
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    default = train(copy.deepcopy(model), TrainingArguments(output_dir=str(tmp_path / "d"), **args), rows)
    explicit = train(
        model, TrainingArguments(output_dir=str(tmp_path / "e"), **args), rows, compute_loss_func=cross_entropy
    )
    for k, v in explicit.state.params.items():
        assert torch.equal(default.state.params[k], v), k


# -- shapes are checked, not broadcast ---------------------------------------------------------------


def test_causal_lm_refuses_one_label_per_sample():
    with pytest.raises(ValueError, match=r"causal_lm needs logits shaped \(batch, seq, vocab\).*cross_entropy"):
        causal_lm(torch.zeros(4, 3), torch.tensor([0, 1, 2, 1]), 3)


def test_mse_and_bce_refuse_shapes_they_would_broadcast():
    with pytest.raises(ValueError, match=r"regression logits of shape \(4, 1\) do not fit labels of shape \(4, 3\)"):
        mse(torch.zeros(4, 1), torch.zeros(4, 3), 12)
    with pytest.raises(ValueError, match=r"regression logits of shape \(4,\) do not fit labels of shape \(4, 1\)"):
        mse(torch.zeros(4), torch.zeros(4, 1), 4)
    with pytest.raises(ValueError, match=r"multi-label logits of shape \(4, 3\) do not fit labels of shape \(4,\)"):
        bce_with_logits(torch.zeros(4, 3), torch.zeros(4), 4)
    with pytest.raises(ValueError, match=r"logits of shape \(4, 3\) do not fit labels of shape \(4, 1\)"):
        cross_entropy(torch.zeros(4, 3), torch.zeros(4, 1, dtype=torch.long), 4)


def test_labels_of_another_dtype_are_named():
    with pytest.raises(TypeError, match=r"labels of dtype torch.int8 are neither class indices"):
        sequence_classification(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int8), 2)


@pytest.mark.parametrize(
    "model, why",
    [
        (nn.Linear(2, 2), "not a model whose task trainfold knows"),
        (None, "sequence-to-sequence"),
    ],
)
def test_an_unknown_task_asks_for_compute_loss_func(model, why):
    if model is None:
        model = transformers.T5ForConditionalGeneration(
            transformers.T5Config(vocab_size=V, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
        )
    with pytest.raises(
        TypeError, match=f"cannot choose a default loss for {type(model).__name__}: .*{why}.*compute_loss_func="
    ):
        default_loss_for(model)
    with pytest.raises(TypeError, match="compute_loss_func="):
        make_step(model, optimizer=adamw(1e-3))


def test_an_objective_needs_no_default_loss():
    model = nn.Linear(2, 1)

    def objective(forward, params, micro, num_items, key):
        return forward(params, {"input": micro["x"]}).sum(), {}

    opt = adamw(1e-2)
    new = make_step(model, optimizer=opt, objective=objective)(init_state(model, opt), [{"x": torch.ones(3, 2)}])
    assert new.step.item() == 1


# -- every built-in loss is invariant to the split ---------------------------------------------------

KINDS = {
    "class": (cross_entropy, 3),
    "seq": (sequence_classification, 3),
    "regression": (mse, 1),
    "regression3": (mse, 3),
    "multi": (bce_with_logits, 3),
    "tokens": (cross_entropy, 3),
}


def _head(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, KINDS[kind][1]))


def _data(kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, 5, generator=g) if kind == "tokens" else torch.randn(n, 5, generator=g)
    if kind == "regression3":
        return x, torch.randn(n, 3, generator=g)
    y = labels_for({"seq": "multi" if seed % 2 else "class"}.get(kind, kind), n, g)
    if kind == "regression" and seed % 2:
        y = y.unsqueeze(-1)  # (batch, 1) labels as well as (batch,) for (batch, 1) logits
    return x, y


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    seed=st.integers(0, 2**16),
    world=st.integers(1, 3),
    accumulation=st.integers(1, 3),
    micro=st.integers(1, 3),
)
def test_every_built_in_loss_is_invariant_to_the_split(kind, seed, world, accumulation, micro):
    loss = KINDS[kind][0]
    n = world * accumulation * micro
    x, y = _data(kind, n, seed)
    model = _head(kind, seed)
    opt = sgd(0.5, momentum=0.9)  # linear in the gradients: the summation order is not amplified (tolerance.py)
    state = init_state(model, opt)
    whole = make_step(model, loss, opt)(state, [{"input": x, "labels": y}])
    # The rows' terms (every output of every row or token) added in other orders: each gradient within
    # grad_atol of the rows' measured sizes; SGD's first step has momentum = gradient and moves the params
    # by 0.5 of it, rounded once (EPS |p|). The loss adds positive terms: 2 gamma relative, and each row's
    # forward (two layers, dot products of <= 9 terms) may round differently in another batch shape.
    forward, count, terms = make_forward(model, {}), whole.metrics["num_items"], y.numel() * 3
    row = lambda p, r: loss(forward(p, {"input": x[r : r + 1]}), y[r : r + 1], count)
    atol = grad_atol(row_abs_grads(row, state.params, range(n)), terms)

    def rank_step(collective):
        net = copy.deepcopy(model)  # one module per simulated rank
        mine = slice(collective.rank * accumulation * micro, (collective.rank + 1) * accumulation * micro)
        xs, ys = x[mine], y[mine]
        batch = [
            {"input": xs[i * micro : (i + 1) * micro], "labels": ys[i * micro : (i + 1) * micro]}
            for i in range(accumulation)
        ]
        return make_step(net, loss, opt, collective=collective)(init_state(net, opt), batch)

    for split in on_simulated_ranks(world, rank_step):
        if int(whole.metrics["num_items"]) == 0:
            assert int(split.metrics["num_items"]) == 0
            continue
        torch.testing.assert_close(split.metrics["loss"], whole.metrics["loss"], rtol=reordered(terms + 18, 1), atol=0)
        assert_trees_within(split.opt_state.momentum, whole.opt_state.momentum, atol, rtol=0)
        assert_trees_within(split.params, whole.params, {k: 0.5 * v for k, v in atol.items()}, rtol=EPS)


# -- against transformers.Trainer --------------------------------------------------------------------

STEPS = 3
SETTINGS = dict(
    max_steps=STEPS,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=1,
    learning_rate=1e-2,
    seed=7,
    train_sampling_strategy="sequential",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
)


@pytest.mark.parametrize(
    "make, kind, num_labels",
    [
        (lambda: bert(num_labels=3), "class", 3),
        (lambda: bert(num_labels=1), "regression", 1),
        (lambda: bert(num_labels=3), "multi", 3),
        (lambda: llama(num_labels=3), "class", 3),
        (lambda: llama(num_labels=1), "regression", 1),
        (lambda: bert("ForTokenClassification", num_labels=3), "tokens", 3),
    ],
    ids=["bert-3", "bert-regression", "bert-multi-label", "llama-3", "llama-regression", "bert-tokens"],
)
def test_train_matches_transformers_trainer_with_the_default_loss(tmp_path, make, kind, num_labels):
    base = make()
    ids, g = inputs(4 * STEPS, seed=1)
    labels = labels_for(kind, 4 * STEPS, g, num_labels)
    rows = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]
    # HF's BCEWithLogitsLoss takes the labels' mean where trainfold sums over the count: another order, so the
    # multi-label run uses plain SGD, linear in the gradients (tests/tolerance.py), and no clipping, on both sides.
    # Every other head is the same ops in the same order as HF's, AdamW included: bitwise.
    settings = {**SETTINGS, "optim": "sgd", "max_grad_norm": 0.0} if kind == "multi" else SETTINGS
    hf_model = copy.deepcopy(base)
    trainer = transformers.Trainer(
        model=hf_model,
        train_dataset=Rows(rows),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **settings),
    )
    trainer.train()
    hf_logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ours = train(copy.deepcopy(base), TrainingArguments(output_dir=str(tmp_path / "tf"), **settings), rows)
    our_logs = [h["loss"] for h in ours.log_history if "loss" in h and "train_loss" not in h]
    assert len(our_logs) == len(hf_logs) == STEPS
    if kind != "multi":
        assert our_logs == hf_logs
        for name, p in hf_model.named_parameters():
            assert torch.equal(ours.state.params[name], p.detach()), name
        return
    # A step's gradient adds its 4 rows' (token x label) terms in another order: within grad_atol of the rows'
    # sizes, measured at the initial params over all 12 rows (a superset of any step's) with a step's count
    # (4 rows x num_labels); their change at later params is second order. SGD at lr <= 1e-2 passes each step's
    # difference on unchanged (sgd_atol), and rounds each param once a step (sgd_rtol).
    forward, count, terms = make_forward(base, dict(base.named_buffers())), 4 * num_labels, 4 * T * num_labels
    row = lambda p, r: bce_with_logits(forward(p, {"input_ids": ids[r : r + 1]}), labels[r : r + 1], count)
    sizes = row_abs_grads(row, dict(base.named_parameters()), range(len(rows)))
    # The key bias's true gradient is 0 (softmax ignores a shift common to a query's scores): each row's gradient is
    # itself a cancellation, the sum over positions of the gradient at the key projection's output. Those terms are
    # the gradient of a bias given one row per position (F.linear broadcasts it): their sizes bound the sum's.
    key = "bert.encoder.layer.0.attention.self.key.bias"
    spread = {**dict(base.named_parameters()), key: base.get_parameter(key).detach().expand(T, -1).clone()}
    sizes[key] = row_abs_grads(row, spread, range(len(rows)))[key].sum(0)
    atol = grad_atol(sizes, terms)
    for name, p in hf_model.named_parameters():
        bound = sgd_atol(1e-2, STEPS, atol[name])
        torch.testing.assert_close(ours.state.params[name], p.detach(), atol=bound, rtol=sgd_rtol(STEPS), msg=name)
    # The loss logged at step t: a mean of positive (label) terms in another order, reordered(count, loss), plus its
    # first-order change at params within the bound of the t - 1 steps before (the sizes bound its gradient).
    for t, (a, b) in enumerate(zip(our_logs, hf_logs)):
        slack = sum(sizes[k].sum().item() * sgd_atol(1e-2, t, atol[k]) for k in sizes)
        assert a == pytest.approx(b, abs=reordered(count, b) + slack), t


def test_label_smoothing_takes_a_classifiers_default_loss_and_refuses_float_targets():
    from trainfold.core.losses import label_smoothed

    logits, labels = torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0])
    smoothed = label_smoothed(sequence_classification, 0.1)
    assert smoothed(logits, labels, 1).item() == label_smoothed(cross_entropy, 0.1)(logits, labels, 1).item()
    for loss in (mse, bce_with_logits):
        with pytest.raises(ValueError, match=f"{loss.__name__} takes float targets: set label_smoothing_factor=0"):
            label_smoothed(loss, 0.1)


def test_evaluate_and_predict_score_with_the_default_loss_too(tmp_path):
    from trainfold import evaluate, predict

    model = bert(num_labels=3)
    ids, g = inputs(8)
    labels = labels_for("class", 8, g)
    rows = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=8, report_to="none", disable_tqdm=True
    )
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels).loss.item()
    assert evaluate(model, args, rows)["eval_loss"] == pytest.approx(own, rel=1e-5)
    assert predict(model, args, rows).metrics["test_loss"] == pytest.approx(own, rel=1e-5)

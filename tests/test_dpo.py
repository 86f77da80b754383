"""DPO: collation, the loss math (pinned to TRL 1.16's numbers), the objective in the step, TRL parity."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import grad_atol, reordered, row_abs_grads, sgd_rtol

from trainfold import adamw, init_state, make_step, sgd
from trainfold.core.counting import count_pairs
from trainfold.core.generate import functional_forward
from trainfold.core.logps import sequence_logps
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.dpo.objective import (
    dpo_loss,
    dpo_objective,
    precompute_ref_logps,
    preference_collate,
)

CFG = TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=32)
EOS = 2

# The check batch of the TRL study (trl_semantics.md §3): two pairs, EOS = 2, pad = 0.
PAIRS = [
    {"prompt_ids": [1, 10, 11, 12], "chosen_ids": [20, 21, 22], "rejected_ids": [30, 31]},
    {"prompt_ids": [1, 40, 41], "chosen_ids": [50], "rejected_ids": [60, 61, 62, 63]},
]
# Per-sequence summed log-probs measured there (policy and reference Llama, float32).
POLICY_C, POLICY_R = torch.tensor([-37.269680, -17.901649]), torch.tensor([-21.883816, -37.465458])
REF_C, REF_R = torch.tensor([-36.879799, -19.122372]), torch.tensor([-26.492302, -43.460430])
LEN_C, LEN_R = torch.tensor([4.0, 2.0]), torch.tensor([3.0, 5.0])


def lm(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(CFG)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def random_pairs(seed: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        k = int(torch.randint(lo, hi, (), generator=g))
        return torch.randint(3, CFG.vocab_size, (k,), generator=g).tolist()

    return [{"prompt_ids": ids(1, 5), "chosen_ids": ids(1, 6), "rejected_ids": ids(1, 6)} for _ in range(n)]


# -- collation ------------------------------------------------------------------------------


def test_collate_puts_chosen_rows_first_then_rejected_right_padded_with_eos():
    batch = preference_collate(eos_token_id=EOS)(PAIRS)
    assert batch["input_ids"].tolist() == [
        [1, 10, 11, 12, 20, 21, 22, 2],
        [1, 40, 41, 50, 2, 0, 0, 0],
        [1, 10, 11, 12, 30, 31, 2, 0],
        [1, 40, 41, 60, 61, 62, 63, 2],
    ]
    assert batch["completion_mask"].tolist() == [
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 1, 1],
    ]
    assert batch["attention_mask"].sum(1).tolist() == [8, 5, 7, 8]


def test_collate_keeps_an_existing_eos_and_truncates_keeping_the_start():
    item = {"prompt_ids": [1, 5], "chosen_ids": [6, EOS], "rejected_ids": [7, 8, 9]}
    batch = preference_collate(eos_token_id=EOS, max_length=4)([item])
    assert batch["input_ids"].tolist() == [[1, 5, 6, EOS], [1, 5, 7, 8]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]


# -- the loss math --------------------------------------------------------------------------


def test_sigmoid_loss_matches_trl_study_and_beta_multiplies_the_whole_difference():
    loss = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1).mean().item()
    assert loss == pytest.approx(0.9670302, abs=1e-5)  # TRL compute_loss: 0.96702963
    # The precedence bug beta * chosen - rejected gives 5.2664 on this batch: not what we compute.
    rho_c, rho_r = POLICY_C - REF_C, POLICY_R - REF_R
    snippet = -F.logsigmoid(0.1 * rho_c - rho_r).mean().item()
    assert snippet == pytest.approx(5.26636, abs=1e-4)
    assert abs(loss - snippet) > 1


@pytest.mark.parametrize(
    ("loss_type", "beta", "smoothing", "expected"),
    [
        ("sigmoid", 0.5, 0.0, 2.526583),
        ("sigmoid", 1.0, 0.0, 4.893867),
        ("hinge", 0.1, 0.0, 1.488630),
        ("ipo", 0.1, 0.0, 37.618927),
        ("robust", 0.1, 0.1, 1.028108),
    ],
)
def test_loss_types_match_trl_study(loss_type, beta, smoothing, expected):
    loss = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta, loss_type, smoothing, LEN_C, LEN_R)
    assert loss.mean().item() == pytest.approx(expected, rel=2e-5, abs=2e-5)


def test_sequence_logps_sums_shifted_completion_tokens_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 5, 7, generator=g)
    ids = torch.tensor([[1, 2, 3, 4, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    lp = torch.log_softmax(logits, -1)
    expected = lp[0, 1, 3] + lp[0, 2, 4]  # position t scores token t+1
    assert sequence_logps(logits, ids, mask).item() == pytest.approx(expected.item(), abs=1e-6)


finite = st.floats(-50, 50, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, finite, finite, finite), min_size=1, max_size=6), st.floats(0.01, 2.0))
def test_loss_properties(rows, beta):
    pc, pr, rc, rr = (torch.tensor(col) for col in zip(*rows))
    originals = [t.clone() for t in (pc, pr, rc, rr)]
    sig = dpo_loss(pc, pr, rc, rr, beta)
    swapped = dpo_loss(pr, pc, rr, rc, beta)
    delta = (pc - rc) - (pr - rr)
    assert torch.all(sig >= 0) and torch.isfinite(sig).all()
    # -log σ(z) - (-log σ(-z)) = -z: swapping chosen and rejected flips the margin.
    torch.testing.assert_close(sig - swapped, -beta * delta, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, beta, "robust", 0.0), sig)
    for t, o in zip((pc, pr, rc, rr), originals):
        assert torch.equal(t, o)


# -- the objective --------------------------------------------------------------------------


def test_reference_equal_to_policy_gives_ln2_and_zero_rewards():
    model = lm(0)
    params = params_of(model)
    batch = preference_collate(EOS)(random_pairs(1, 4))
    obj = dpo_objective(beta=0.1, ref_params=params)
    loss, aux = obj(functional_forward(model), params, batch, obj.count_items(batch))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert all(
        aux[k].item() == 0 for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    )


def run_steps(objective, items_per_step, model, collate, n_micro=1, opt=None):
    opt = opt or adamw(1e-2)
    step = make_step(model, optimizer=opt, objective=objective)
    state = init_state(model, opt, seed=0)
    for items in items_per_step:
        size = -(-len(items) // n_micro)
        state = step(state, [collate(items[i : i + size]) for i in range(0, len(items), size)])
    return state


def test_precomputed_reference_equals_reference_params_and_split_does_not_matter():
    policy, ref = lm(0), lm(1)
    collate = preference_collate(EOS)
    items = random_pairs(2, 6)
    opt = sgd(0.5)  # linear in the gradients: other summation orders are not amplified (tests/tolerance.py)
    with_ref = run_steps(dpo_objective(0.1, ref_params=params_of(ref)), [items, items], policy, collate, opt=opt)
    stored = precompute_ref_logps(ref, params_of(ref), items, collate, batch_size=4)
    assert "ref_chosen_logps" not in items[0]
    pre = run_steps(dpo_objective(0.1), [stored, stored], policy, collate, n_micro=3, opt=opt)
    # The pairs' terms in other orders (micro-batches, reference batches): each step's gradient within
    # grad_atol of the pairs' measured sizes (at the first params: the rest is second order), and 2 steps
    # of SGD at 0.5 move the params by 0.5 of each. The metrics, logged by step 2, are its terms reordered
    # plus their change at params that step 1 left within 0.5 grad_atol: |d metric / d params| times that.
    objective, forward = dpo_objective(0.1, ref_params=params_of(ref)), functional_forward(policy)
    count = objective.count_items(collate(items))
    pair = lambda p, r: objective(forward, p, collate(items[r : r + 1]), count, None)[0]
    sizes = row_abs_grads(pair, params_of(policy), range(len(items)))
    terms = collate(items)["input_ids"].numel()
    atol = {k: 2 * 0.5 * v for k, v in grad_atol(sizes, terms).items()}
    whole = lambda p: objective(forward, p, collate(items), count, None)
    for k in (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        value = with_ref.metrics[k].item()
        slope = torch.func.grad(lambda p, k=k: whole(p)[0] if k == "loss" else whole(p)[1][k])(params_of(policy))
        shift = sum((slope[j].abs() * atol[j] / 2).sum().item() for j in slope)
        assert pre.metrics[k].item() == pytest.approx(value, abs=reordered(terms, abs(value)) + shift), k
    for k in with_ref.params:
        torch.testing.assert_close(pre.params[k], with_ref.params[k], atol=atol[k], rtol=sgd_rtol(2))


def test_training_raises_the_margin():
    policy, ref = lm(0), lm(0)
    collate = preference_collate(EOS)
    items = random_pairs(3, 8)
    obj = dpo_objective(0.5, ref_params=params_of(ref))
    state = run_steps(obj, [items] * 15, policy, collate)
    assert state.metrics["rewards/margins"].item() > 0.5
    assert state.metrics["rewards/accuracies"].item() > 0.8
    assert state.metrics["loss"].item() < math.log(2) - 0.2


# -- errors ---------------------------------------------------------------------------------


def test_errors_name_the_bad_value_and_the_fix():
    z = torch.zeros(1)
    with pytest.raises(ValueError, match="loss_type='kto'"):
        dpo_loss(z, z, z, z, 0.1, "kto")
    with pytest.raises(ValueError, match="no effect on loss_type='sigmoid'.*robust"):
        dpo_objective(0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing=0.5 must be in \[0, 0.5\)"):
        dpo_loss(z, z, z, z, 0.1, "robust", 0.5)
    with pytest.raises(ValueError, match="pass chosen_lengths and rejected_lengths"):
        dpo_loss(z, z, z, z, 0.1, "ipo")
    with pytest.raises(ValueError, match="beta=0"):
        dpo_objective(0)
    with pytest.raises(KeyError, match=r"lacks \['rejected_ids'\]"):
        preference_collate(EOS)([{"prompt_ids": [1], "chosen_ids": [2]}])
    with pytest.raises(ValueError, match="3 rows"):
        count_pairs({"input_ids": torch.zeros(3, 2)})
    model = lm(0)
    batch = preference_collate(EOS)(random_pairs(0, 2))
    with pytest.raises(KeyError, match="precompute_ref_logps"):
        dpo_objective()(functional_forward(model), params_of(model), batch, torch.tensor(2))


# -- parity with TRL ------------------------------------------------------------------------


def test_loss_and_metrics_match_trl(tmp_path):
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    names = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(3, 128)]
    word = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg)
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))

    def text(ids):
        return " ".join(names[i] for i in ids)

    rows = [
        {
            "prompt": text(p["prompt_ids"]),
            "chosen": f" {text(p['chosen_ids'])} ",
            "rejected": f" {text(p['rejected_ids'])} ",
        }
        for p in PAIRS
    ]
    args = trl.DPOConfig(output_dir=str(tmp_path), max_length=None, bf16=False, use_cpu=True, report_to=[], beta=0.1)
    trainer = trl.DPOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch).item()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    ours = preference_collate(EOS)(PAIRS)
    for k in ("input_ids", "attention_mask", "completion_mask"):
        assert ours[k].tolist() == trl_batch[k].tolist(), k
    obj = dpo_objective(0.1, ref_params=params_of(ref))
    loss, aux = obj(functional_forward(policy), params_of(policy), ours, obj.count_items(ours))
    assert loss.item() == pytest.approx(trl_loss, abs=1e-5)
    assert loss.item() == pytest.approx(0.96703, abs=1e-5)
    for k, v in aux.items():
        assert v.item() == pytest.approx(trl_metrics[k], abs=1e-5), k


def test_train_keeps_the_preference_columns_the_objective_reads(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainfold import TrainingArguments, train

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(cfg)  # forward(**kwargs): HF's column rule keeps only its named inputs
    ref = {k: v.detach().clone() for k, v in model.named_parameters()}
    items = [
        {"prompt_ids": [1, 2 + i % 5], "chosen_ids": [7, 8], "rejected_ids": [9 + i % 3], "text": "a row"}
        for i in range(8)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    result = train(
        model,
        args,
        items,
        data_collator=preference_collate(eos_token_id=2),
        objective=dpo_objective(0.1, ref_params=ref),
    )
    assert result.status == "completed"
    assert all("rewards/margins" in h for h in result.log_history if "loss" in h)


def test_token_metrics_of_a_uniform_policy_and_their_pair_weighting():
    # Uniform logits over 16 tokens: vocabulary-mean logit 0, entropy ln 16, argmax token 0 (never a completion token).
    def uniform(params, inputs):
        return torch.zeros(*inputs["input_ids"].shape, 16)

    lp = 2 * math.log(1 / 16)
    item = {"prompt_ids": [1], "chosen_ids": [4], "rejected_ids": [5], "ref_chosen_logps": lp, "ref_rejected_logps": lp}
    one, two = preference_collate(EOS)([item]), preference_collate(EOS)([item, item])
    obj = dpo_objective(0.1)
    total = {}
    for micro in (one, two):  # a step of 3 pairs: each micro-batch's token means weighted by its pairs
        _, aux = obj(uniform, {}, micro, torch.tensor(3))
        total = {k: total.get(k, 0) + v for k, v in aux.items()}
    assert total["entropy"].item() == pytest.approx(math.log(16), abs=1e-6)
    assert total["logits/chosen"].item() == 0 and total["mean_token_accuracy"].item() == 0
    assert total["rewards/margins"].item() == pytest.approx(0, abs=1e-6)  # the reference scores as the policy

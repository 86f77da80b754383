"""TRL's logged SFT and KTO metrics, as TRL 1.16 computes them: each micro-batch's (eval batch's) own value, averaged
over every micro-batch since the last log (over the eval batches), unweighted; a KTO micro-batch without desirable
(undesirable) rows left out of the ``chosen`` (``rejected``) means.

Each reference is a real ``SFTTrainer``/``KTOTrainer`` run on a tiny Llama, its data shaped so the conventions
differ from a token mean: micro-batches of unequal supervised token counts, steps of unequal micro-batch counts
(an epoch's short last step) in one logging window, eval batches of 3 and 1 rows.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_chat import llama, word_tokenizer

import trainfold
from trainfold.kto import KTOArguments
from trainfold.sft import run as sft
from trainfold.sft.args import SFTArguments

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

COMMON = dict(bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True)
KTO_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}assistant: {{ m['content'] }} </s> "
    "{% else %}user: {{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
SFT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}assistant: {% generation %}{{ m['content'] }} </s>"
    "{% endgeneration %} {% else %}user: {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# 10 rows in micro-batches of 2: 5 per epoch, so with 2 per step each epoch ends in a step of 1 micro-batch
RUN = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    per_device_eval_batch_size=3,
    learning_rate=3e-2,
    seed=5,
    eval_strategy="steps",
)


def words(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi, (), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 59, (n,), generator=g))


def prompt_completion_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)  # completions of 1 to 8 words: unequal supervised tokens per micro-batch
    return [{"prompt": words(g, 1, 4), "completion": " " + words(g, 1, 9)} for _ in range(n)]


def logged(history: list[dict], prefix: str = "") -> list[dict]:
    """Each log's metrics named ``{prefix}entropy``... (TRL's train/eval metrics), without the running token count."""
    names = ("entropy", "accuracy", "rewards/", "logps/", "logits/", "kl")
    keep = lambda k: k.startswith(prefix) and (prefix or not k.startswith("eval_")) and any(m in k for m in names)
    return [{k: v for k, v in e.items() if keep(k) and "num_tokens" not in k} for e in history if any(map(keep, e))]


def assert_same(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) > 0
    for mine, other in zip(ours, theirs, strict=True):
        assert set(mine) == set(other)
        for k in other:
            assert mine[k] == pytest.approx(other[k], rel=1e-5, abs=1e-7), (k, mine, other)


@pytest.mark.parametrize(("logging_steps", "max_steps"), [(1, 3), (2, 6)])
def test_sft_entropy_and_token_accuracy_are_trls_per_log_and_per_evaluation(tmp_path, logging_steps, max_steps):
    """Logging every step (the short third step alone) and every 2 steps (steps 3 and 4: 3 micro-batches, the mean
    over them, not over the 2 steps); evaluations over batches of 3 and 1 rows: the mean of the batch means."""
    rows, held_out = prompt_completion_rows(10, seed=0), prompt_completion_rows(4, seed=9)
    kw = {**COMMON, **RUN, "logging_steps": logging_steps, "max_steps": max_steps, "eval_steps": 3}
    config = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **kw)
    data, evals = datasets.Dataset.from_list(rows), datasets.Dataset.from_list(held_out)
    tokenizer = word_tokenizer(SFT_TEMPLATE)
    trainer = trl.SFTTrainer(llama(), args=config, train_dataset=data, eval_dataset=evals, processing_class=tokenizer)
    trainer.train()
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **kw)
    ours = sft.train(llama(), args, data, evals, processing_class=tokenizer).log_history
    theirs = trainer.state.log_history
    assert_same(logged(ours, "eval_"), logged(theirs, "eval_"))
    assert_same(logged(ours), logged(theirs))
    assert 0 < max(e["mean_token_accuracy"] for e in logged(ours) if "mean_token_accuracy" in e) < 1


def kto_rows() -> list[dict]:
    g = torch.Generator().manual_seed(4)  # desirable rows are rare: many micro-batches of 2 hold none
    return [{"prompt": words(g, 1, 4), "completion": " " + words(g, 1, 6), "label": i % 5 == 0} for i in range(10)]


@pytest.mark.parametrize(("logging_steps", "max_steps"), [(1, 3), (2, 6)])
def test_kto_metrics_leave_out_micro_batches_without_such_rows_as_trl(tmp_path, logging_steps, max_steps):
    """``rewards/chosen``, ``logps/chosen``, ``logits/chosen`` and ``rewards/margins`` are means over the micro-batches
    that hold desirable rows (absent from a log where none does), as TRL's; ``kl`` and ``entropy`` over every
    micro-batch; the evaluation's over its batches of 3 and 1 rows."""
    rows, held_out = kto_rows(), kto_rows()[:4]
    kw = {**COMMON, **RUN, "logging_steps": logging_steps, "max_steps": max_steps, "eval_steps": 3, "beta": 0.2}
    policy, tokenizer = llama(), word_tokenizer(KTO_TEMPLATE)
    trainer = trl.KTOTrainer(
        model=policy,
        ref_model=copy.deepcopy(policy),
        args=trl.KTOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **kw),
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(held_out),
        processing_class=tokenizer,
    )
    trainer.train()
    args = KTOArguments(output_dir=str(tmp_path / "tf"), **kw)
    data, evals = datasets.Dataset.from_list(rows), datasets.Dataset.from_list(held_out)
    ours = trainfold.kto.train(llama(), args, data, evals, processing_class=tokenizer).log_history
    theirs = trainer.state.log_history
    if logging_steps == 1:  # the data holds a log without desirable rows
        assert any("rewards/chosen" not in e for e in logged(theirs))
    assert_same(logged(ours, "eval_"), logged(theirs, "eval_"))
    assert_same(logged(ours), logged(theirs))


@pytest.mark.parametrize("variant", [{}, {"compile": "aot_eager"}, {"differentiable": True}])
def test_a_steps_sft_metrics_are_the_mean_of_its_micro_batches_token_means(variant):
    """Each step variant: ``state.metrics`` holds the plain mean of the micro-batches' own token means and their
    count under ``count_key``, whatever their token counts (here 1 and 6 supervised tokens)."""
    from trainfold import init_state, make_step, sgd
    from trainfold.core.losses import count_key
    from trainfold.core.models import TinyLM, TinyLMConfig
    from trainfold.sft.data import sft_loss, sft_token_metrics

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    ids = torch.randint(0, 16, (2, 8))
    short = torch.full((1, 8), -100).index_put_((torch.tensor([0]), torch.tensor([7])), ids[0, 7])  # 1 token
    batch = [{"input_ids": ids[:1], "labels": short}, {"input_ids": ids[1:], "labels": ids[1:].clone()}]
    batch[1]["labels"][0, :2] = -100  # 6 supervised tokens after the shift
    state = init_state(model, sgd(0.1))
    after = make_step(model, sft_loss, sgd(0.1), **variant)(state, batch)
    with torch.no_grad():
        means = [sft_token_metrics(model(mb["input_ids"]), mb["labels"], 0) for mb in batch]
    for k in ("entropy", "mean_token_accuracy"):
        assert after.metrics[k].item() == pytest.approx((means[0][k] + means[1][k]).item() / 2, rel=1e-5), k
        assert after.metrics[count_key(k)].item() == 2

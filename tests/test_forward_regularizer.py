"""A model whose forward adds a term to outputs.loss (a mixture of experts' router loss) is refused by name: the
step's loss comes from the logits, so ``transformers.Trainer``'s term would be dropped without a word."""

from __future__ import annotations

import pytest
import torch

from trainfold import TrainingArguments, init_state, make_step, sgd, train
from trainfold.core.losses import causal_lm

transformers = pytest.importorskip("transformers")


def mixtral(output_router_logits: bool):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=0.5,
        use_cache=False,
    )
    return transformers.MixtralForCausalLM(config)


def test_a_router_loss_the_step_would_drop_is_refused_by_name(tmp_path):
    model = mixtral(True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the reference: HF's loss holds the router term, the logits' cross entropy does not
        out = model(input_ids=ids, labels=ids)
        plain = causal_lm(out.logits, ids, torch.tensor(ids[:, 1:].numel()))
    assert out.loss == pytest.approx(float(plain) + 0.5 * float(out.aux_loss), rel=1e-5)
    with pytest.raises(ValueError, match=r"output_router_logits=True.*\(0.5\).*output_router_logits=False"):
        make_step(model, causal_lm, sgd(0.1))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none")
    with pytest.raises(ValueError, match="output_router_logits=True"):
        train(model, args.replace(disable_tqdm=True, save_strategy="no"), rows)


def test_without_router_logits_the_model_steps():
    model = mixtral(False)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    state = make_step(model, causal_lm, sgd(0.1))(init_state(model, sgd(0.1)), [{"input_ids": ids, "labels": ids}])
    assert int(state.step) == 1

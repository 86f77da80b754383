"""TRL 1.16's 15 DPO loss types and the MPO mix, each against TRL's own ``DPOTrainer`` loss code on the same log-probs.

TRL computes its loss inside ``DPOTrainer._compute_loss`` from the per-token log-probs its fused LM head
returns; the test hands a real trainer a stand-in model whose "fused head" returns fixed per-token
log-probs, with the reference log-probs given as precomputed columns, so TRL's loss code and ours
read exactly the same numbers.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.dpo.loss import DPO_LOSS_TYPES
from trainfold.dpo.objective import dpo_loss, dpo_objective, preference_collate

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

NAMES = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(3, 64)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = Tokenizer(models.WordLevel({n: i for i, n in enumerate(NAMES)}, unk_token="<pad>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=word, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=len(NAMES),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    args = trl.DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), max_length=None, use_cpu=True, report_to=[], beta=0.1
    )
    rows = [{"prompt": "t3", "chosen": " t4", "rejected": " t5"}]
    out = trl.DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=_tokenizer(),
    )
    out.precompute_ref_logps = True  # read ref_{chosen,rejected}_logps from the batch, as after a precompute
    return out


def batch_and_logps(seed: int, pairs: int = 5):
    """Return a collated preference batch and per-token log-probs (0 off the completions), as TRL's head does."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, len(NAMES), (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()

    items = [{"prompt_ids": [1, *ids(1, 4)], "chosen_ids": ids(1, 6), "rejected_ids": ids(1, 6)} for _ in range(pairs)]
    batch = preference_collate(eos_token_id=2)(items)
    mask = batch["completion_mask"][:, 1:]
    per_token = (-3 * torch.rand(mask.shape, generator=g)) * mask
    batch["ref_chosen_logps"] = per_token[:pairs].sum(1) + torch.randn(pairs, generator=g)
    batch["ref_rejected_logps"] = per_token[pairs:].sum(1) + torch.randn(pairs, generator=g)
    return batch, per_token


def trl_loss(trainer, batch, per_token, loss_type, beta=0.1, smoothing=0.0, weights=None):
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    trainer.loss_types, trainer.loss_weights = types, weights or [1.0] * len(types)
    trainer.beta, trainer.label_smoothing = beta, smoothing
    zeros = torch.zeros_like(per_token)

    def head(**kwargs):
        assert kwargs["fused_lm_head"]
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    return trainer._compute_loss(head, batch, return_outputs=False)


def our_loss(batch, per_token, loss_type, beta=0.1, smoothing=0.0, weights=None):
    chosen, rejected = per_token.sum(1).chunk(2)
    lengths = batch["completion_mask"][:, 1:].sum(1).float().chunk(2)
    losses = dpo_loss(
        chosen,
        rejected,
        batch["ref_chosen_logps"],
        batch["ref_rejected_logps"],
        beta,
        loss_type,
        smoothing,
        *lengths,
        loss_weights=weights,
    )
    return losses.mean()


SMOOTHING = {"robust": 0.1, "exo_pair": 1e-3, "aot": 0.05, "aot_unpaired": 0.05}


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_each_loss_type_equals_trls_on_the_same_logps(trainer, loss_type, beta):
    batch, per_token = batch_and_logps(seed=int(beta * 10))
    smoothing = SMOOTHING.get(loss_type, 0.0)
    theirs = trl_loss(trainer, batch, per_token, loss_type, beta, smoothing)
    ours = our_loss(batch, per_token, loss_type, beta, smoothing)
    # the same formulas in the same order on float32; sft sums row sums where TRL means the flattened tokens
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)


def test_a_weighted_list_of_loss_types_equals_trls_mpo_mix(trainer):
    batch, per_token = batch_and_logps(seed=3)
    types, weights = ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]
    theirs = trl_loss(trainer, batch, per_token, types, weights=weights)
    ours = our_loss(batch, per_token, types, weights=weights)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    parts = sum(w * our_loss(batch, per_token, t) for t, w in zip(types, weights, strict=True))
    assert ours.item() == pytest.approx(parts.item(), rel=1e-6)


def test_the_objective_takes_a_loss_list_and_its_loss_is_trls(trainer):
    batch, per_token = batch_and_logps(seed=4, pairs=3)
    logits = torch.zeros(*batch["input_ids"].shape, len(NAMES))  # a uniform policy: every token ln(1/V)
    uniform = torch.full_like(per_token, -torch.log(torch.tensor(float(len(NAMES))))) * batch["completion_mask"][:, 1:]
    obj = dpo_objective(0.3, ["sigmoid", "apo_zero"], loss_weights=[1.0, 0.5])
    loss, _ = obj(lambda p, inputs: logits, {}, batch, obj.count_items(batch))
    theirs = trl_loss(trainer, batch, uniform, ["sigmoid", "apo_zero"], beta=0.3, weights=[1.0, 0.5])
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["aot", "aot_unpaired", "sft", "discopop", "nca_pair"]))
def test_losses_are_finite_and_do_not_depend_on_the_pair_order(seed, loss_type):
    batch, per_token = batch_and_logps(seed, pairs=4)
    chosen, rejected = per_token.sum(1).chunk(2)
    lengths = batch["completion_mask"][:, 1:].sum(1).float().chunk(2)
    ref = (batch["ref_chosen_logps"], batch["ref_rejected_logps"])
    eps = SMOOTHING.get(loss_type, 0.0)
    loss = dpo_loss(chosen, rejected, *ref, 0.2, loss_type, eps, *lengths).mean()
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(seed))
    permuted = [t[perm] for t in (chosen, rejected, *ref, *lengths)]
    again = dpo_loss(*permuted[:4], 0.2, loss_type, eps, *permuted[4:]).mean()
    assert torch.isfinite(loss)
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)


def test_bad_loss_settings_are_named():
    z = torch.zeros(2)
    with pytest.raises(ValueError, match=r"label_smoothing=0.0 must be in \(0, 1\) for exo_pair"):
        dpo_loss(z, z, z, z, 0.1, "exo_pair")
    with pytest.raises(ValueError, match="2 weights for 1 loss types"):
        dpo_objective(0.1, "sigmoid", loss_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"\['sft'\] is length-normalised"):
        dpo_loss(z, z, z, z, 0.1, ["sigmoid", "sft"])
    with pytest.raises(ValueError, match="'kto'"):
        dpo_objective(0.1, ["sigmoid", "kto"])
    with pytest.raises(ValueError, match="no effect on loss_type=.*aot"):
        dpo_objective(0.1, "apo_zero", label_smoothing=0.1)

"""TRL 1.16's GRPO loss types (cispo, sapo, luspo with sequence-level ratios, vespo...) against TRL's own loss code.

``GRPOTrainer._compute_loss`` is called on a stand-in trainer that carries only the settings it reads
and returns fixed per-token log-probs from its log-prob function, so TRL's loss code and
``GRPOObjective.loss_from_logps`` read exactly the same numbers.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.grpo.loss import GRPO_LOSS_TYPES, PolicyLoss, policy_token_losses
from trainfold.grpo.objective import grpo_objective

trl = pytest.importorskip("trl")

PROMPT, COMPLETION, ROWS = 3, 5, 6


def tensors(seed: int):
    """Completion log-probs of the policy, the sampling policy and the reference, a mask and advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, COMPLETION + 1, (ROWS,), generator=g)
    mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
    logps = -2 * torch.rand(ROWS, COMPLETION, generator=g)
    old = logps + 0.4 * torch.randn(ROWS, COMPLETION, generator=g)
    ref = logps + 0.3 * torch.randn(ROWS, COMPLETION, generator=g)
    adv = torch.randn(ROWS, generator=g)
    return logps, old, ref, mask, adv


def trl_loss(loss_type, logps, old, ref, mask, adv, beta=0.0, **cfg):
    logps = logps.clone().requires_grad_(True)
    args = SimpleNamespace(
        use_bias_correction_kl=True,
        delta=cfg.get("delta"),
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=1,
    )
    metrics = defaultdict(lambda: defaultdict(list))
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=cfg.get("importance_sampling_level", "token"),
        beta=beta,
        args=args,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=cfg.get("epsilon_high", 0.2),
        get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=COMPLETION,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=metrics,
    )
    inputs = {
        "prompt_ids": torch.ones(ROWS, PROMPT, dtype=torch.long),
        "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
        "completion_ids": torch.ones(ROWS, COMPLETION, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss = trl.GRPOTrainer._compute_loss(stub, None, inputs)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach(), grad, {k: v[-1] for k, v in metrics["train"].items()}


def ours(loss_type, logps, old, ref, mask, adv, beta=0.0, **cfg):
    """The same numbers in trainfold's layout: rows ``prompt + completion``, log-probs ``(rows, seq - 1)``."""
    width = PROMPT + COMPLETION - 1

    def place(x):  # completion position t scores token PROMPT + t, at column PROMPT - 1 + t
        out = torch.full((ROWS, width), -7.0)
        out[:, PROMPT - 1 :] = x
        return out

    full = place(logps).requires_grad_(True)
    completion_mask = torch.cat([torch.zeros(ROWS, PROMPT, dtype=torch.long), mask], 1)
    batch = {
        "completion_mask": completion_mask,
        "advantages": adv,
        "old_logps": place(old),
        "ref_logps": place(ref),
        "generation_tokens": mask.sum()[None],
        "generation_micro_batches": torch.tensor([1]),
        "step_micro_batches": torch.tensor([1]),
    }
    obj = grpo_objective(loss_type, beta=beta, max_completion_length=COMPLETION, **cfg)
    loss, aux = obj.loss_from_logps(full, torch.zeros_like(full), batch, obj.count_items(batch))
    (grad,) = torch.autograd.grad(loss, full)
    return loss.detach(), grad[:, PROMPT - 1 :], aux


CASES = [
    ("grpo", {}),
    ("bnpo", {}),
    ("dr_grpo", {}),
    ("dapo", {}),
    ("dapo", {"delta": 1.5}),
    ("cispo", {"epsilon_high": 1.1}),
    ("sapo", {}),
    ("luspo", {"importance_sampling_level": "sequence"}),
    ("grpo", {"importance_sampling_level": "sequence"}),
    ("vespo", {}),
]


@pytest.mark.parametrize(("loss_type", "cfg"), CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_gradient_and_metrics_equal_trls(loss_type, cfg, beta):
    inputs = tensors(seed=len(loss_type) + int(beta * 100))
    t_loss, t_grad, t_metrics = trl_loss(loss_type, *inputs, beta=beta, **cfg)
    o_loss, o_grad, o_metrics = ours(loss_type, *inputs, beta=beta, **cfg)
    # the same formulas on float32; sums over differently shaped (but equal) masked tensors
    assert o_loss.item() == pytest.approx(t_loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(o_grad, t_grad, rtol=1e-5, atol=1e-7)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "cispo_clip_ratio"):
        if name in t_metrics:
            assert o_metrics[name].item() == pytest.approx(t_metrics[name], rel=1e-5, abs=1e-7), name
    if "vespo/phi_seq_mean" in t_metrics:  # TRL's token mean of a (rows, 1) value: a mean over the completions
        assert o_metrics["vespo/phi_seq_mean"].item() == pytest.approx(t_metrics["vespo/phi_seq_mean"], rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(GRPO_LOSS_TYPES), st.sampled_from(["token", "sequence"]))
def test_on_policy_losses_are_minus_the_advantage_times_a_known_factor(seed, loss_type, level):
    logps, _, _, mask, adv = tensors(seed)
    p = PolicyLoss(loss_type, epsilon_high=5.0, importance_sampling_level=level)  # cispo: the cap 5 > r
    loss, ratio = policy_token_losses(logps, logps, adv, mask.float(), p)
    assert torch.allclose(ratio, torch.ones_like(ratio))
    a = adv[:, None].expand_as(logps if level == "token" else ratio)
    if loss_type in ("cispo", "vespo"):  # r = 1: the factor is 1 and the loss is -A log π
        torch.testing.assert_close(loss, -a * logps)
    elif loss_type == "sapo":  # (4/τ) σ(0) = 2/τ
        tau = torch.where(a > 0, 1.0, 1.05)
        torch.testing.assert_close(loss, -2 / tau * a)
    else:
        torch.testing.assert_close(loss, -a)


def test_bad_policy_settings_are_named():
    with pytest.raises(ValueError, match="importance_sampling_level='seq'"):
        grpo_objective("luspo", importance_sampling_level="seq")
    with pytest.raises(ValueError, match="delta=1.1 must be > 1 \\+ epsilon_high"):
        grpo_objective("dapo", delta=1.1)
    with pytest.raises(TypeError, match="unknown settings \\['sapo_temp'\\]"):
        grpo_objective("sapo", sapo_temp=1.0)


# -- rewards: GDPO, unscored rows, metrics ----------------------------------------------------


def trl_gdpo(each: torch.Tensor, g: int, weights: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's normalize_then_sum (grpo_trainer.py, _generate_and_score_completions), with its nanstd."""
    from trl.trainer.utils import nanstd

    unscored = torch.isnan(each).all(dim=1)
    grouped = each.view(-1, g, each.shape[1])
    per_func = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    total = (per_func.view(-1, each.shape[1]) * weights[None]).nansum(dim=1)
    total[unscored] = torch.nan
    return torch.nan_to_num((total - torch.nanmean(total)) / (nanstd(total).expand_as(total) + 1e-4), nan=0.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([2, 4]), st.integers(1, 3), st.booleans())
def test_normalize_then_sum_is_trls_gdpo(seed, g, funcs, with_none):
    from trainfold.grpo.rewards import reward_advantages

    gen = torch.Generator().manual_seed(seed)
    each = torch.randint(0, 5, (4 * g, funcs), generator=gen).float()  # ties are common: z-scores of equal rewards
    if with_none:
        each[torch.rand(each.shape, generator=gen) < 0.2] = torch.nan
    weights = torch.rand(funcs, generator=gen) + 0.5
    ours = reward_advantages(each, g, weights.tolist(), multi_objective_aggregation="normalize_then_sum")
    # TRL works in float32, we in float64: equal where float32 rounding stays far below the +1e-4 in the denominators
    torch.testing.assert_close(ours, trl_gdpo(each, g, weights), rtol=1e-4, atol=1e-4)
    assert not ours.isnan().any()


def test_a_completion_no_reward_function_scores_is_warned_about(caplog):
    from trainfold.grpo.rewards import combine_rewards

    def never(prompts, completions, **_):
        return [None] * len(completions)

    def some(prompts, completions, **_):
        return [None if c == "b" else 1.0 for c in completions]

    with caplog.at_level("WARNING"):
        combine_rewards([never, some], ["p", "q"], ["a", "a"])
    assert "returned None" not in caplog.text
    with caplog.at_level("WARNING"):
        total, _ = combine_rewards([never, some], ["p", "q"], ["a", "b"])
    assert "all reward functions returned None for 1 of 2 completions" in caplog.text
    assert "prompt='q'" in caplog.text
    assert total[1].isnan()


def test_grpo_arguments_take_the_new_loss_settings_and_refuse_bad_ones():
    from trainfold.grpo.args import GRPOArguments

    args = GRPOArguments(loss_type="luspo", importance_sampling_level="sequence", sapo_temperature_neg=2.0)
    assert args.policy_loss == PolicyLoss("luspo", importance_sampling_level="sequence", sapo_temperature_neg=2.0)
    assert GRPOArguments(multi_objective_aggregation="normalize_then_sum").multi_objective_aggregation
    with pytest.raises(ValueError, match="(?s)multi_objective_aggregation='sum'.*importance_sampling_level='tok'"):
        GRPOArguments(importance_sampling_level="tok", multi_objective_aggregation="sum")

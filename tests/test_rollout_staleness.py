"""The staleness bound and TRL's importance-sampling correction, as pure functions (trainfold.rollout.staleness)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.rollout.staleness import importance_sampling_ratio, stale_token_mask, staleness_decisions


def trl_ratio(old, sampled, mask, mode, clip_min, clip_max):
    """TRL 1.x ``GRPOTrainer._generate_and_score_completions`` (grpo_trainer.py l.2660-2707), transcribed."""
    per_token_logps_diff = (old - sampled) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)


logps = st.lists(st.floats(-8.0, 0.0, width=32), min_size=6, max_size=6)
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@settings(max_examples=60, deadline=None)
@given(
    old=logps,
    sampled=logps,
    bits=st.lists(st.booleans(), min_size=6, max_size=6),
    mode=st.sampled_from(MODES),
    clip=st.sampled_from([(None, 3.0), (0.5, 2.0), (0.9, None), (None, 1.5)]),
)
def test_the_ratio_is_trls_bitwise(old, sampled, bits, mode, clip):
    old_t, sampled_t = torch.tensor(old).view(2, 3), torch.tensor(sampled).view(2, 3)
    mask = torch.tensor(bits, dtype=torch.float32).view(2, 3)
    ours = importance_sampling_ratio(old_t, sampled_t, mask, mode, *clip)
    assert torch.equal(ours, trl_ratio(old_t, sampled_t, mask, mode, *clip))


def test_nan_sampling_logps_count_as_no_correction():
    old = torch.tensor([[-1.0, -2.0]])
    sampled = torch.tensor([[float("nan"), -2.0]])
    assert importance_sampling_ratio(old, sampled, torch.ones(1, 2), "token_truncate").tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("mode", MODES)
def test_on_policy_log_probs_give_ratio_one(mode):
    lp = torch.tensor([[-0.3, -1.2, -2.0]])
    ratio = importance_sampling_ratio(lp, lp.clone(), torch.ones(1, 3), mode)
    assert ratio.eq(1.0).all() and ratio.shape == ((1, 3) if mode.startswith("token") else (1, 1))


@settings(max_examples=60, deadline=None)
@given(
    versions=st.lists(st.integers(0, 20), min_size=1, max_size=12),
    bound=st.integers(0, 6),
    extra=st.integers(0, 5),
    on_stale=st.sampled_from(["drop", "mask"]),
)
def test_a_completion_is_kept_exactly_when_its_age_is_within_the_bound(versions, bound, extra, on_stale):
    current = max(versions) + extra
    out = staleness_decisions(versions, current, bound, on_stale)
    assert out == ["keep" if current - v <= bound else on_stale for v in versions]
    # a looser bound keeps everything a tighter one keeps
    looser = staleness_decisions(versions, current, bound + 1, on_stale)
    assert all(b == "keep" for a, b in zip(out, looser) if a == "keep")
    # the token mask agrees with the per-completion rule
    assert stale_token_mask(torch.tensor(versions), current, bound).tolist() == [d == "keep" for d in out]


def test_max_staleness_zero_is_on_policy():
    assert staleness_decisions([5, 4, 5], 5, 0) == ["keep", "drop", "keep"]


def test_bad_settings_are_named_all_at_once():
    with pytest.raises(ValueError, match=r"max_staleness=-1 .*on_stale='skip'"):
        staleness_decisions([0], 0, -1, "skip")
    with pytest.raises(ValueError, match="newer than the current 2"):
        staleness_decisions([3], 2, 1)
    with pytest.raises(ValueError, match=r"'token_clip' is not one of .*clip_min=2.0 must be < clip_max=1.0"):
        importance_sampling_ratio(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "token_clip", 2.0, 1.0)
    with pytest.raises(ValueError, match="needs vllm_importance_sampling_clip_min or _clip_max"):
        importance_sampling_ratio(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "token_truncate", None, None)

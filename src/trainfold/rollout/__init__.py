"""Rollout engines: where online RL generates, behind one small versioned protocol.

``RolloutEngine`` (:mod:`trainfold.rollout.engine`): ``publish(version, weights)`` (atomic), ``submit``
seeded requests, ``poll`` completions with per-token log-probs and weight versions, ``state_dict`` of what is
in flight. Backends: ``LocalEngine`` (in process, synchronous), ``ProcessEngine`` (a generation server
process, weights pushed in buckets over a 2-rank ``torch.distributed`` group), ``VLLMEngine`` (vLLM's native
weight-transfer API; vLLM imported only there). Staleness and importance-sampling pieces, pure functions of
versions and log-probs: :mod:`trainfold.rollout.staleness`.
"""

from trainfold.rollout.engine import (
    Completion,
    EngineDied,
    RolloutEngine,
    RolloutRequest,
    SamplingSpec,
    gather_weights,
)
from trainfold.rollout.local import LocalEngine
from trainfold.rollout.process import ProcessEngine
from trainfold.rollout.staleness import importance_sampling_ratio, stale_token_mask, staleness_decisions
from trainfold.rollout.vllm import VLLMEngine

__all__ = [
    "Completion",
    "EngineDied",
    "LocalEngine",
    "ProcessEngine",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingSpec",
    "VLLMEngine",
    "gather_weights",
    "importance_sampling_ratio",
    "stale_token_mask",
    "staleness_decisions",
]

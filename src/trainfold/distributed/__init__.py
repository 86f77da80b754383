"""Process groups (``trainfold.distributed``): collectives, torchrun, failures across ranks, data shards."""

from trainfold.distributed.distributed import (
    GatherCollective,
    ProcessGroupCollective,
    SingleProcess,
    agreed_stop,
    collective_from_env,
    failure_of,
    group_timeout,
    joins_torchrun,
    process_group_collective,
)
from trainfold.distributed.shards import shard, shard_bounds

__all__ = [
    "GatherCollective",
    "ProcessGroupCollective",
    "SingleProcess",
    "agreed_stop",
    "collective_from_env",
    "failure_of",
    "group_timeout",
    "joins_torchrun",
    "process_group_collective",
    "shard",
    "shard_bounds",
]

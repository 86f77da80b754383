"""Process groups: collectives, torchrun, failures across ranks, data shards."""

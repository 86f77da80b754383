"""Checkpoints: the safetensors+JSON format, sharded storage, policies, the run directory, preemption."""

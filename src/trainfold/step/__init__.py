"""The training step: the micro-batch driver, compiled and sharded variants, mixed precision, recomputation."""

"""Training recipes on top of the step: NEFTune, DPO, GRPO, generation, ensembles."""

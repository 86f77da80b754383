"""The base layer: tensor trees, the state record, randomness, forward functions, losses, the fold."""

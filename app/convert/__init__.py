"""python -m app convert MODE: checkpoints turned into checkpoints of another head."""

"""python -m app analyze MODE: analyses of trained checkpoints and of the synthetic language."""

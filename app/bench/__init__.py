"""python -m app bench MODE: speed and memory measurements of heads and tasks."""

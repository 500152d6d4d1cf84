"""python -m app convert MODE: a checkpoint turned into a checkpoint of another head (``ds``) or
into an exported inference program of its head (``export``)."""

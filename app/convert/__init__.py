"""python -m app convert MODE: a checkpoint turned into a checkpoint of another head (``ds``) or
into an ONNX file or ``torch.export`` program of its head or its whole language model (``export``)."""

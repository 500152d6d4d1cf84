"""Checkpoints of an older form, rewritten into the form today's tasks read.

Each task class applies one of these in its ``upgrade_checkpoint`` classmethod, which the
checkpoint reader calls right after reading a file (``--ckpt_path``, the CLI's hyper-parameter
merge, ``analyze``, ``convert``, ``bench``). A checkpoint already in today's form is returned
unchanged. State-dict keys did not change (the encoder is still the task's ``encoder``).
"""

from __future__ import annotations

from typing import Any

#: The language model's flat encoder arguments before the encoder became a component:
#: ``encoder`` name -> (class path, {old argument: encoder argument}).
LM_ENCODERS: dict[str, tuple[str, dict[str, str]]] = {
    "awd_lstm": ("tasks.encoders.AWDLSTMEncoder", {
        key: key for key in ("embedding_dim", "hidden_size", "num_layers", "last_hidden_size", "dropout_embedding",
                             "dropout_input", "dropout_hidden", "dropout_output", "weight_drop")
    }),
    "transformer": ("tasks.encoders.TransformerLMEncoder", {
        "embedding_dim": "embedding_dim", "num_layers": "num_layers", "transformer_heads": "num_heads",
        "hidden_size": "feedforward_dim", "dropout_output": "dropout", "max_length": "max_length",
    }),
}
LM_FLAT_KEYS = {key for _, renames in LM_ENCODERS.values() for key in renames}

#: Encoder class paths of classification checkpoints -> where the classes live now.
MOVED_ENCODERS = {
    "tasks.mlp.MLPEncoder": "tasks.encoders.MLPEncoder",
    "tasks.cnn.HanziCNN": "tasks.encoders.HanziCNN",
    "tasks.cnn.ResNet18Encoder": "tasks.encoders.ResNet18Encoder",
}


def upgrade_language_model(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``encoder: awd_lstm`` (or ``transformer``) beside flat ``embedding_dim``, ``hidden_size``,
    ... -> ``encoder: {class_path: tasks.encoders.AWDLSTMEncoder, init_args: {...}}``.

    The transformer's arguments are renamed on the way (``transformer_heads`` -> ``num_heads``,
    ``hidden_size`` -> ``feedforward_dim``, ``dropout_output`` -> ``dropout``); the dropouts a
    transformer never used are dropped.
    """
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, dict):
        return checkpoint
    name = hparams.get("encoder", "awd_lstm")
    if isinstance(name, dict) or ("encoder" not in hparams and not LM_FLAT_KEYS & set(hparams)):
        return checkpoint  # today's form (or nothing of the encoder saved)
    if name not in LM_ENCODERS:
        raise ValueError(
            f"checkpoint names the language model encoder {name!r}; checkpoints of the flat form know "
            f"{', '.join(LM_ENCODERS)} (it was edited or written by another version of the project)"
        )
    class_path, renames = LM_ENCODERS[name]
    encoder = {"class_path": class_path, "init_args": {new: hparams[old] for old, new in renames.items() if old in hparams}}
    upgraded: dict[str, Any] = {}
    for key, value in hparams.items():
        if key == "num_classes":
            upgraded[key] = value
            upgraded["encoder"] = encoder
        elif key != "encoder" and key not in LM_FLAT_KEYS:
            upgraded[key] = value
    upgraded.setdefault("encoder", encoder)
    return {**checkpoint, "hyper_parameters": upgraded}


def upgrade_classification(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Encoder class paths of the modules the encoders moved out of (``tasks.mlp.MLPEncoder``,
    ``tasks.cnn.HanziCNN``) -> their place in :mod:`tasks.encoders`. The old paths still import
    (alias modules), so this only makes a resumed run's configuration name today's place."""
    from datamodules.hierarchy import upgrade_hierarchy_checkpoint  # hierarchy data drawn before Eq. 7 was the default

    checkpoint = upgrade_hierarchy_checkpoint(checkpoint)
    hparams = checkpoint.get("hyper_parameters")
    encoder = hparams.get("encoder") if isinstance(hparams, dict) else None
    if not isinstance(encoder, dict) or encoder.get("class_path") not in MOVED_ENCODERS:
        return checkpoint
    encoder = {**encoder, "class_path": MOVED_ENCODERS[encoder["class_path"]]}
    return {**checkpoint, "hyper_parameters": {**hparams, "encoder": encoder}}


def moved_option(task: str, option: str) -> str | None:
    """Where an argument of a task's former flat signature is set today, for the parser's error
    line (``--model.init_args.hidden_size 32`` on a language model -> the encoder's
    ``hidden_size``); ``None`` for an option that never belonged to the task."""
    name = task.rsplit(".", 1)[-1]
    if name == "LanguageModel":
        targets = [(renames[option], path.rsplit(".", 1)[-1]) for path, renames in LM_ENCODERS.values() if option in renames]
        if len({target for target, _ in targets}) == 1:
            return f"model.init_args.encoder.init_args.{targets[0][0]}"
        return " or ".join(f"model.init_args.encoder.init_args.{target} ({encoder})" for target, encoder in targets) or None
    if name == "TranslationTask":
        from tasks.translation import LEGACY_NETWORK_KEYS

        if option in ("architecture", "preset"):
            return "model.init_args.network.class_path (tasks.encoders.LuongAttentionSeq2Seq or tasks.encoders.TransformerSeq2Seq)"
        if option in LEGACY_NETWORK_KEYS:
            transformer = {"embed_dim": "d_model"}.get(option)
            return f"model.init_args.network.init_args.{option}" + (f" (TransformerSeq2Seq: {transformer})" if transformer else "")
    if name == "CaptioningTask":
        from tasks.captioning import LEGACY_DECODER_KEYS

        if option in ("weights", "freeze_encoder"):
            return f"model.init_args.encoder.init_args.{'trainable (negated)' if option == 'freeze_encoder' else option}"
        if option in LEGACY_DECODER_KEYS:
            return f"model.init_args.decoder.init_args.{option}"
    return None

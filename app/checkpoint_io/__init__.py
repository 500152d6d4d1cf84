"""Checkpoints are data: the one reader (:mod:`.reading`), the classes a checkpoint may name
(:mod:`.classes`), the one writer (:mod:`.writing`) and the one way models and data are rebuilt
from a checkpoint (:mod:`.restoring`)."""

from app.checkpoint_io.classes import PROJECT_PACKAGES, project_class  # noqa: F401
from app.checkpoint_io.reading import read_checkpoint  # noqa: F401
from app.checkpoint_io.restoring import checkpoint_class_conflict, checkpoint_model_config, restore  # noqa: F401
from app.checkpoint_io.writing import AtomicCheckpointIO, CheckpointWriteError, in_memory  # noqa: F401

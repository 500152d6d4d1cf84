"""Checkpoints are data: the one reader (:mod:`.reading`), the classes a checkpoint may name
(:mod:`.classes`), the policy of what a checkpoint decides (:mod:`.policy`: the architecture,
never what runs or where), the one writer (:mod:`.writing`) and the rebuilding of a model and its
data from a checkpoint alone (:mod:`.restoring`)."""

from app.checkpoint_io.classes import PROJECT_PACKAGES, project_class  # noqa: F401
from app.checkpoint_io.reading import read_checkpoint  # noqa: F401
from app.checkpoint_io.restoring import restore  # noqa: F401
from app.checkpoint_io.writing import AtomicCheckpointIO, CheckpointWriteError, in_memory  # noqa: F401

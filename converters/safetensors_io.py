"""Old import path of :mod:`ferrule.safetensors_io` (safetensors reading/writing moved to the core,
which the train engine uses to load HF weights); kept so that existing imports keep working."""

from ferrule.safetensors_io import (  # noqa: F401
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    SafetensorsReader,
    ShardedSafetensorsWriter,
)

__all__ = ["CheckpointError", "SafetensorsReader", "ShardedSafetensorsWriter", "SINGLE_FILE", "INDEX_FILE"]

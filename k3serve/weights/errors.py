"""Typed checkpoint errors; each names the tensor and the file when they are known."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be served as it is; the message says what to fix."""

    def __init__(self, message: str, tensor: str | None = None, file: str | None = None):
        self.tensor, self.file = tensor, file
        where = "".join([f" [tensor {tensor}]" if tensor else "", f" [file {file}]" if file else ""])
        super().__init__(message + where)


class MissingTensorError(CheckpointError):
    """A tensor the config requires is absent."""


class UnexpectedTensorError(CheckpointError):
    """A tensor the config does not describe is present."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape differs from what the config implies."""


class DtypeMismatchError(CheckpointError):
    """A tensor's dtype cannot serve its role (e.g. float where MXFP4 bytes are expected)."""


class TruncatedShardError(CheckpointError):
    """A shard file is shorter than its header says."""


class BadIndexError(CheckpointError):
    """model.safetensors.index.json disagrees with the shards."""


class NonFiniteWeightError(CheckpointError):
    """A weight holds NaN or Inf (or an MXFP4 block scale is the E8M0 NaN code 0xFF)."""

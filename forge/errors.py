"""Errors of the build toolkit. Each says what failed and where, in one line."""

from __future__ import annotations


class ForgeError(Exception):
    """A build step failed. The message is the single line the CLI prints."""


class MatrixError(ForgeError):
    """matrix.toml is malformed, or a cell name is unknown."""


class FetchError(ForgeError):
    """An artifact could not be fetched, or its sha256 did not match."""


class TransformError(ForgeError):
    """A transform matched nothing, too much, needed fuzz, or produced broken code."""


class WheelError(ForgeError):
    """A wheel is truncated, corrupt, or cannot be re-packed."""


class DiffMismatchError(ForgeError):
    """A cell's change differs from its reviewed diff."""


class PublishError(ForgeError):
    """The index refused an upload, or could not be reached."""

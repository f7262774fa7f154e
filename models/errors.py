"""Errors with messages meant for users: each says what was expected."""

from __future__ import annotations


class CosyEdgeError(Exception):
    """Base class: the CLI prints these without a traceback."""


class BundleError(CosyEdgeError):
    """A model bundle is missing, malformed, of another format version, or
    built for another GPU / TensorRT version."""


class CheckpointError(CosyEdgeError):
    """A model directory is not a CosyVoice 2 checkpoint."""


class RequestError(CosyEdgeError):
    """A synthesis request is invalid. `code` is stable and machine-readable
    (it is what the daemon puts in the MQTT error payload)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class SynthesisError(CosyEdgeError):
    """The engine failed at run time (a backend session raised, a GPU error)."""


class MissingExtraError(CosyEdgeError):
    """An optional heavy package is not installed."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the Python package '{package}', which is not installed; "
            f"install it with: pip install 'cosyedge[{extra}]'"
        )
        self.package = package
        self.extra = extra

"""Errors of the audio layer, with messages meant for users."""

from __future__ import annotations

from cosyedge_models.errors import CosyEdgeError


class AudioDeviceError(CosyEdgeError):
    """No such audio device, or PortAudio is missing or refuses the settings."""

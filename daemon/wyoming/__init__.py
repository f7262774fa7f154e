"""Home Assistant's Wyoming protocol: the TTS server (`[wyoming] uri`), the
board as a Wyoming satellite (`[wyoming.satellite] uri`), their zeroconf
advertisement and the `cosyedge say --wyoming` client. Requests go through
the daemon's one scheduler, router, metrics and trace (via `Intake.admit`);
only the framing and the answer path (`responder.py`) are Wyoming's own."""

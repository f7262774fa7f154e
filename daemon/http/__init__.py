"""The OpenAI-style HTTP speech API of `cosyedge run` (`[http] listen`):
wire parsing and encoding only; requests go through the one builder and the
one admission path like every other front end."""

"""Streaming synthesis on Triton over gRPC: one bidirectional stream per
request on the decoupled model, the chunks yielded as they arrive, and the
failures sorted into transient (worth a retry before the first chunk) and
final ones. Each worker thread owns its own client (a tritonclient stream is
not thread-safe)."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from cosyedge_cloud.bridge.settings import TritonSettings
from cosyedge_cloud.triton.model_io import OUTPUTS, BadTensors, ModelChunk, model_chunk, parse_error, request_tensors
from cosyedge_cloud.wire.protocol import CloudRequest
from cosyedge_models.errors import MissingExtraError

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a wait for the next chunk looks at the cancel flag


class SynthesisFailed(Exception):
    """`code` is a protocol error code; `transient` says a retry may help."""

    def __init__(self, code: str, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.transient = transient


def _grpc() -> Any:
    try:
        import tritonclient.grpc as grpcclient
    except ImportError:
        raise MissingExtraError("tritonclient[grpc]", "cloud", "the cloud bridge's Triton client") from None
    return grpcclient


def classify(error: Exception, pinned: bool) -> SynthesisFailed:
    """Sort a Triton / gRPC error (tritonclient's InferenceServerException)."""
    message = error.message() if hasattr(error, "message") and callable(error.message) else str(error)
    message = str(message or error)
    status = str(error.status()) if hasattr(error, "status") and callable(error.status) else ""
    ours = parse_error(message)
    if ours is not None:
        kind, code, text = ours
        if kind == "request":
            return SynthesisFailed(code, text)
        return SynthesisFailed("model_error", text)
    low = message.lower()
    if "deadline" in status.lower() or "deadline exceeded" in low:
        return SynthesisFailed("timeout", f"Triton: {message}", transient=False)
    if "timeout" in low and "queue" in low:
        return SynthesisFailed("deadline_exceeded", f"Triton queue timeout: {message}")
    # "Request for unknown model: 'm' version 9 is not found": that version is not loaded (a bad pin);
    # without "version" the whole model is not loaded (being reloaded?): transient, below
    if pinned and re.search(r"version \d+ is not (found|ready|at ready state)", low):
        return SynthesisFailed("unknown_version", f"Triton: {message}")
    transient_marks = (
        "unavailable",
        "failed to connect",
        "connection refused",
        "socket closed",
        "not ready",
        "unknown model",
        "exceeds maximum queue size",
        "stream removed",
        "broken pipe",
        "connection reset",
        "goaway",
        "cancelled",
        "no longer in valid state",
    )
    if "UNAVAILABLE" in status or any(m in low for m in transient_marks):
        return SynthesisFailed("unavailable", f"Triton: {message}", transient=True)
    return SynthesisFailed("model_error", f"Triton: {message}")


class TritonStreamer:
    def __init__(self, settings: TritonSettings) -> None:
        self.settings = settings
        self._grpc = _grpc()
        self._local = threading.local()
        self._clients: list[Any] = []
        self._lock = threading.Lock()

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._grpc.InferenceServerClient(self.settings.url)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def _drop_client(self) -> None:
        """After a broken stream, start the next request on a fresh channel."""
        client = getattr(self._local, "client", None)
        self._local.client = None
        if client is not None:
            with self._lock:
                if client in self._clients:
                    self._clients.remove(client)
            try:
                client.close()
            except Exception:  # closing a broken channel may raise; it is gone either way
                log.debug("closing a Triton client failed", exc_info=True)

    def _inputs(self, request: CloudRequest) -> list[Any]:
        prompt = request.prompt
        tensors = request_tensors(
            request.text,
            mode=request.mode,
            voice=request.voice,
            instruct_text=request.instruct_text,
            prompt_pcm=None if prompt is None else prompt.pcm,
            prompt_sample_rate=None if prompt is None else prompt.sample_rate,
            prompt_text="" if prompt is None else prompt.text,
            seed=request.seed,
            speed=request.speed,
            stream=request.stream,
        )
        inputs = []
        for name, array in tensors.items():
            datatype = "BYTES" if array.dtype == np.object_ else ("INT32" if array.dtype == np.int32 else "FP32")
            tensor = self._grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def stream(
        self,
        request: CloudRequest,
        version: str,
        tag: str,
        cancel: threading.Event,
        first_chunk_by: float | None = None,
    ) -> Iterator[ModelChunk]:
        """Chunks of one request. `first_chunk_by` (time.monotonic) tightens
        the first-chunk timeout to the request's deadline. Raises
        SynthesisFailed; cancelling (the flag, or closing the generator)
        cancels the request in Triton."""
        s = self.settings
        client = self._client()
        responses: queue.Queue[tuple[Any, Any]] = queue.Queue()

        def on_response(result: Any, error: Any) -> None:
            responses.put((result, error))

        started = time.monotonic()
        queue_timeout_us = 0
        if first_chunk_by is not None:
            queue_timeout_us = max(1, int((first_chunk_by - started) * 1e6))
        finished = False
        broken = False
        try:
            client.start_stream(callback=on_response, stream_timeout=s.request_timeout_s)
            client.async_stream_infer(
                s.model,
                self._inputs(request),
                model_version=version,
                request_id=tag,
                outputs=[self._grpc.InferRequestedOutput(n) for n in OUTPUTS],
                enable_empty_final_response=True,
                timeout=queue_timeout_us or None,
            )
            got_first = False
            last_at = started
            while True:
                limit = s.chunk_timeout_s if got_first else s.first_chunk_timeout_s
                wait_until = last_at + limit
                if not got_first and first_chunk_by is not None:
                    wait_until = min(wait_until, first_chunk_by)
                try:
                    result, error = responses.get(timeout=_POLL_S)
                except queue.Empty:
                    if cancel.is_set():
                        return
                    if time.monotonic() >= wait_until:
                        if not got_first and first_chunk_by is not None and wait_until >= first_chunk_by:
                            raise SynthesisFailed("deadline_exceeded", "no audio from Triton by the deadline") from None
                        raise SynthesisFailed(
                            "timeout",
                            f"no {'further ' if got_first else ''}audio from Triton within {limit:g} s",
                        ) from None
                    continue
                if error is not None:
                    failure = classify(error, pinned=bool(version))
                    broken = failure.transient
                    raise failure
                response = result.get_response()
                final = (
                    response.parameters["triton_final_response"].bool_param
                    if "triton_final_response" in response.parameters
                    else False
                )
                if response.outputs:
                    try:
                        chunk = model_chunk({n: result.as_numpy(n) for n in OUTPUTS}, response.model_version)
                    except BadTensors as exc:
                        raise SynthesisFailed("model_error", str(exc)) from None
                    got_first = True
                    last_at = time.monotonic()
                    yield chunk
                    if cancel.is_set():
                        return
                if final:
                    finished = True
                    return
        except SynthesisFailed:
            raise
        except Exception as exc:  # start_stream / async_stream_infer raise InferenceServerException
            broken = True
            # "the stream is no longer in valid state": the cause went to the callback
            try:
                _, cause = responses.get(timeout=1.0)
            except queue.Empty:
                cause = None
            raise classify(cause if cause is not None else exc, pinned=bool(version)) from None
        finally:
            try:
                client.stop_stream(cancel_requests=not finished)
            except Exception:
                broken = True
                log.debug("stopping a Triton stream failed", exc_info=True)
            if broken:
                self._drop_client()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:
                log.debug("closing a Triton client failed", exc_info=True)

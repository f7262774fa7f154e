"""The Triton Python-backend model `cosyvoice2`: an orchestrator that loads
a model bundle through `cosyedge_models.synthesis.synthesizer.load_synthesizer` and streams every audio
chunk of a request back as its own response (a decoupled model).

Runs inside tritonserver's Python backend stub (the `model.py` of each
version directory imports `TritonPythonModel` from here); the project must be
importable there (`.venv-triton` puts this checkout on its path).

Batching: Triton's dynamic batcher hands `execute` up to max_batch_size
requests at once; they are all submitted to the engine concurrently (a thread
each, each with its own streaming state) as one request group
(models/batching/group.py): with the engine's continuous batching on
(LLM_MAX_BATCH_SIZE > 0) none of them starts decoding until all have reached
the LLM (or failed before it, BATCH_GATHER_TIMEOUT_MS at most), so the batch
shares its decode steps from the first one. Every request streams its own
responses and fails alone. `execute` returns when the batch is done, so Triton
queues and batches what arrives meanwhile. More instances (instance_group
count) run more batches at once.

Where the bundle comes from, first match wins:
  1. `<model dir>/<version>/bundle` (a link that `cosyedge triton` creates),
  2. the model parameter BUNDLE_DIR,
  3. the environment variable COSYEDGE_BUNDLE.
Other parameters: ENGINE_BACKEND (`ort` here, `trt` on a GPU server with the
bundle's TensorRT engines) and ENGINE_FACTORY (`module:function`, called as
``factory(bundle_dir, backend=...)``; default `cosyedge_models.synthesis.synthesizer:load_synthesizer`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from cosyedge_cloud.triton.model_io import INPUTS, BadTensors, error_message, response_tensors, synthesis_request
from cosyedge_models.batching.group import GroupedSynthesizer, RequestGroup
from cosyedge_models.errors import BundleError, CosyEdgeError, RequestError
from cosyedge_models.synthesis.api import Synthesizer

DEFAULT_FACTORY = "cosyedge_models.synthesis.synthesizer:load_synthesizer"
DEFAULT_GATHER_TIMEOUT_MS = 2000.0


def gather_timeout_s(params: dict[str, str]) -> float:
    """BATCH_GATHER_TIMEOUT_MS: how long the first requests of a batch wait at
    the LLM for the batch's slower ones (their text front end, voice prompt)."""
    raw = params.get("BATCH_GATHER_TIMEOUT_MS") or ""
    try:
        value = float(raw) if raw else DEFAULT_GATHER_TIMEOUT_MS
    except ValueError:
        raise CosyEdgeError(f"BATCH_GATHER_TIMEOUT_MS must be a number of milliseconds, got {raw!r}") from None
    if not 0.0 <= value <= 60_000.0:
        raise CosyEdgeError(f"BATCH_GATHER_TIMEOUT_MS must be between 0 and 60000 ms, got {value:g}")
    return value / 1e3


def resolve_bundle(
    model_dir: Path,
    version: str,
    params: dict[str, str],
    environ: dict[str, str] | os._Environ[str] = os.environ,
) -> Path:
    link = model_dir / version / "bundle"
    if link.exists():
        return link.resolve()
    if params.get("BUNDLE_DIR"):
        return Path(params["BUNDLE_DIR"])
    if environ.get("COSYEDGE_BUNDLE"):
        return Path(environ["COSYEDGE_BUNDLE"])
    raise CosyEdgeError(
        f"no model bundle for {model_dir.name} version {version}: link it at {link}, set the model "
        "parameter BUNDLE_DIR, or the environment variable COSYEDGE_BUNDLE "
        "(cosyedge triton --bundle does the first)"
    )


def load_factory(spec: str) -> Callable[..., Synthesizer]:
    module_name, _, func = spec.partition(":")
    if not module_name or not func:
        raise CosyEdgeError(f"ENGINE_FACTORY must be 'module:function', got {spec!r}")
    factory: Callable[..., Synthesizer] = getattr(importlib.import_module(module_name), func)
    return factory


GRAPH_BATCHING_VALUES = ("auto", "true", "false")


def engine_kwargs(params: dict[str, str], backend: str, bundle: Path | None = None) -> dict[str, Any]:
    """Extra factory arguments from the model parameters: LLM_MAX_BATCH_SIZE > 0
    turns on the engine's continuous batching, so the requests of a Triton
    batch (served on parallel threads) share the LLM's decode steps;
    FLOW_MAX_BATCH_SIZE > 0 batches their flow estimator and vocoder calls on the
    dynamic graphs. GRAPH_BATCHING (auto: on with ENGINE_BACKEND ort-cuda) puts the
    batch on the captured fixed-shape graphs instead: the LLM steps on the bundle's
    fused batched step (graph_batching) and, where `bundle` has the batched estimator
    graphs, the streams' estimator windows in one replay (graph_flow_batch); the
    dynamic flow batching is then off (it would turn the fixed-shape flow off).
    GRAPH_ENCODER_BATCH, LLM_CAPTURED_PREFILL and GRAPH_VOCODER_BATCH (true, false;
    false by default) add the batched encoder windows, the captured prefill and the
    batched vocoder graphs there (_switch). STREAM_HOP_SCALE and STREAM_MAX_HOP_TOKENS grow the
    streaming hop (_hop_growth), with or without batching."""
    from cosyedge_models.batching.policy import BatchSettings

    def batching(prefix: str) -> BatchSettings | None:
        try:
            size = int(params.get(f"{prefix}_MAX_BATCH_SIZE") or 0)
            delay_ms = float(params.get(f"{prefix}_MAX_QUEUE_DELAY_MS") or 0.0)
        except ValueError as exc:
            raise CosyEdgeError(f"{prefix}_MAX_BATCH_SIZE must be an integer and {prefix}_MAX_QUEUE_DELAY_MS a "
                                f"number: {exc}") from exc
        return BatchSettings(max_batch_size=size, max_queue_delay_ms=delay_ms) if size > 0 else None

    graph = (params.get("GRAPH_BATCHING") or "auto").strip().lower()
    if graph not in GRAPH_BATCHING_VALUES:
        raise CosyEdgeError(f"GRAPH_BATCHING must be one of {', '.join(GRAPH_BATCHING_VALUES)}, got {graph!r}")
    llm, flow = batching("LLM"), batching("FLOW")
    hop = _hop_growth(params)
    if llm is None and flow is None and not hop:
        return {}
    from cosyedge_models.synthesis.settings import SynthesisSettings

    if (llm is None and flow is None) or not (graph == "true" or (graph == "auto" and backend == "ort-cuda")):
        return {"settings": SynthesisSettings(backend=backend, batching=llm, flow_batching=flow, **hop)}
    graph_flow = graph == "true" or (bundle is not None and _has_batched_flow(bundle))
    return {"settings": SynthesisSettings(backend=backend, batching=llm, graph_batching=llm is not None, **hop,
                                          graph_flow_batch=graph_flow,
                                          graph_encoder_batch=_switch(params, "GRAPH_ENCODER_BATCH"),
                                          llm_captured_prefill=_switch(params, "LLM_CAPTURED_PREFILL"),
                                          graph_vocoder_batch=_switch(params, "GRAPH_VOCODER_BATCH"),
                                          graph_flow_overflow_slots=_overflow_slots(params),
                                          graph_flow_gather_ms=_gather_ms(params))}


SWITCH_VALUES = ("true", "false")


def _switch(params: dict[str, str], name: str) -> bool:
    """An on/off model parameter for the captured graphs' options (off by default as in the daemon's
    [tts]; docs/gpu.md says what each measured): GRAPH_ENCODER_BATCH (graph_encoder_batch: the streams' flow
    encoder windows in one replay, with the lanes), LLM_CAPTURED_PREFILL (llm_captured_prefill) and
    GRAPH_VOCODER_BATCH (graph_vocoder_batch: the streams' vocoder chunks of one length in one replay)."""
    value = (params.get(name) or "false").strip().lower()
    if value not in SWITCH_VALUES:
        raise CosyEdgeError(f"{name} must be one of {', '.join(SWITCH_VALUES)}, got {value!r}")
    return value == "true"


def _overflow_slots(params: dict[str, str]) -> int:
    """GRAPH_FLOW_OVERFLOW_SLOTS (graph_flow_overflow_slots): single-stream slots beside the batched lanes
    (default the engine's; 0: every request on a lane, and their memory to the lanes)."""
    from cosyedge_models.backends.fixed_shapes import OVERFLOW_FLOW_SLOTS

    value = (params.get("GRAPH_FLOW_OVERFLOW_SLOTS") or "").strip()
    if not value:
        return OVERFLOW_FLOW_SLOTS
    if not value.isdigit():
        raise CosyEdgeError(f"GRAPH_FLOW_OVERFLOW_SLOTS must be a whole number of streams >= 0, got {value!r}")
    return int(value)


def _gather_ms(params: dict[str, str]) -> float:
    """GRAPH_FLOW_GATHER_MS (graph_flow_gather_ms): how long a request's later chunk may wait for other
    requests' chunks before its flow, out of the audio it has queued (unset or 0: off)."""
    from cosyedge_models.synthesis.flow_gather import MAX_GATHER_MS

    value = (params.get("GRAPH_FLOW_GATHER_MS") or "").strip()
    try:
        ms = float(value) if value else 0.0
    except ValueError:
        ms = math.nan
    if not 0 <= ms <= MAX_GATHER_MS:
        raise CosyEdgeError(f"GRAPH_FLOW_GATHER_MS must be a number of ms from 0 (off) to {MAX_GATHER_MS:.0f}, "
                            f"got {value!r}")
    return ms


def _hop_growth(params: dict[str, str]) -> dict[str, Any]:
    """STREAM_HOP_SCALE (hop_scale, 1 to 4; unset: 1, a fixed hop) and STREAM_MAX_HOP_TOKENS (max_hop_tokens;
    unset or 0: 4x the hop), as the daemon's [tts] stream_hop_scale and stream_max_hop_tokens: fewer, longer
    later chunks (50 keeps them on the 128-frame fixed-shape windows, docs/gpu.md). Only what is set."""
    out: dict[str, Any] = {}
    scale = (params.get("STREAM_HOP_SCALE") or "").strip()
    if scale:
        try:
            out["hop_scale"] = float(scale)
        except ValueError:
            out["hop_scale"] = math.nan
        if not 1.0 <= out["hop_scale"] <= 4.0:
            raise CosyEdgeError(f"STREAM_HOP_SCALE must be a number from 1 (a fixed hop) to 4, got {scale!r}")
    cap = (params.get("STREAM_MAX_HOP_TOKENS") or "").strip()
    if cap:
        if not cap.isdigit():
            raise CosyEdgeError(f"STREAM_MAX_HOP_TOKENS must be a whole number of speech tokens (0: 4x the hop), "
                                f"got {cap!r}")
        if int(cap):
            out["max_hop_tokens"] = int(cap)
    return out


def _has_batched_flow(bundle: Path) -> bool:
    """Whether the bundle was exported with --batch-flow-sizes (its manifest has the batched estimator graphs)."""
    from cosyedge_models.bundle.loader import BATCH_FLOW_PREFIX

    try:
        stages = json.loads((bundle / "manifest.json").read_text()).get("stages", {})
    except (OSError, ValueError):
        return False  # the engine's own load reports a broken bundle
    return any(str(name).startswith(BATCH_FLOW_PREFIX) for name in stages)


class TritonPythonModel:
    """The class name is what the Python backend looks for."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # only inside the server

        self.pb = pb_utils
        self.log = pb_utils.Logger
        config: dict[str, Any] = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise CosyEdgeError(
                "cosyvoice2 streams chunks: its config needs model_transaction_policy { decoupled: true }"
            )
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.version = args["model_version"]
        bundle = resolve_bundle(Path(args["model_repository"]), self.version, params)
        backend = params.get("ENGINE_BACKEND") or "ort"
        factory = load_factory(params.get("ENGINE_FACTORY") or DEFAULT_FACTORY)
        started = time.perf_counter()
        self.engine = factory(bundle, backend=backend, **engine_kwargs(params, backend, bundle))
        self.gather_s = gather_timeout_s(params)
        self.log.log_info(
            f"cosyvoice2 v{self.version}: {self.engine.name} from {bundle} "
            f"({self.engine.sample_rate} Hz) in {time.perf_counter() - started:.1f} s"
        )
        self.pool = ThreadPoolExecutor(
            max_workers=max(1, int(config.get("max_batch_size") or 1)),
            thread_name_prefix=f"cosyvoice2-v{self.version}",
        )

    def execute(self, requests: list[Any]) -> None:
        engine = self.engine
        group = (engine.request_group(len(requests), self.gather_s) if isinstance(engine, GroupedSynthesizer)
                 else nullcontext(None))
        with group as members:
            futures = [self.pool.submit(self._serve, request, len(requests), members) for request in requests]
            wait(futures)
        return None  # decoupled: every response went out through the senders

    def _inputs(self, request: Any) -> dict[str, Any]:
        tensors = {}
        for name in INPUTS:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                tensors[name] = tensor.as_numpy()
        return tensors

    def _error(self, sender: Any, kind: str, code: str, text: str) -> None:
        error = self.pb.TritonError(error_message(kind, code, text))
        sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _serve(self, request: Any, batch: int = 1, group: RequestGroup | None = None) -> None:
        try:
            self._stream(request, batch)
        finally:
            if group is not None:
                group.ended()  # a member that failed before the LLM no longer holds the others back

    def _stream(self, request: Any, batch: int) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        cancel = threading.Event()
        try:
            synth = synthesis_request(self._inputs(request))
            for chunk in self.engine.synthesize(synth, cancel):
                if request.is_cancelled():
                    cancel.set()  # the client went away: stop the engine, no more responses
                    break
                # triton_batch: the size of the Triton batch this request came in (beside the engine's llm_batch_max)
                times = {**chunk.times.as_dict(), "triton_batch": batch}
                tensors = response_tensors(chunk.pcm, chunk.sample_rate, chunk.index, chunk.last, times)
                sender.send(pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in tensors.items()]))
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except BadTensors as exc:
            self._error(sender, "request", "bad_tensors", str(exc))
        except RequestError as exc:
            self._error(sender, "request", exc.code, str(exc))
        except BundleError as exc:  # e.g. zero-shot on a bundle without the speech tokenizer
            self._error(sender, "request", "unsupported", str(exc))
        except Exception as exc:  # a run-time failure answers this request only; the model keeps serving
            self.log.log_error(f"cosyvoice2 v{self.version}: synthesis failed: {type(exc).__name__}: {exc}")
            self._error(sender, "engine", "engine_error", f"{type(exc).__name__}: {exc}")

    def finalize(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.engine.close()

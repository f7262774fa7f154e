"""Loading and checking a model bundle (see models/bundle/BUNDLE.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.backends.engine_meta import EngineIdentity, check_engines
from cosyedge_models.errors import BundleError, CosyEdgeError

log = logging.getLogger(__name__)

FORMAT = "cosyedge-bundle"
FORMAT_VERSION = 2  # 2: the flow estimator takes and returns streaming caches
FAMILIES = ("cosyvoice2",)
# Files carried as shipped in a CosyVoice 2 directory (upstream's names).
CARRIED_FILES = {"campplus": "campplus.onnx", "speech_tokenizer": "speech_tokenizer_v2.onnx"}
STAGES = ("llm_prefill", "llm_decode", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder")
# Exported on request (build export --static-decode-len), onnxruntime only:
# the fixed-size decode step that ort-cuda captures as a CUDA graph.
OPTIONAL_STAGES = ("llm_decode_static", "llm_kv_pad")
# ... and (build export --static-flow-windows) one fixed-shape flow estimator per window size
STATIC_FLOW_PREFIX = "flow_estimator_static_w"
# the fixed-length vocoder graphs (build export --static-vocoder): prefix + mel frames
STATIC_VOCODER_PREFIX = "hift_static_f"
# the fixed-shape streaming flow encoder graphs (with --static-flow-windows): prefix + window tokens
STATIC_ENCODER_PREFIX = "flow_encoder_static_t"
# what ort-cuda captures, by name
FIXED_SHAPE_PREFIXES = (STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX, STATIC_ENCODER_PREFIX)
# the estimator windows batched across streams (edge_build/export/flow_batch.py; captured too)
BATCH_FLOW_PREFIX = "flow_estimator_batch_b"
BATCH_FLOW_NAME = re.compile(rf"^{BATCH_FLOW_PREFIX}(\d+)_w(\d+)$")  # groups: batch size, window frames
# the streaming encoder windows batched across streams (edge_build/export/flow_encoder_batch.py; captured too)
BATCH_ENCODER_PREFIX = "flow_encoder_batch_b"
BATCH_ENCODER_NAME = re.compile(rf"^{BATCH_ENCODER_PREFIX}(\d+)_t(\d+)$")  # groups: batch size, window tokens
# the fixed-length vocoder graphs batched across streams (edge_build/export/hift_static.py; captured too)
BATCH_VOCODER_PREFIX = "hift_batch_b"
BATCH_VOCODER_NAME = re.compile(rf"^{BATCH_VOCODER_PREFIX}(\d+)_f(\d+)$")  # groups: batch size, mel frames
BATCHED_PREFIXES = (BATCH_FLOW_PREFIX, BATCH_ENCODER_PREFIX, BATCH_VOCODER_PREFIX)
# the fused batched LLM step (edge_build/export/llm_fused.py; models/batching/fused_step.py serves it)
FUSED_PREFIX = "llm_decode_fused_b"  # + batch size
FUSED_PREFILL_PREFIX = "llm_prefill_fused_t"  # + prompt positions: one row's prefill of a fixed length
KV_INSERT = "llm_fused_kv_insert"  # a prefill's cache into one slot row of the buffer


def _covers_prefix(profile: Mapping[str, Any]) -> bool:
    """A recorded TensorRT profile ({input: [min, opt, max]}) that takes T > 1 new positions
    over a past of at least one position."""
    try:
        return int(profile["inputs_embeds"][2][1]) > 1 and int(profile["past_kv"][2][4]) >= 1
    except (KeyError, IndexError, TypeError, ValueError):
        return False


@dataclass(frozen=True)
class SamplingConfig:
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LlmConfig:
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    speech_token_size: int
    sampling: SamplingConfig
    min_token_text_ratio: float
    max_token_text_ratio: float

    @property
    def eos_token(self) -> int:
        return self.speech_token_size


@dataclass(frozen=True)
class FlowConfig:
    pre_lookahead_len: int
    chunk_tokens: int
    n_timesteps: int
    inference_cfg_rate: float
    t_scheduler: str
    spk_embed_dim: int


@dataclass(frozen=True)
class HiftConfig:
    upsample_factor: int
    harmonics: int
    audio_limit: float


@dataclass(frozen=True)
class StreamingConfig:
    token_hop_len: int
    mel_cache_len: int
    source_cache_len: int


@dataclass(frozen=True)
class StageInfo:
    name: str
    path: Path
    precision: str
    sha256: str | None
    raw: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: dict[str, Any] = field(repr=False)
    family: str
    precision: str
    sample_rate: int
    token_mel_ratio: int
    mel_bins: int
    llm: LlmConfig
    flow: FlowConfig
    hift: HiftConfig
    streaming: StreamingConfig
    stages: dict[str, StageInfo]
    voices: dict[str, Path]
    default_voice: str | None
    backend: str = "ort"
    engines: dict[str, Any] | None = field(default=None, repr=False)  # the manifest's engines section, if trt

    def file(self, key: str) -> Path:
        """A file listed under `arrays` or the tokenizer."""
        if key == "tokenizer":
            entry = self.manifest["tokenizer"]
        else:
            entry = self.manifest.get("arrays", {}).get(key)
            if entry is None:
                raise BundleError(f"{self.root}: manifest lists no array {key!r}")
        return self.root / (entry["file"] if isinstance(entry, dict) else entry)

    def array(self, key: str, mmap: bool = True) -> np.ndarray:
        path = self.file(key)
        try:
            return np.load(path, mmap_mode="r" if mmap else None)
        except (OSError, ValueError) as exc:
            raise BundleError(f"{path}: cannot load array {key!r}: {exc}") from exc

    def carried(self, name: str) -> Path:
        """campplus / speech_tokenizer ONNX files carried as shipped."""
        entry = self.manifest.get("carried", {}).get(name) or CARRIED_FILES.get(name, f"{name}.onnx")
        path = self.root / (entry["file"] if isinstance(entry, dict) else entry)
        if not path.exists():
            raise BundleError(f"{self.root}: missing {path.name}; re-export the bundle")
        return path

    @property
    def llm_decode_positions(self) -> bool:
        """Whether `llm_decode` takes several new positions (inputs_embeds [B, T, D]
        with a symbolic T), so a prefill can start from a saved voice's cached
        prefix. Bundles exported before it declare 1: they run, without the LLM
        prefix cache. With TensorRT plans: whether the llm_decode engine has a profile for
        several new positions over a past (one LLM engine, edge_build/tensorrt/engines.py)."""
        if self.backend == "trt":
            record = (self.engines or {}).get("stages", {}).get("llm_decode", {})
            return any(_covers_prefix(p) for p in record.get("profiles", ()))
        inputs = self.stages["llm_decode"].raw.get("inputs")
        embeds = next((i for i in inputs or () if isinstance(i, dict) and i.get("name") == "inputs_embeds"), None)
        shape = embeds.get("shape") if embeds is not None else None
        return isinstance(shape, list) and len(shape) == 3 and isinstance(shape[1], str)

    def verify_hashes(self) -> list[str]:
        """Files whose sha256 differs from the manifest (empty when all match)."""
        bad = []
        for stage in self.stages.values():
            if stage.sha256 and sha256_file(stage.path) != stage.sha256:
                bad.append(stage.path.name)
        return bad


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _require(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise BundleError(f"manifest.json: missing {where}.{key}")
    return section[key]


def load_bundle(root: Path | str, precision: str | None = None, *, backend: str = "ort", device_id: int = 0,
                identity: EngineIdentity | None = None) -> Bundle:
    """Read and check `root/manifest.json`. `precision` picks a stage variant
    (`fp32`, `fp16`, `int8`) when the bundle lists several; by default the
    bundle's own precision.

    With `backend="trt"` the stages are the TensorRT plans of the manifest's
    `engines` section, checked against this device (`identity`, by default
    probed: GPU name, compute capability, TensorRT version); plans built for
    another GPU or TensorRT version are refused with a BundleError that says
    to rebuild them with `cosyedge build engines`."""
    root = Path(root)
    manifest_path = root / "manifest.json"
    if not root.is_dir():
        raise BundleError(f"{root}: not a directory; expected a bundle written by 'cosyedge build export'")
    if not manifest_path.exists():
        raise BundleError(f"{root}: no manifest.json; expected a bundle written by 'cosyedge build export'")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{manifest_path}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{manifest_path}: not a cosyedge bundle manifest (expected format {FORMAT!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{manifest_path}: bundle format version {version!r}, this cosyedge reads version {FORMAT_VERSION}; "
            "re-export the bundle with this version's 'cosyedge build export'"
        )
    family = _require(manifest, "family", "")
    if family not in FAMILIES:
        raise BundleError(f"{manifest_path}: model family {family!r} is not supported (supported: {FAMILIES})")

    llm = _require(manifest, "llm", "")
    samp = llm.get("sampling", {})
    flow = _require(manifest, "flow", "")
    hift = _require(manifest, "hift", "")
    streaming = _require(manifest, "streaming", "")
    chosen = precision or manifest.get("precision", "fp32")

    stages: dict[str, StageInfo] = {}
    for name in STAGES:
        entry = _require(manifest.get("stages", {}), name, "stages")
        variants = entry.get("variants", {})
        if chosen != entry.get("precision", "fp32") and chosen in variants:
            entry = {**entry, **variants[chosen]}
        elif chosen != entry.get("precision", "fp32") and precision is not None:
            raise BundleError(f"{root}: stage {name} has no {chosen} variant (have: {sorted(variants) or ['fp32']})")
        path = root / entry["file"]
        if backend != "trt" and not path.exists():
            raise BundleError(f"{root}: stage file {entry['file']} is missing")
        stages[name] = StageInfo(name, path, entry.get("precision", chosen), entry.get("sha256"), entry)

    fixed_shape = [n for n in manifest.get("stages", {}) if n.startswith((*FIXED_SHAPE_PREFIXES, *BATCHED_PREFIXES))]
    for name in (*OPTIONAL_STAGES, *fixed_shape) if backend != "trt" else ():
        entry = manifest.get("stages", {}).get(name)
        if isinstance(entry, dict) and chosen in entry.get("variants", {}):
            entry = {**entry, **entry["variants"][chosen]}
        if isinstance(entry, dict) and (root / entry["file"]).exists():
            stages[name] = StageInfo(name, root / entry["file"], entry.get("precision", "fp32"), entry.get("sha256"),
                                     entry)

    engines = None
    if backend == "trt":
        engines = _engine_stages(root, manifest, stages, precision, device_id, identity)
        chosen = str(engines.get("precision", chosen))

    voices = {name: root / rel for name, rel in manifest.get("voices", {}).items()}
    return Bundle(
        root=root,
        manifest=manifest,
        family=family,
        precision=chosen,
        sample_rate=int(_require(manifest, "sample_rate", "")),
        token_mel_ratio=int(_require(manifest, "token_mel_ratio", "")),
        mel_bins=int(_require(manifest, "mel_bins", "")),
        llm=LlmConfig(
            hidden_size=int(_require(llm, "hidden_size", "llm")),
            num_layers=int(_require(llm, "num_layers", "llm")),
            num_kv_heads=int(_require(llm, "num_kv_heads", "llm")),
            head_dim=int(_require(llm, "head_dim", "llm")),
            speech_token_size=int(_require(llm, "speech_token_size", "llm")),
            sampling=SamplingConfig(
                top_p=float(samp.get("top_p", 0.8)), top_k=int(samp.get("top_k", 25)),
                win_size=int(samp.get("win_size", 10)), tau_r=float(samp.get("tau_r", 0.1)),
            ),
            min_token_text_ratio=float(llm.get("min_token_text_ratio", 2.0)),
            max_token_text_ratio=float(llm.get("max_token_text_ratio", 20.0)),
        ),
        flow=FlowConfig(
            pre_lookahead_len=int(_require(flow, "pre_lookahead_len", "flow")),
            chunk_tokens=int(_require(flow, "chunk_tokens", "flow")),
            n_timesteps=int(flow.get("n_timesteps", 10)),
            inference_cfg_rate=float(flow.get("inference_cfg_rate", 0.7)),
            t_scheduler=str(flow.get("t_scheduler", "cosine")),
            spk_embed_dim=int(flow.get("spk_embed_dim", 192)),
        ),
        hift=HiftConfig(
            upsample_factor=int(_require(hift, "upsample_factor", "hift")),
            harmonics=int(_require(hift, "harmonics", "hift")),
            audio_limit=float(hift.get("audio_limit", 0.99)),
        ),
        streaming=StreamingConfig(
            token_hop_len=int(_require(streaming, "token_hop_len", "streaming")),
            mel_cache_len=int(_require(streaming, "mel_cache_len", "streaming")),
            source_cache_len=int(_require(streaming, "source_cache_len", "streaming")),
        ),
        stages=stages,
        voices=voices,
        default_voice=manifest.get("default_voice"),
        backend=backend,
        engines=engines,
    )


def _engine_stages(root: Path, manifest: dict[str, Any], stages: dict[str, StageInfo], precision: str | None,
                   device_id: int, identity: EngineIdentity | None) -> dict[str, Any]:
    """Replace `stages` with the TensorRT plans, after checking they fit this device."""
    if identity is None:
        from cosyedge_models.backends.gpu_probe import local_identity

        try:
            identity = local_identity(device_id)
        except CosyEdgeError as exc:
            raise BundleError(f"{root}: cannot use TensorRT engines here: {exc}") from exc
    engines = check_engines(manifest, root, identity, FIXED_SHAPE_PREFIXES)
    built = str(engines.get("precision", "?"))
    if precision is not None and precision != built:
        raise BundleError(f"{root}: the TensorRT engines were built from the {built} stages, not {precision}; "
                          f"rebuild them with: cosyedge build engines --bundle {root} --precision {precision}")
    for name in STAGES:
        entry = engines["stages"].get(name)
        if entry is None:
            raise BundleError(f"{root}: the TensorRT engines lack stage {name}; "
                              f"rebuild them with: cosyedge build engines --bundle {root}")
        # the stage's own metadata (cache dimensions, ...) with the engine's record over it
        stages[name] = StageInfo(name, root / entry["file"], str(entry.get("precision", built)),
                                 entry.get("sha256"), {**stages[name].raw, **entry})
    stages.update(fixed_shape_engines(root, manifest, engines))
    return engines


def fixed_shape_engines(root: Path, manifest: Mapping[str, Any], engines: Mapping[str, Any]) -> dict[str, StageInfo]:
    """The engines of the fixed-shape stages (optional): those whose plan exists and whose
    stage the bundle still lists; a bundle whose engines predate them simply has none."""
    found = {}
    listed = manifest.get("stages", {})
    for name, entry in engines.get("stages", {}).items():
        if not str(name).startswith(FIXED_SHAPE_PREFIXES) or name not in listed:
            continue
        path = root / str(entry.get("file", ""))
        if path.is_file():
            found[name] = StageInfo(name, path, str(entry.get("precision", engines.get("precision", "fp32"))),
                                    entry.get("sha256"), {**dict(listed[name]), **entry})
        else:
            log.warning("%s: engine %s of the fixed-shape stage %s is missing; running without it (rebuild with: "
                        "cosyedge build engines --bundle %s)", root, path.name, name, root)
    return found

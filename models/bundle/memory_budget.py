"""Jetson memory budget of a bundle: weights + activations + I/O and KV
buffers per stage at the optimization profiles' max shapes, against the
memory of each Orin module, whose DRAM the GPU shares with the CPU.

Pure arithmetic over the manifest and file sizes (no TensorRT, no GPU), so it
runs anywhere, before engines exist. Where `cosyedge build engines` has
recorded measured values (plan size, TensorRT's device_memory_size_v2), they
replace the estimates.

Assumptions (also printed with every report):
* Usable memory is what the kernel reports as MemTotal on each module
  (carve-outs for firmware and the display excluded).
* The OS takes 1.0 GiB (headless JetPack: no desktop; a desktop adds ~0.8 GiB).
* CUDA + TensorRT runtime (context, loaded kernels and libraries, lazy module
  loading on) take 0.6 GiB.
* The CPU side of cosyedge (Python, numpy, onnxruntime, the tokenizer, paho,
  audio) takes 0.4 GiB plus the arrays it loads (speech embedding, campplus
  with a 1.3x arena factor) and 64 MiB of the memory-mapped text embedding
  (only used rows are paged in); the speech tokenizer (loaded only for
  requests with prompt audio) is listed in the notes.
* One worker thread per stage group (LLM, flow, vocoder): one execution
  context each; the decode loop's contexts (prefill, steps and one per decode
  bucket, for CUDA graphs) share one activation buffer.
* Synthesizer weights: the plan size if built, else the ONNX file size (it stores
  int8 weights for Q/DQ graphs, fp16 for fp16 graphs). Precisions without
  files are derived from the fp32 files (fp16: x0.5, int8: x0.27: int8
  weights, fp16 for the layers kept in higher precision, scales).
* Activations: TensorRT's measured device memory if built; else per-stage
  estimates from the contract's shapes (LLM MLP width 5.5 x hidden as in
  Qwen2-0.5B; flow encoder and estimator: 8 attention heads over all frames,
  512 / 256 channels as upstream; HiFT decoder 48x its audio tensor), plus
  32 MiB of tactic scratch per execution context; fp32 4 bytes, fp16 2,
  int8 graphs 2.
* Fixed-shape engines (estimator and encoder windows, vocoder lengths; loaded on
  `trt` where built): each plan's size (its own copy of its stage's weights) and,
  per family, the largest one's device memory once (one shared activation buffer).
  Their request slots (K/V buffers) depend on `graph_flow_slots` and are listed in the
  notes; not built, the families' ONNX weights are listed in the notes only.
* 10% of usable memory is kept free (fragmentation, page cache, spikes).
* Streaming requests also hold the flow estimator's caches on the host (K/V
  of every transformer block per Euler step and CFG row, fp32: about 219 MiB
  per second of audio at full size, half in fp16 bundles); listed in the notes, not in the fit,
  since they grow with the utterance (`flow_stream_cache_bytes_per_second`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyedge_models.backends.fixed_shapes import (
    OVERFLOW_FLOW_SLOTS,
    BatchPlan,
    batch_lanes,
    flow_slot_bytes,
    lane_step_bytes,
    plan_batches,
)
from cosyedge_models.backends.profiles import all_input_ranges
from cosyedge_models.backends.shared_weights import find_index, graph_shared_bytes
from cosyedge_models.bundle.loader import (
    BATCH_FLOW_NAME,
    FIXED_SHAPE_PREFIXES,
    FUSED_PREFILL_PREFIX,
    FUSED_PREFIX,
    STATIC_FLOW_PREFIX,
)
from cosyedge_models.errors import BundleError
from cosyedge_models.synthesis.flow import CacheDims, cache_bytes_per_frame

GIB = 1 << 30
MIB = 1 << 20
STAGES = ("llm_prefill", "llm_decode", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder")
PRECISIONS = ("fp32", "fp16", "int8")  # what TensorRT engines are built from
# int8w (weight-only MatMulNBits, onnxruntime only) is budgeted as fp32 activations over its int8 weights.
DERIVED_WEIGHT_RATIO = {"fp32": 1.0, "fp16": 0.5, "int8": 0.27, "int8w": 0.29}
ACT_BYTES = {"fp32": 4, "fp16": 2, "int8": 2, "int8w": 4}
KV_BYTES = {"fp32": 4, "fp16": 2, "int8": 4, "int8w": 4}  # Q/DQ graphs keep fp32 I/O


@dataclass(frozen=True)
class Board:
    key: str
    label: str
    jetpack: str
    usable_bytes: int
    os_bytes: int = 1 * GIB
    runtime_bytes: int = int(0.6 * GIB)
    default_workspace_bytes: int = 1 * GIB


BOARDS: dict[str, Board] = {b.key: b for b in (
    Board("orin-nano-8gb", "Jetson Orin Nano 8 GB", "6.2 / 7.0", int(7.4 * GIB), default_workspace_bytes=512 * MIB),
    Board("orin-nx-16gb", "Jetson Orin NX 16 GB", "6.2 / 7.0", int(15.3 * GIB)),
    Board("agx-orin-32gb", "Jetson AGX Orin 32 GB", "6.2 / 7.0", int(30.0 * GIB), default_workspace_bytes=2 * GIB),
    Board("agx-orin-64gb", "Jetson AGX Orin 64 GB", "6.2 / 7.0", int(61.3 * GIB), default_workspace_bytes=4 * GIB),
)}
HEADROOM = 0.10
CPU_BASE_BYTES = int(0.4 * GIB)
TEXT_EMBEDDING_RESIDENT = 64 * MIB
SCRATCH_BYTES = 32 * MIB


@dataclass
class StageBudget:
    stage: str
    weights_bytes: int
    activation_bytes: int
    io_bytes: int  # device I/O buffers + their pinned host twins (+ the KV cache for llm_decode)
    contexts: int
    weights_source: str  # "plan", "plan of <stage>" (one engine for both), "onnx", "derived" or "missing"
    activation_source: str  # "measured" or "estimate"

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes * self.contexts + self.io_bytes


@dataclass
class BundleBudget:
    precision: str
    stages: list[StageBudget]
    cpu_side_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def engines_bytes(self) -> int:
        return sum(s.total_bytes for s in self.stages)

    def fit(self, board: Board) -> dict[str, Any]:
        need = self.engines_bytes + self.cpu_side_bytes + board.os_bytes + board.runtime_bytes
        limit = int(board.usable_bytes * (1 - HEADROOM))
        return {"board": board.key, "label": board.label, "usable_bytes": board.usable_bytes,
                "needed_bytes": need, "limit_bytes": limit, "fits": need <= limit, "spare_bytes": limit - need}

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "stages": {s.stage: {"weights_bytes": s.weights_bytes, "activation_bytes": s.activation_bytes,
                                 "contexts": s.contexts, "io_bytes": s.io_bytes, "total_bytes": s.total_bytes,
                                 "weights_source": s.weights_source, "activation_source": s.activation_source}
                       for s in self.stages},
            "engines_bytes": self.engines_bytes,
            "cpu_side_bytes": self.cpu_side_bytes,
            "boards": [self.fit(b) for b in BOARDS.values()],
            "notes": self.notes,
        }


def _file_bytes(root: Path, rel: str | None) -> int | None:
    if not rel:
        return None
    path = root / rel
    if not path.exists():
        return None
    size = path.stat().st_size
    data = path.with_name(path.name + ".data")
    return size + (data.stat().st_size if data.exists() else 0)


def _graph_bytes(root: Path, rel: str | None, uses: Mapping[str, int], counted: set[str]) -> int | None:
    """A graph's bytes with the shared LLM weights it uses, those counted for
    the first graph only (the sessions share one copy)."""
    own = _file_bytes(root, rel)
    if own is None or rel is None or rel not in uses:
        return own
    index = find_index(root / rel)
    key = index.name if index is not None else rel
    if key in counted:
        return own
    counted.add(key)
    return own + uses[rel]


def _stage_file(entry: Mapping[str, Any], precision: str) -> str | None:
    if entry.get("precision", "fp32") == precision:
        return entry.get("file")
    variant = entry.get("variants", {}).get(precision)
    return variant.get("file") if variant else None


def max_input_shapes(entry: Mapping[str, Any], stage: str) -> dict[str, tuple[int, ...]]:
    """Largest shape of every input over the stage's profiles."""
    out: dict[str, tuple[int, ...]] = {}
    for prof in all_input_ranges(entry, stage):
        for name, rng in prof.items():
            old = out.get(name)
            out[name] = rng.max if old is None else tuple(max(a, b) for a, b in zip(old, rng.max, strict=True))
    return out


def _vol(shape: tuple[int, ...] | list[int]) -> int:
    return int(math.prod(shape))


def stage_shapes(stage: str, manifest: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """(I/O elements at max shapes, estimated activation elements) from the contract."""
    llm, mel = manifest["llm"], int(manifest.get("mel_bins", 80))
    io = sum(_vol(s) for s in shapes.values())
    if stage in ("llm_prefill", "llm_decode"):
        d, layers = int(llm["hidden_size"]), int(llm["num_layers"])
        hkv, hd = int(llm["num_kv_heads"]), int(llm["head_dim"])
        v = int(llm["speech_token_size"]) + 3
        b, t = shapes["inputs_embeds"][0], shapes["inputs_embeds"][1]
        past = shapes["past_kv"][4] if stage == "llm_decode" else 0
        present = layers * 2 * b * hkv * (past + t) * hd
        io += b * v + present
        hq = max(d // hd, 1)
        act = b * t * (4 * d + int(5.5 * d)) + b * hq * t * (past + t) + b * t * v
        return io, act
    if stage == "flow_encoder":
        b, t = shapes["token"]
        io += b * mel * 2 * t + b * mel
        return io, b * 2 * t * 512 * 8 + b * 8 * (2 * t) ** 2
    if stage == "flow_estimator":
        # upstream CausalConditionalDecoder: 256 channels, 8 attention heads over all frames
        n, c, t = shapes["x"]
        io += n * c * t
        cached = 0
        if "att_cache" in shapes and "commit" in shapes:
            # streaming: attention also over the S cached frames; att_cache_new has R frames
            att = shapes["att_cache"]
            cached = att[0]
            io += shapes["commit"][0] * _vol(att[1:])
        return io, n * (8 * t * (t + cached) + 8 * 256 * t)
    if stage == "hift_source":
        b, samples, h = shapes["noise"]
        io += b * samples
        return io, 4 * b * samples * h
    if stage == "hift_decoder":
        b, _, samples = shapes["source"]
        io += b * samples
        return io, 48 * b * samples
    return io, 8 * io


def flow_stream_cache_bytes_per_second(manifest: Mapping[str, Any], itemsize: int = 4) -> int | None:
    """Host memory of one streaming request's flow caches (estimator, and the
    encoder's ~1.4 MiB/s at full size) per second of audio (the prompt's
    seconds count too), from the bundle's dimensions; None for a manifest
    without cache dimensions."""
    entry = (manifest.get("stages") or {}).get("flow_estimator") or {}
    try:
        dims = CacheDims.from_manifest(dict(entry))
    except BundleError:
        return None
    flow = manifest.get("flow") or {}
    tokens_per_second = int(manifest.get("token_rate_hz", 25))
    frames_per_second = tokens_per_second * int(manifest.get("token_mel_ratio", 2))
    total = frames_per_second * cache_bytes_per_frame(dims, int(flow.get("n_timesteps", 10)), itemsize)
    enc = ((manifest.get("stages") or {}).get("flow_encoder") or {}).get("cache")
    if isinstance(enc, Mapping) and {"layers", "up_layers", "heads", "head_dim"} <= set(enc):
        # the encoder's K/V (fp32: the encoder is never quantized): per token and per frame
        kv = 2 * int(enc["heads"]) * int(enc["head_dim"]) * 4
        total += tokens_per_second * int(enc["layers"]) * kv + frames_per_second * int(enc["up_layers"]) * kv
    return total


def bundle_budget(root: Path, manifest: Mapping[str, Any], precision: str) -> BundleBudget:
    """The budget of one precision of the bundle at `root`."""
    stages_meta = manifest.get("stages", {})
    engines = manifest.get("engines") or {}
    built = engines.get("stages", {}) if engines.get("precision") == precision else {}
    act_bytes, kv_bytes = ACT_BYTES[precision], KV_BYTES[precision]
    out, notes = [], []
    uses = graph_shared_bytes(root)  # graph -> shared LLM weights it uses (counted once: `counted`)
    counted: set[str] = set()
    for stage in STAGES:
        entry = stages_meta.get(stage)
        if entry is None:
            notes.append(f"{stage}: not in the manifest")
            continue
        shapes = max_input_shapes(entry, stage)
        # per profile (the estimator's offline and streaming profiles differ in
        # batch and cache length: their max shapes never occur together)
        per_profile = [stage_shapes(stage, manifest, {n: r.max for n, r in prof.items()})
                       for prof in all_input_ranges(entry, stage)]
        io_elems, act_elems = max(p[0] for p in per_profile), max(p[1] for p in per_profile)
        plan = built.get(stage, {})
        weights, source = plan.get("plan_bytes"), "plan"
        if plan.get("engine_of"):
            weights, source = 0, f"plan of {plan['engine_of']}"  # one engine: its weights counted there
        if weights is None:
            weights, source = _graph_bytes(root, _stage_file(entry, precision), uses, counted), "onnx"
        if weights is None:
            base = _graph_bytes(root, _stage_file(entry, "fp32"), uses, counted)
            weights = int(base * DERIVED_WEIGHT_RATIO[precision]) if base is not None else 0
            source = "derived" if base is not None else "missing"
        activation = plan.get("device_memory_bytes")
        act_source = "measured" if activation is not None else "estimate"
        if activation is None:
            activation = act_elems * act_bytes + SCRATCH_BYTES
        io = 2 * io_elems * act_bytes  # device buffer + pinned host twin
        contexts = 1
        if stage == "llm_decode":
            # The decode loop's own buffers: two max-length KV caches; its contexts
            # (one per decode bucket among them) share one activation buffer.
            past = shapes["past_kv"]
            io = 2 * _vol((*past[:4], past[4] + 1, past[5])) * kv_bytes + 2 * shapes["inputs_embeds"][2] * act_bytes
        out.append(StageBudget(stage, int(weights), int(activation), int(io), contexts, source, act_source))
    if {"llm_prefill", "llm_decode"} <= set(stages_meta):
        by_plan = {"llm_prefill", "llm_decode"} <= set(built)
        if by_plan and built["llm_prefill"].get("engine_of") == "llm_decode":
            notes.append("llm_prefill and llm_decode are one TensorRT engine (a prefill and a step optimization "
                         "profile): one copy of the LLM weights")
        elif counted and not by_plan:
            notes.append("llm_prefill and llm_decode share one copy of the LLM weights (counted with llm_prefill; "
                         "onnxruntime sessions map it once)")
        else:
            notes.append("llm_prefill and llm_decode each hold a copy of the LLM weights as separate engines")
    fixed, fixed_notes = fixed_shape_budget(root, stages_meta, built)
    out.extend(fixed)
    notes.extend(fixed_notes)
    plans = flow_slot_plans(stages_meta, int(manifest.get("flow", {}).get("n_timesteps", 10)))
    if plans:
        notes.append(f"fixed-shape flow slots (auto, of {FLOW_SLOTS_ASKED} asked; plan_batches): " + ", ".join(
            f"{key} {p.slots}" + (f" (batches {'/'.join(map(str, p.batch_sizes))})" if p.slots else " (off)")
            for key, p in plans.items()))
    lanes = flow_lane_plans(stages_meta, int(manifest.get("flow", {}).get("n_timesteps", 10)))
    if lanes:
        notes.append(f"batched flow lanes with graph_flow_batch (batch_lanes, beside {OVERFLOW_FLOW_SLOTS} "
                     "single-stream slots): " + ", ".join(f"{key} {n}" + (" (off)" if n < 2 else "")
                                                          for key, n in lanes.items()))
    cpu_bytes = cpu_side_bytes(root, manifest)  # the fused step's fit and the budget's (one pass over the files)
    fused = fused_step_bytes(root, stages_meta)
    if fused is not None:
        weights, per_row, rows, what = fused
        total = weights + per_row * rows
        spare = BundleBudget(precision, out, cpu_bytes).fit
        notes.append(f"fused batched LLM step (graph_batching, onnxruntime): {what}: weights {weights / MIB:.0f} MiB, "
                     f"K/V {per_row / MIB:.1f} MiB a row x {rows} rows, {total / MIB:.0f} MiB in all; fits beside "
                     "the engines on: " + (", ".join(b.key for b in BOARDS.values()
                                                     if spare(b)["spare_bytes"] >= total) or "none"))
    cache_bytes = 2 if precision == "fp16" else 4  # fp16 graphs take the K/V cache in fp16
    per_second = flow_stream_cache_bytes_per_second(manifest, cache_bytes)
    if per_second:
        notes.append(f"+{per_second / MIB:.1f} MiB of host memory per second of audio per streaming request "
                     f"(the flow estimator's caches, {'fp16' if cache_bytes == 2 else 'fp32'})")
    tok = (manifest.get("carried") or {}).get("speech_tokenizer")
    size = _file_bytes(root, tok.get("file") if isinstance(tok, Mapping) else tok) if tok else None
    if size:
        notes.append(f"+{size * 1.3 / MIB:.0f} MiB on the CPU side while the speech tokenizer is loaded "
                     "(requests with prompt audio)")
    return BundleBudget(precision, out, cpu_bytes, notes)


FLOW_SLOTS_ASKED = 8  # SynthesisSettings.graph_flow_slots' default
ITEMSIZE = {"float32": 4, "float16": 2}


def flow_slot_plans(stages_meta: Mapping[str, Any], n_timesteps: int,
                    requested: int = FLOW_SLOTS_ASKED) -> dict[str, BatchPlan]:
    """Per board, the fixed-shape estimator's request slots and batch sizes that the auto
    setting gives it on ort-cuda (`plan_batches` over the memory the board's GPU reports, each slot
    with its captured graphs and the windows' sessions: fixed_shapes.flow_slot_bytes); {} without
    fixed-shape estimator graphs."""
    windows = sorted(k for k in stages_meta if k.startswith(STATIC_FLOW_PREFIX))
    entry = stages_meta[windows[0]] if windows else None
    if not isinstance(entry, Mapping):
        return {}
    shapes = {i["name"]: i for i in entry.get("inputs", []) if isinstance(i, Mapping)}
    if "att_cache" not in shapes or "conv_cache" not in shapes:
        return {}
    per_slot, fixed = flow_slot_bytes(shapes["att_cache"]["shape"], shapes["conv_cache"]["shape"], n_timesteps,
                                      len(windows), ITEMSIZE.get(shapes["att_cache"].get("dtype", "float32"), 4))
    return {b.key: plan_batches(requested, per_slot, b.usable_bytes, fixed_bytes=fixed) for b in BOARDS.values()}


def flow_lane_plans(stages_meta: Mapping[str, Any], n_timesteps: int) -> dict[str, int]:
    """Per board, the batched estimator lanes (graph_flow_batch) that `batch_lanes` gives it with
    the GPU idle but for the single-stream slots beside them (OVERFLOW_FLOW_SLOTS, as many as fit
    the auto rule); {} without batched estimator graphs. A lane: one stream's K/V (in the graphs'
    precision) and conv history for every Euler step (fixed_shapes.lane_step_bytes per step)."""
    found, windows = {}, set()
    for name, entry in stages_meta.items():
        m = BATCH_FLOW_NAME.match(str(name))
        if m and isinstance(entry, Mapping):
            found[int(m.group(1))] = entry
            windows.add(int(m.group(2)))
    if not found:
        return {}
    specs = {i["name"]: i for i in found[min(found)].get("inputs", []) if isinstance(i, Mapping)}
    keys = [n for n in specs if n.startswith("key_cache_")]
    if not keys or "conv_cache" not in specs:
        return {}
    per_lane = n_timesteps * lane_step_bytes(len(keys), math.prod(specs[keys[0]]["shape"][1:]),
                                             math.prod(specs["conv_cache"]["shape"][1:]),
                                             ITEMSIZE.get(specs[keys[0]].get("dtype", "float32"), 4))
    static = flow_slot_plans(stages_meta, n_timesteps, OVERFLOW_FLOW_SLOTS)
    out = {}
    for b in BOARDS.values():
        taken = static[b.key].bytes if b.key in static else 0
        out[b.key] = batch_lanes(sorted(found), per_lane, b.usable_bytes, b.usable_bytes - taken,
                                 groups=n_timesteps, windows=len(windows))
    return out


def fixed_shape_budget(root: Path, stages_meta: Mapping[str, Any],
                       built: Mapping[str, Any]) -> tuple[list[StageBudget], list[str]]:
    """The fixed-shape engines that `build engines` recorded (the `trt` backend loads
    them): each plan's weights, and each family's largest device memory once (its runtime
    shares one activation buffer among the contexts); a note per family not built."""
    out: list[StageBudget] = []
    notes: list[str] = []
    for prefix in FIXED_SHAPE_PREFIXES:
        names = sorted(n for n in stages_meta if n.startswith(prefix))
        if not names:
            continue
        plans = [(n, built[n]) for n in names if isinstance(built.get(n), Mapping) and built[n].get("plan_bytes")]
        if plans:
            shared = max(int(p.get("device_memory_bytes") or 0) for _, p in plans)
            for i, (name, plan) in enumerate(plans):
                out.append(StageBudget(name, int(plan["plan_bytes"]), shared if i == 0 else 0, 0, 1, "plan",
                                       "measured"))
            notes.append(f"{prefix}*: {len(plans)} fixed-shape engines, each with its own copy of the weights; "
                         "their request slots (K/V buffers) come on top, per graph_flow_slots")
            continue
        onnx = sum(_file_bytes(root, stages_meta[n].get("file")) or 0 for n in names)
        notes.append(f"{prefix}*: {len(names)} fixed-shape graphs without engines ({onnx / MIB:.0f} MiB of ONNX; "
                     "as TensorRT engines each window holds its own copy of the weights)")
    return out, notes


def fused_step_bytes(root: Path, stages_meta: Mapping[str, Any]) -> tuple[int, int, int, str] | None:
    """(weights, K/V bytes a row, rows, what) of the fused batched LLM step in the precision
    onnxruntime's CUDA provider takes (fp16 graphs where the bundle has them; fused_step.py): its
    batch sizes' and prefill lengths' weights (once where they share a data file, as `build
    export` writes them; else a copy per graph) and its K/V buffer (the largest batch's rows,
    one more with the prefill graphs); None without fused step graphs."""
    graphs = {str(n): e for n, e in stages_meta.items() if isinstance(e, Mapping)
              and str(n).startswith((FUSED_PREFIX, FUSED_PREFILL_PREFIX))}
    if not any(n.startswith(FUSED_PREFIX) for n in graphs):
        return None
    dtypes = {str(e.get("kv_cache", {}).get("dtype", "float32")) for e in graphs.values()}
    dtype = "float16" if "float16" in dtypes else "float32"
    graphs = {n: e for n, e in graphs.items() if e.get("kv_cache", {}).get("dtype", "float32") == dtype}
    uses, counted = graph_shared_bytes(root), set[str]()
    weights = sum(_graph_bytes(root, str(e.get("file")), uses, counted) or 0 for e in graphs.values())
    steps = sorted(int(e["batch"]) for n, e in graphs.items() if n.startswith(FUSED_PREFIX))
    lengths = sorted(int(e["length"]) for n, e in graphs.items() if n.startswith(FUSED_PREFILL_PREFIX))
    first = graphs[f"{FUSED_PREFIX}{steps[0]}"]
    kv = [i for i in first.get("inputs", []) if isinstance(i, Mapping) and str(i.get("name", "")).startswith("past_")]
    per_row = sum(math.prod(i["shape"][1:]) * ITEMSIZE.get(str(i.get("dtype")), 4) for i in kv)
    shared = "one shared copy" if counted else f"a copy in each of {len(graphs)} graphs"
    what = (f"{'fp16' if dtype == 'float16' else 'fp32'}, batch sizes {'/'.join(map(str, steps))}"
            + (f", prefill lengths {'/'.join(map(str, lengths))}" if lengths else "") + f" ({shared})")
    return int(weights), int(per_row), steps[-1] + (1 if lengths else 0), what


def cpu_side_bytes(root: Path, manifest: Mapping[str, Any]) -> int:
    total = CPU_BASE_BYTES + TEXT_EMBEDDING_RESIDENT
    llm = manifest.get("llm", {})
    if "hidden_size" in llm and "speech_token_size" in llm:
        total += (int(llm["speech_token_size"]) + 3) * int(llm["hidden_size"]) * 4
    for name, entry in (manifest.get("carried") or {}).items():
        if "speech_tokenizer" in name:
            continue  # loaded only for requests with prompt audio (see the notes)
        rel = entry.get("file") if isinstance(entry, Mapping) else entry
        size = _file_bytes(root, rel)
        if size:
            total += int(size * 1.3)
    return total


def format_table(budgets: list[BundleBudget]) -> str:
    """A plain-text table (used by doctor and the README)."""
    lines = ["precision  engines(MiB)  cpu(MiB)  " + "  ".join(f"{b.key:>14}" for b in BOARDS.values())]
    for bud in budgets:
        cells = []
        for b in BOARDS.values():
            fit = bud.fit(b)
            cells.append(f"{'fits' if fit['fits'] else 'NO':>5} {fit['spare_bytes'] / MIB:>+8.0f}")
        lines.append(f"{bud.precision:<9}  {bud.engines_bytes / MIB:>12.0f}  {bud.cpu_side_bytes / MIB:>8.0f}  "
                     + "  ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)

"""`BatchedDecodeStep` (models/batching/batched_step.py) over the bundle's
onnxruntime-fused decode graphs (`llm_decode_fused_b<B>`, one per batch size,
edge_build/export/llm_fused.py).

One KV buffer `[L, 2, R, Hkv, C, hd]` on the device (R slot rows). A B-row
step binds each layer's `past_key_<i>` and `present_key_<i>` (and the values)
to the SAME view, `[i, 0|1, 0:B]`, so GroupQueryAttention writes the new K/V
in place; the bindings of every size are made once (fixed addresses, so
ort-cuda can capture each size once, `gpu_graph_id` = B). A step therefore
serves the rows 0..B-1: the idle ones among them get `seqlens_k` C - 1, the
scratch position no stream holds (a row serves C - 1 positions), so their
caches below it are untouched. The buffer's dtype is the step graphs'
declared cache type (float32, or float16 for the fp16 graphs that onnxruntime's
CUDA GroupQueryAttention needs; edge_build/export/llm_fused.py). When a
requested row is >= the scheduler's `batch_size`, the step runs the smallest
captured size that covers it (the scheduler should hand out the lowest free
rows). A prefill runs the plain dynamic graphs on the caller's thread and
`llm_fused_kv_insert` copies its float32 cache into the row's views (cast to
the buffer's dtype there). `prefill_rows` prefills several prompts in one run
(right-padded; the insert graph takes the prompt's index in the batch, in
bundles exported since the fifteenth H200 run: `batched_prefill`)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS
from cosyedge_models.backends.ort import OrtSession, bound_lm_run, shares_weights
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.backends.shared_weights import SharedWeightsRegistry
from cosyedge_models.batching.batched_step import check_batch_sizes, padded_size
from cosyedge_models.bundle.loader import FUSED_PREFILL_PREFIX, FUSED_PREFIX, KV_INSERT
from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)

INSERT_ROW = "batch_row"  # the insert graph's input: which prompt of a batched prefill (bundles since issue 23)
# onnxruntime's declared type of the cache I/O -> the buffer's numpy dtype
KV_TYPES: dict[str, type[np.floating]] = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class FusedDecodeStep:
    """The fused step graphs of several batch sizes over one in-place KV buffer.
    Call `warm_up()` on the graph thread before serving (captures each size on ort-cuda)."""

    def __init__(self, steps: Mapping[int, OrtSession], insert: OrtSession, prefill: OrtSession,
                 device: tuple[str, int], rows: int = 0, decode: OrtSession | None = None,
                 prefills: Mapping[int, OrtSession] | None = None) -> None:
        self._sizes = check_batch_sizes(sorted(steps))
        self._rows = rows or self._sizes[-1]
        if self._rows < self._sizes[-1]:
            raise ValueError(f"rows ({self._rows}) must be >= the largest batch size ({self._sizes[-1]})")
        self._steps = dict(steps)
        self._insert, self._prefill, self._decode = insert, prefill, decode
        self._device = device
        first = self._steps[self._sizes[0]]
        self._layers = sum(1 for n in first.input_names if n.startswith("past_key_"))
        self._dtype = kv_dtype(self._steps, insert)
        _, n_kv, cache_len, hd = (int(d) for d in first.input_shapes["past_key_0"])
        self._scratch = cache_len - 1  # idle rows write here: a row serves positions 0..C-2
        self._positions = cache_len - 1
        self._hidden = int(first.input_shapes["inputs_embeds"][2])
        self._vocab = int(first.output_shapes["logp"][1])
        self._row_shape = (n_kv, cache_len, hd)
        # the captured prefills (`llm_prefill_fused_t<T>`) write one more row, the scratch row, at a fixed
        # address; a prompt's row is then copied from it (prefill_rows)
        self._prefills = dict(prefills or {})
        self._lengths = tuple(sorted(self._prefills))
        if self._prefills and not self.batched_prefill:
            raise SynthesisError("fused decode: the prefill graphs need the insert graph that takes a batch's row; "
                                 "export the fused graphs again")
        self._scratch_row = self._rows
        self._buffer_rows = self._rows + (1 if self._prefills else 0)
        shape = (self._layers, 2, self._buffer_rows, *self._row_shape)
        kind, dev = device
        self._buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self._dtype), kind, dev)
        self._base = int(self._buffer.data_ptr())
        self._capture = {b: s.cuda_graph for b, s in self._steps.items()}
        self._io = {b: self._bind(b) for b in self._sizes}
        self._prefill_io = {t: self._bind_prefill(t) for t in self._lengths}
        self._copier = DeviceCopier(kind, dev) if self._prefills else None
        # the saved prefix the scratch row holds before its prompt's positions (_scratch_prefix_of); reuses
        # of it counted (stats, tests)
        self._scratch_holds: weakref.ref[np.ndarray] | None = None
        self.prefix_reuses = 0

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def positions(self) -> int:
        return self._positions

    @property
    def takes_past(self) -> bool:
        return self._decode is not None

    @property
    def batched_prefill(self) -> bool:
        """Whether `prefill_rows` can run (the bundle's insert graph takes a batch's row)."""
        return INSERT_ROW in self._insert.input_names

    @property
    def captured_prefill(self) -> bool:
        """Whether prompts are prefilled through the fixed-length prefill graphs (`prefill_rows`, on the
        graph thread that captured them)."""
        return bool(self._lengths)

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        return self._lengths

    @property
    def kv_dtype(self) -> np.dtype:
        """The KV buffer's element type (the step graphs' declared cache type)."""
        return np.dtype(self._dtype)

    def _ptr(self, layer: int, kind: int, row: int) -> int:
        row_items = int(np.prod(self._row_shape))
        return self._base + ((layer * 2 + kind) * self._buffer_rows + row) * row_items * np.dtype(self._dtype).itemsize

    def _row_bytes(self) -> int:
        return int(np.prod(self._row_shape)) * np.dtype(self._dtype).itemsize

    def _bind(self, b: int) -> tuple[ort.IOBinding, ort.RunOptions, dict[str, ort.OrtValue]]:
        kind, dev = self._device
        session = self._steps[b]
        values = {"inputs_embeds": np.zeros((b, 1, self._hidden), np.float32),
                  "seqlens_k": np.full(b, self._scratch, np.int32)}
        bound = {n: ort.OrtValue.ortvalue_from_numpy(a, kind, dev) for n, a in values.items()}
        bound["logp"] = ort.OrtValue.ortvalue_from_shape_and_type((b, self._vocab), np.float32, kind, dev)
        binding = session.io_binding()
        for name in values:
            binding.bind_ortvalue_input(name, bound[name])
        binding.bind_ortvalue_output("logp", bound["logp"])
        for i in range(self._layers):
            for k, name in enumerate(("key", "value")):
                ptr = self._ptr(i, k, 0)  # rows 0..b-1: contiguous
                binding.bind_input(f"past_{name}_{i}", kind, dev, self._dtype, [b, *self._row_shape], ptr)
                binding.bind_output(f"present_{name}_{i}", kind, dev, self._dtype, [b, *self._row_shape], ptr)
        options = ort.RunOptions()
        if self._capture[b]:
            options.add_run_config_entry("gpu_graph_id", str(b))
        return binding, options, bound

    def _bind_prefill(self, t: int) -> tuple[ort.IOBinding, ort.RunOptions, dict[str, ort.OrtValue]]:
        """A prefill graph's binding: its input, and the scratch row's views as its past and present."""
        kind, dev = self._device
        session = self._prefills[t]
        values = {"inputs_embeds": np.zeros((1, t, self._hidden), np.float32),
                  "seqlens_k": np.full(1, t - 1, np.int32)}
        bound = {n: ort.OrtValue.ortvalue_from_numpy(a, kind, dev) for n, a in values.items()}
        binding = session.io_binding()
        for name in values:
            binding.bind_ortvalue_input(name, bound[name])
        for i in range(self._layers):
            for k, name in enumerate(("key", "value")):
                ptr = self._ptr(i, k, self._scratch_row)
                binding.bind_input(f"past_{name}_{i}", kind, dev, self._dtype, [1, *self._row_shape], ptr)
                binding.bind_output(f"present_{name}_{i}", kind, dev, self._dtype, [1, *self._row_shape], ptr)
        options = ort.RunOptions()
        if session.cuda_graph:
            options.add_run_config_entry("gpu_graph_id", str(t))
        return binding, options, bound

    def warm_up(self) -> None:
        """Every size with every row idle (caches below the scratch position untouched), and every
        prefill length over the scratch row, CAPTURE_RUNS times where captured."""
        for b in self._sizes:
            binding, options, bound = self._io[b]
            bound["seqlens_k"].update_inplace(np.full(b, self._scratch, np.int32))
            for _ in range(CAPTURE_RUNS if self._capture[b] else 1):
                self._steps[b].run_bound(binding, options)
        self._scratch_holds = None  # the warm-up writes the scratch row from position 0
        for t in self._lengths:
            binding, options, bound = self._prefill_io[t]
            bound["seqlens_k"].update_inplace(np.full(1, t - 1, np.int32))
            try:
                for _ in range(CAPTURE_RUNS if self._prefills[t].cuda_graph else 1):
                    self._prefills[t].run_bound(binding, options)
            except Exception as exc:  # the step graphs are fine: only the prompts go back to the dynamic graph
                log.warning("LLM captured prefill: the %d-position graph failed its warm-up/capture (%s: %s); "
                            "prompts take the dynamic prefill graph", t, type(exc).__name__, exc)
                self._drop_prefills()
                return

    def _drop_prefills(self) -> None:
        self._prefill_io.clear()
        for session in self._prefills.values():
            session.close()
        self._prefills.clear()
        self._lengths = ()

    def prefill(self, row: int, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        if not 0 <= row < self._rows:
            raise ValueError(f"row {row} outside 0..{self._rows - 1}")
        p = 0 if past is None else int(past.shape[4])
        t = p + int(inputs_embeds.shape[1])
        if inputs_embeds.shape[0] != 1 or t >= self._positions:
            raise SynthesisError(f"fused decode: a prompt of {t} positions does not fit {self._positions}")
        logp, present = self._run_prefill(inputs_embeds, past, p, None)
        self._insert_row(present, 0, row)
        return logp

    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[np.ndarray],
                     pasts: Sequence[np.ndarray] | None = None) -> None:
        """Several prompts ([1, T_j, D] each, T_j >= 2) after one past length (`pasts`: each prompt's saved
        prefix [L, 2, 1, Hkv, P, hd], or None) in ONE run of the prefill graph, each
        prompt's cache but its last position into its row: right-padded, so a row's real positions never
        see the padding (causal attention), and no logp is returned: the last position is the row's next
        step's input (the request's `next_input`), whose logp is the one a whole prefill would give. The
        row's cache length is then P + T_j - 1. For `batched_prefill` bundles."""
        if not self.batched_prefill:
            raise SynthesisError("fused decode: this bundle's insert graph takes one prompt; re-export it "
                                 "for batched prefills")
        rows = list(rows)
        if not rows or len(set(rows)) != len(rows) or len(prompts) != len(rows):
            raise ValueError(f"prefill_rows: distinct rows with one prompt each, got rows {rows}, "
                             f"{len(prompts)} prompts")
        if min(rows) < 0 or max(rows) >= self._rows:
            raise ValueError(f"prefill_rows: rows {rows} outside 0..{self._rows - 1}")
        pasts = None if pasts is None else list(pasts)
        if pasts is not None and (len(pasts) != len(rows) or len({int(x.shape[4]) for x in pasts}) != 1
                                  or any(int(x.shape[2]) != 1 for x in pasts)):
            raise ValueError(f"prefill_rows: {len(rows)} prompts need one prefix each of one length, got "
                             f"{[tuple(x.shape) for x in pasts]}")
        p = 0 if pasts is None else int(pasts[0].shape[4])
        news = [int(x.shape[1]) - 1 for x in prompts]  # each prompt less its last position
        if min(news) < 1 or p + max(news) + 1 >= self._positions:
            raise SynthesisError(f"fused decode: prompts of {[n + 1 for n in news]} positions after {p} do not fit "
                                 f"a batched prefill of {self._positions}")
        if self._lengths:
            rest = self._captured_prefills(rows, prompts, news, pasts, p)
            if not rest:
                return
            rows, prompts, news = [rows[j] for j in rest], [prompts[j] for j in rest], [news[j] for j in rest]
            pasts = None if pasts is None else [pasts[j] for j in rest]
        past = None if pasts is None else np.concatenate(pasts, axis=2)
        width = max(news)
        embeds = np.zeros((len(rows), width, self._hidden), np.float32)
        mask = np.zeros((len(rows), p + width), np.int64)
        for j, (x, n) in enumerate(zip(prompts, news, strict=True)):
            embeds[j, :n] = x[0, :n]
            mask[j, : p + n] = 1
        _, present = self._run_prefill(embeds, past, p, mask)
        for j, row in enumerate(rows):
            self._insert_row(present, j, row)

    def _captured_prefills(self, rows: list[int], prompts: Sequence[np.ndarray], news: list[int],
                           pasts: Sequence[np.ndarray] | None, p: int) -> list[int]:
        """The prompts that a prefill length fits, each through the smallest such graph over the scratch row
        (its saved prefix inserted there first, unless the scratch row still holds that prefix: a prefill
        writes only the positions after it), then the scratch row copied into the prompt's row; returns
        the indices of the others (longer than the longest length)."""
        if self._copier is None:
            raise SynthesisError("fused decode: no prefill graphs")
        rest, nbytes = [], self._row_bytes()
        if pasts is None:
            self._scratch_holds = None  # the prompts' positions from 0: no prefix there after them
        for j, (row, x, n) in enumerate(zip(rows, prompts, news, strict=True)):
            t = next((t for t in self._lengths if t >= n and p + t <= self._positions + 1), None)
            if t is None:
                rest.append(j)
                continue
            if pasts is not None:
                self._scratch_prefix_of(pasts[j])
            binding, options, bound = self._prefill_io[t]
            embeds = np.zeros((1, t, self._hidden), np.float32)
            embeds[0, :n] = x[0, :n]
            bound["inputs_embeds"].update_inplace(embeds)
            bound["seqlens_k"].update_inplace(np.array([p + t - 1], np.int32))  # padding included: after the prompt
            self._prefills[t].run_bound(binding, options)
            self._copier.copy_many([(self._ptr(i, k, row), self._ptr(i, k, self._scratch_row), nbytes)
                                    for i in range(self._layers) for k in (0, 1)])
        return rest

    def _scratch_prefix_of(self, past: np.ndarray) -> None:
        """The scratch row's positions before the prompt: `past` [L, 2, 1, Hkv, P, hd], uploaded and inserted
        unless the row holds that very array's prefix from the prompt before (a voice's prefix, the same
        object for every request of the voice; a weak reference, so a freed array never matches)."""
        held = self._scratch_holds() if self._scratch_holds is not None else None
        if held is past and not past.flags.writeable:  # a read-only prefix (LlmPrefix's): not changed since
            self.prefix_reuses += 1
            return
        self._scratch_holds = None  # while it is overwritten (an insert that fails leaves no claim)
        present = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(past, np.float32), *self._device)
        self._insert_row(present, 0, self._scratch_row)
        self._scratch_holds = weakref.ref(past)

    def _run_prefill(self, embeds: np.ndarray, past: np.ndarray | None, p: int,
                     mask: np.ndarray | None) -> tuple[np.ndarray, ort.OrtValue]:
        if past is None:
            return bound_lm_run(self._prefill, embeds, None, 0, self._device, mask)
        if self._decode is None:
            raise SynthesisError("fused decode: no llm_decode session was given, so a prefill cannot start from a past")
        return bound_lm_run(self._decode, embeds, past, p, self._device, mask)

    def _insert_row(self, present: ort.OrtValue, index: int, row: int) -> None:
        """The prefill's `index`-th prompt's cache into `row`'s views (zero past its positions)."""
        kind, dev = self._device
        binding = self._insert.io_binding()
        binding.bind_ortvalue_input("present_kv", present)
        if self.batched_prefill:
            binding.bind_cpu_input(INSERT_ROW, np.array([index], np.int64))
        for i in range(self._layers):
            for k, name in enumerate(("key", "value")):
                binding.bind_output(f"row_{name}_{i}", kind, dev, self._dtype, [1, *self._row_shape],
                                    self._ptr(i, k, row))
        self._insert.run_bound(binding)

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, lengths: Sequence[int],
             batch_size: int) -> np.ndarray:
        rows = list(rows)
        if not rows or len(set(rows)) != len(rows) or len(lengths) != len(rows):
            raise ValueError(f"step: distinct rows with one length each, got rows {rows}, lengths {list(lengths)}")
        if min(rows) < 0 or max(rows) >= self._rows:
            raise ValueError(f"step: rows {rows} outside 0..{self._rows - 1}")
        if any(not 0 < n < self._positions for n in lengths):
            raise SynthesisError(f"fused decode: lengths {list(lengths)} outside 1..{self._positions - 1}")
        b = padded_size(max(batch_size, max(rows) + 1), self._sizes)
        embeds = np.zeros((b, 1, self._hidden), np.float32)
        seqlens = np.full(b, self._scratch, np.int32)
        x = np.asarray(inputs_embeds, np.float32).reshape(len(rows), self._hidden)
        for j, row in enumerate(rows):
            embeds[row, 0], seqlens[row] = x[j], lengths[j]
        binding, options, bound = self._io[b]
        bound["inputs_embeds"].update_inplace(embeds)
        bound["seqlens_k"].update_inplace(seqlens)
        self._steps[b].run_bound(binding, options)
        return np.asarray(bound["logp"].numpy())[rows]

    def row_cache(self, row: int, length: int) -> np.ndarray:
        """A copy of one row's cache [L, 2, Hkv, length, hd] on the host (tests, diagnostics)."""
        return np.array(self._buffer.numpy()[:, :, row, :, :length])

    def close(self) -> None:
        """Its bindings and the step and insert sessions it was given (the prefill and decode
        sessions are the engine's)."""
        self._io.clear()
        self._drop_prefills()
        for session in (*self._steps.values(), self._insert):
            session.close()
        self._steps.clear()


def kv_dtype(steps: Mapping[int, OrtSession], insert: OrtSession) -> type[np.floating]:
    """The KV buffer's dtype: the step graphs' declared `past_key_0` type, which
    every step graph and the insert graph's rows must share."""
    found = {f"llm_decode_fused_b{b}": s.input_types["past_key_0"] for b, s in steps.items()}
    found["llm_fused_kv_insert"] = insert.output_types["row_key_0"]
    kinds = set(found.values())
    if len(kinds) != 1 or (kind := kinds.pop()) not in KV_TYPES:
        raise SynthesisError(f"fused decode: the graphs' KV cache types differ or are not float32/float16: {found}; "
                             "export them together (build export --fused-decode-precision)")
    return KV_TYPES[kind]


def fused_kv_dtypes(cuda: bool) -> tuple[str, ...]:
    """The fused graphs' KV dtypes a provider runs, preferred first. ort-cuda: float16
    only (onnxruntime's CUDA GroupQueryAttention has float16/bfloat16 kernels only, so
    an fp32 graph's attention would run on the CPU provider and its capture be
    refused; docs/gpu.md). The CPU: float32, else float16 (it has both kernels)."""
    return ("float16",) if cuda else ("float32", "float16")


def fused_entries(manifest: Mapping[str, Any], dtype: str) -> dict[str, dict[str, Any]]:
    """The bundle's fused stages (`llm_decode_fused_b<B>`, `llm_prefill_fused_t<T>` and `llm_fused_kv_insert`) whose
    KV cache is `dtype` ("float32" / "float16", the entry's `kv_cache.dtype`): each stage's
    own entry or one of its variants (the variant's fields over the entry's, as the loader
    merges them). {} unless step graphs and the insert graph are all there in that dtype."""
    found: dict[str, dict[str, Any]] = {}
    for name, entry in manifest.get("stages", {}).items():
        if not (str(name).startswith((FUSED_PREFIX, FUSED_PREFILL_PREFIX)) or name == KV_INSERT) \
                or not isinstance(entry, dict):
            continue
        for candidate in (entry, *({**entry, **v} for v in entry.get("variants", {}).values())):
            if candidate.get("kv_cache", {}).get("dtype", "float32") == dtype:
                found[name] = candidate
                break
    has_steps = any(n.startswith(FUSED_PREFIX) for n in found)
    return found if has_steps and KV_INSERT in found else {}


def load_fused_step(root: Path, manifest: Mapping[str, Any], prefill: OrtSession, providers: Sequence[str],
                    device: tuple[str, int], threads: int | None = None, rows: int = 0,
                    decode: OrtSession | None = None, captured_prefill: bool = False) -> FusedDecodeStep | None:
    """The bundle's fused batched step for `providers` (fused_kv_dtypes: fp16 graphs on
    ort-cuda, each batch size captured; fp32 preferred on the CPU), or None when the
    bundle has none that the provider runs (the reason is logged). `prefill` (and
    `decode`, for a saved prefix) are the engine's plain LLM sessions. `captured_prefill`
    ([tts] llm_captured_prefill): the bundle's fixed-length prefill graphs serve the prompts
    they fit (captured on ort-cuda)."""
    cuda = bool(providers) and providers[0] == "CUDAExecutionProvider"
    wanted = fused_kv_dtypes(cuda)
    entries: dict[str, dict[str, Any]] = {}
    for dtype in wanted:
        entries = fused_entries(manifest, dtype)
        if entries:
            break
    if not entries:
        log.info("fused decode: the bundle has no fused step graphs in %s (build export --fused-decode-batches "
                 "with --fused-decode-precision %s)", " or ".join(wanted), "fp16" if cuda else "fp32")
        return None
    # the step and prefill graphs' one weight copy (a bundle exported since 2026-12-05 keeps it in one data
    # file, llm_weights.fused.bin): the same device buffers for every session on CUDA. Not on the CPU:
    # shared sessions run without prepacking, and there the fused step (fp32, opt-in) keeps its packed
    # weights (a batch size's rows then also round as that row alone does in the fp16 graphs)
    shared = SharedWeightsRegistry()
    share = cuda and shares_weights(providers)

    def open_graph(name: str, file: str) -> OrtSession:
        path = root / file
        return OrtSession(name, path, providers, device[1], threads, cuda_graph=cuda,
                          shared=shared.for_graph(path) if share else None, registry=shared)

    steps = {int(e["batch"]): open_graph(name, e["file"]) for name, e in entries.items()
             if name.startswith(FUSED_PREFIX)}
    insert = OrtSession(KV_INSERT, root / entries[KV_INSERT]["file"], providers, device[1], threads)
    step_positions = {int(e["positions"]) for n, e in entries.items() if n.startswith(FUSED_PREFIX)}
    prefills: dict[int, OrtSession] = {}
    for name, e in entries.items():
        if not captured_prefill or not name.startswith(FUSED_PREFILL_PREFIX):
            continue
        if {int(e["positions"])} != step_positions:  # its rows would not be the buffer's
            log.warning("LLM captured prefill: %s is for %s cache positions, the steps' %s: left out (export the "
                        "fused graphs together)", name, e["positions"], sorted(step_positions))
            continue
        prefills[int(e["length"])] = open_graph(name, e["file"])
    if captured_prefill and not prefills:
        log.warning("LLM captured prefill: the bundle has no fixed-length prefill graphs (build export "
                    "--fused-prefill-lengths); the prompts are prefilled on the dynamic graphs")
    return FusedDecodeStep(steps, insert, prefill, device, rows, decode, prefills)

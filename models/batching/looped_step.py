"""`BatchedDecodeStep` over today's per-stream fixed-size step
(models/backends/ort_graph_decode.py): each row is one of the GraphDecoder's
slots, and a step replays each row's own captured graph in turn (n replays,
nothing run for the padding). It serves the iteration-level scheduler
(models/batching/graph_batcher.py) until the batched step graph exists, and
is what the scheduler's tests run on the CPU with the tiny bundle."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cosyedge_models.backends.ort_graph_decode import GraphDecodeLoop, GraphDecoder
from cosyedge_models.batching.batched_step import check_batch_sizes
from cosyedge_models.errors import SynthesisError


class LoopedGraphStep:
    """Borrows `rows` slots of a warmed-up `decoder` until close()."""

    def __init__(self, decoder: GraphDecoder, rows: int, batch_sizes: Sequence[int] | None = None) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1 stream, got {rows}")
        sizes = batch_sizes if batch_sizes is not None else [2 ** i for i in range(rows.bit_length()) if 2 ** i <= rows]
        self._batch_sizes = check_batch_sizes(sizes if sizes[-1] >= rows else [*sizes, rows])
        self._decoder = decoder
        self._loops: list[GraphDecodeLoop] = []
        for _ in range(rows):
            loop = decoder.loop(decoder.positions)
            if loop is None:
                self.close()
                raise SynthesisError(f"the fixed-size decode has fewer than {rows} free slots "
                                     f"(graph_decode_slots) or was disabled at load: {decoder.disabled}")
            self._loops.append(loop)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self._batch_sizes

    @property
    def rows(self) -> int:
        return len(self._loops)

    @property
    def positions(self) -> int:
        return self._decoder.positions

    @property
    def takes_past(self) -> bool:
        return self._decoder.decode_session is not None

    def prefill(self, row: int, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        return self._loops[row].prefill(inputs_embeds, past)

    @property
    def batched_prefill(self) -> bool:
        return False  # each row is its own fixed-size loop, with its own prefill

    @property
    def captured_prefill(self) -> bool:
        return False

    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[np.ndarray],
                     pasts: Sequence[np.ndarray] | None = None) -> None:
        raise SynthesisError("the fixed-size decode slots prefill one prompt at a time (batched_prefill is off)")

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, lengths: Sequence[int],
             batch_size: int) -> np.ndarray:
        if not self._decoder.thread.on_thread():
            raise RuntimeError("BatchedDecodeStep.step runs on the GPU graph thread")
        if batch_size not in self._batch_sizes or len(rows) > batch_size:
            raise ValueError(f"{len(rows)} rows as batch size {batch_size}: not one of {list(self._batch_sizes)}")
        out = []
        for i, row in enumerate(rows):
            loop = self._loops[row]
            if loop.cache_len != lengths[i]:
                raise SynthesisError(f"row {row}: its cache holds {loop.cache_len} positions, "
                                     f"the step says {lengths[i]}")
            out.append(loop.step(inputs_embeds[i][None, None])[0])  # on the graph thread: replays inline
        return np.stack(out)

    def close(self) -> None:
        for loop in self._loops:
            loop.close()
        self._loops.clear()

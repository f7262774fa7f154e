"""How a batched LLM's tokens reach the streams, timed with no model compute: the graph
batcher (models/batching/graph_batcher.py) over a step that stands for the GPU (it sleeps
`--step-ms` on the graph thread as a thread waiting for the device does, the GIL let go) and
returns one fixed log-probability row, and streams that take their tokens either from the
request's mailbox, woken a chunk at a time (`mailbox`, models/batching/mailbox.py), or as before,
through an LLM producer thread a token at a time (`producer`: the batcher's tokens iterated by
a `ProducedTokens` job of a `ProducerPool`). At each chunk a stream waits `--chunk-ms` (its flow
and vocoder on the GPU) before it asks for the next:

    python -m cosyedge_models.tools.handover_bench --bundle B --json F.json [--streams 8,16]
        [--step-ms 1.6] [--chunk-ms 12] [--runs 3]

Both ways sample the same tokens (the same seeds and rows); what differs is the time between two
steps beyond `--step-ms` (the batcher's host work and its waits for the GIL: `step_gap_ms`),
the wall time and when each stream held its first chunk's tokens, and the gap's parts the batcher
times (its host work, and its call on the graph thread beyond the sleep). Prints and writes the runs."""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.batching.graph_batcher import GraphBatcher
from cosyedge_models.batching.iteration import IterationSettings
from cosyedge_models.batching.llm_batcher import TokenStream
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.llm import LlmInput, SpeechTokenLM
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.streaming import ChunkSchedule
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from cosyedge_models.synthesis.token_stream import ProducedTokens, ProducerPool, TokenSource
from cosyedge_models.tools.host import machine

MODES = ("producer", "mailbox")
HOP, LOOKAHEAD = 25, 3  # CosyVoice 2's token hop and the flow's look-ahead (full size)
POOL = 61  # log-probability rows the steps cycle through
TEXT = "The quick brown fox jumps over the lazy dog while the robot reads the news aloud."


class SleepStep:
    """A `BatchedDecodeStep` whose steps take `step_ms` of a graph thread's time and give every row the
    next of `POOL` fixed rows of log-probabilities (EOS held back: each stream runs to its maximum
    length). Rows that change from step to step keep the repetition-aware redraws from the full
    distribution about as rare as in speech; one row for all steps made them a third of the draws."""

    def __init__(self, vocab: int, eos: int, rows: int, step_ms: float, prefill_ms: float, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        logits = rng.standard_normal((POOL, vocab)).astype(np.float32) * 3.0
        logits[:, eos:] = -1e4  # neither EOS nor fill tokens
        top = logits.max(axis=1, keepdims=True)
        self._pool = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        self.batch_sizes = tuple(b for b in (1, 2, 4, 8, 16) if b < rows) + (rows,)
        self.rows, self.positions = rows, 1 << 20
        self.takes_past = self.batched_prefill = self.captured_prefill = False
        self._step_s, self._prefill_s = step_ms / 1e3, prefill_ms / 1e3
        self.starts: list[float] = []  # perf_counter at each step's start

    def prefill(self, row: int, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        time.sleep(self._prefill_s)
        return self._pool[row % POOL][None]

    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[np.ndarray],
                     pasts: Sequence[np.ndarray] | None = None) -> None:
        raise NotImplementedError("batched_prefill is False")

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, lengths: Sequence[int],
             batch_size: int) -> np.ndarray:
        self.starts.append(time.perf_counter())
        time.sleep(self._step_s)
        return self._pool[(len(self.starts) + np.asarray(rows)) % POOL]


def _consume(source: TokenSource, chunk_s: float, submitted: float, out: dict[str, float]) -> None:
    schedule = ChunkSchedule(HOP, LOOKAHEAD)
    n = 0
    with source:
        source.want(schedule.next_chunk_tokens())
        for _ in source:
            n += 1
            while schedule.next_chunk(n) is not None:
                out.setdefault("first_chunk_ms", (time.perf_counter() - submitted) * 1e3)
                time.sleep(chunk_s)  # the chunk's flow and vocoder, waited for on the GPU
                source.want(schedule.next_chunk_tokens())
    out["tokens"] = n


def run(lm: SpeechTokenLM, text: list[int], mode: str, streams: int, step_ms: float, chunk_ms: float,
        prefill_ms: float) -> dict[str, Any]:
    step = SleepStep(lm.config.speech_token_size + 3, lm.config.eos_token, streams, step_ms, prefill_ms)
    settings = IterationSettings(BatchSettings(max_batch_size=streams), step.batch_sizes, streams, streams)
    pool = ProducerPool(streams).start() if mode == "producer" else None
    results: list[dict[str, float]] = [{} for _ in range(streams)]
    with GraphThread("handover-bench").start() as thread, GraphBatcher(lm, step, thread, settings) as batcher:
        def stream(i: int) -> None:
            sampler = TokenSampler.seeded(lm.config.sampling, lm.config.eos_token, 100 + i)
            submitted = time.perf_counter()
            tokens = batcher.open(LlmInput(text=text), sampler)
            if not isinstance(tokens, TokenStream):
                raise RuntimeError("the graph batcher ran a request on its ordinary loop")
            source: TokenSource = tokens.timed()
            if pool is not None:  # as before the mailbox: a producer thread pulls the tokens one at a time
                source = pool.submit(ProducedTokens(iter(tokens), lambda: False, 128))
            _consume(source, chunk_ms / 1e3, submitted, results[i])

        t0 = time.perf_counter()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stats = batcher.stats
    if pool is not None:
        pool.stop()
    gaps = [(b - a) * 1e3 - step_ms for a, b in zip(step.starts, step.starts[1:], strict=False)]
    firsts = [r["first_chunk_ms"] for r in results]
    return {"mode": mode, "wall_s": round(wall, 3), "steps": stats.steps, "tokens": sum(r["tokens"] for r in results),
            "handovers": stats.handovers,
            # per step: the batcher's own host work (inputs, sampling, the hand-over) and its call's time on
            # the graph thread beyond the sleep (the queue, the turn, the hops there and back)
            "step_host_ms": round(stats.step_host_s / stats.steps * 1e3, 3),
            "step_call_over_ms": round(stats.step_call_s / stats.steps * 1e3 - step_ms, 3),
            "step_gap_ms_mean": round(statistics.fmean(gaps), 3),
            "step_gap_ms_p50": round(float(np.percentile(gaps, 50)), 3),
            "step_gap_ms_p95": round(float(np.percentile(gaps, 95)), 3),
            "first_chunk_ms_p50": round(float(np.percentile(firsts, 50)), 1),
            "first_chunk_ms_max": round(max(firsts), 1)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True, help="a bundle (its LLM's vocabulary, text and sampler)")
    p.add_argument("--json", type=Path)
    p.add_argument("--streams", type=lambda v: [int(x) for x in v.split(",")], default=[8, 16],
                   help="comma-separated stream counts")
    p.add_argument("--step-ms", type=float, default=1.6, help="a step's GPU time (eight rows, H100: ~1.6 ms)")
    p.add_argument("--chunk-ms", type=float, default=12.0, help="a chunk's flow and vocoder GPU time")
    p.add_argument("--prefill-ms", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    engine = load_synthesizer(args.bundle, settings=SynthesisSettings(threads=1))
    try:
        text = engine.tokenizer.encode(TEXT)
        runs = [{"streams": n, **run(engine.lm, text, mode, n, args.step_ms, args.chunk_ms, args.prefill_ms)}
                for n in args.streams for _ in range(args.runs) for mode in MODES]
    finally:
        engine.close()
    out = {"what": __doc__.split("\n\n")[0], "machine": machine(), "step_ms": args.step_ms,
           "chunk_ms": args.chunk_ms, "prefill_ms": args.prefill_ms, "hop": HOP, "lookahead": LOOKAHEAD,
           "text": TEXT, "runs": runs}
    for r in runs:
        print(json.dumps(r))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

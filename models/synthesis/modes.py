"""The synthesis modes, defined once. Apart from the synthesizer interface
(api.py, which needs numpy) so that the command line's parser and the wire
schema can name them without loading the runtime."""

from __future__ import annotations

from typing import Literal

Mode = Literal["sft", "zero_shot", "cross_lingual", "instruct"]
MODES: tuple[Mode, ...] = ("sft", "zero_shot", "cross_lingual", "instruct")
PROMPT_MODES: tuple[Mode, ...] = ("zero_shot", "cross_lingual")  # modes that clone the voice of a prompt
# How the captured GPU stages share graph threads (SynthesisSettings.graph_threads), here for the parser too
GRAPH_THREAD_MODES = ("one", "per-stage")
# The graph-thread class of a batched LLM step that samples a stream's first-chunk tokens
# (SynthesisSettings.llm_first_chunk_priority), here for the parser and the settings schema too
LLM_FIRST_CHUNK_PRIORITIES = ("normal", "first_audio")
# the most threads a round's LLM prefills may use at once (SynthesisSettings.llm_parallel_prefills)
MAX_PARALLEL_PREFILLS = 16

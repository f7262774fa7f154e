"""Triton's dynamic batching of the cosyvoice2 model as settings: the served
copy of config.pbtxt with its max_batch_size, max_queue_delay_microseconds,
the preferred batch sizes that still fit, the engine's LLM batch (one row per
request of a Triton batch) and the instance kind (KIND_GPU on a GPU server)
rewritten. Pure text in, text out."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cosyedge_models.errors import CosyEdgeError


class BatchingConfigError(CosyEdgeError):
    """A dynamic-batching setting out of range, or a config without the line it sets."""


MAX_BATCH = 256

MAX_DELAY_US = 10_000_000


@dataclass(frozen=True)
class DynamicBatching:
    max_batch_size: int | None = None  # requests per execute (and LLM batch rows); None: the config's
    max_queue_delay_us: int | None = None  # how long Triton waits to fill a batch; None: the config's
    instance_kind: str | None = None  # "KIND_GPU" / "KIND_CPU"; None: the config's

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and not 1 <= self.max_batch_size <= MAX_BATCH:
            raise BatchingConfigError(f"max_batch_size must be 1-{MAX_BATCH} requests, got {self.max_batch_size}")
        if self.max_queue_delay_us is not None and not 0 <= self.max_queue_delay_us <= MAX_DELAY_US:
            raise BatchingConfigError(f"max_queue_delay_us must be 0-{MAX_DELAY_US} µs, got {self.max_queue_delay_us}")
        if self.instance_kind not in (None, "KIND_GPU", "KIND_CPU"):
            raise BatchingConfigError(f"instance_kind must be KIND_GPU or KIND_CPU, got {self.instance_kind!r}")


def _sub_once(pattern: str, repl: str, text: str, what: str) -> str:
    new, n = re.subn(pattern, repl, text, count=1, flags=re.M)
    if n != 1:
        raise BatchingConfigError(f"config.pbtxt has no {what} to set")
    return new


def apply_batching(config: str, batching: DynamicBatching) -> str:
    if batching.max_batch_size is not None:
        size = batching.max_batch_size
        config = _sub_once(r"^max_batch_size:\s*\d+", f"max_batch_size: {size}", config, "max_batch_size")
        m = re.search(r"preferred_batch_size:\s*\[([^\]]*)\]", config)
        if m:
            fit = [s for s in (int(x) for x in m.group(1).replace(",", " ").split()) if s <= size]
            repl = f"preferred_batch_size: [ {', '.join(map(str, fit))} ]" if fit else ""
            config = config[:m.start()] + repl + config[m.end():]
        config = _sub_once(r'^(parameters: \{ key: "LLM_MAX_BATCH_SIZE" value: \{ string_value: )"\d+"',
                           rf'\g<1>"{size}"', config, "LLM_MAX_BATCH_SIZE parameter")
    if batching.max_queue_delay_us is not None:
        config = _sub_once(r"max_queue_delay_microseconds:\s*\d+",
                           f"max_queue_delay_microseconds: {batching.max_queue_delay_us}", config,
                           "max_queue_delay_microseconds")
    if batching.instance_kind is not None:
        config = _sub_once(r"(instance_group \[ \{ kind: )KIND_\w+", rf"\g<1>{batching.instance_kind}", config,
                           "instance_group kind")
    return config

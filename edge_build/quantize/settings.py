"""Typed settings of `cosyedge build quantize`."""

from __future__ import annotations

from dataclasses import dataclass, field

# int8: Q/DQ (TensorRT explicit quantization); int8w: weight-only MatMulNBits (onnxruntime);
# fp16: float16 graphs.
PRECISIONS = ("int8", "int8w", "fp16")


@dataclass(frozen=True)
class AccuracyBudget:
    """What a low-precision bundle must keep of the fp32 one, on held-out texts.

    `e2e_match_min`: mean fraction of speech tokens, under the same seeded
    sampling, generated before the first token that differs from fp32. Top-p /
    top-k sampling turns any logit change near a sampling boundary into a
    different token and from there the sequences are unrelated (still valid
    speech), so demanding 100 % would demand bit-exactness; 50 % says the
    quantized LLM follows fp32 for the first half of an utterance on average.
    """

    llm_cosine_min: float = 0.99
    llm_top1_min: float = 0.90
    mel_snr_min_db: float = 15.0
    wav_snr_min_db: float = 10.0
    e2e_match_min: float = 0.5

    def __post_init__(self) -> None:
        for name in ("llm_cosine_min", "llm_top1_min", "e2e_match_min"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")


@dataclass(frozen=True)
class QuantizeSettings:
    precision: str = "int8"
    calibration_size: int = 8
    held_out_size: int = 3
    feeds_per_stage: int = 32  # cap on recorded inputs per stage graph
    calibration_method: str = "minmax"
    seed: int = 0
    force: bool = False
    budget: AccuracyBudget = field(default_factory=AccuracyBudget)
    max_memory_gb: float | None = None  # refuse to start above this estimated peak (besides free memory)

    @property
    def max_memory_bytes(self) -> int | None:
        return None if self.max_memory_gb is None else int(self.max_memory_gb * (1 << 30))

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.calibration_method not in ("minmax", "percentile"):
            raise ValueError(f"calibration_method must be minmax or percentile, got {self.calibration_method!r}")
        if self.max_memory_gb is not None and not self.max_memory_gb > 0:
            raise ValueError(f"max_memory_gb must be > 0, got {self.max_memory_gb}")
        for name in ("calibration_size", "held_out_size", "feeds_per_stage"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

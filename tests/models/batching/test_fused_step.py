"""FusedDecodeStep (the BatchedDecodeStep over the fused graphs) on the CPU:
each row's log-probabilities equal the plain BoundDecodeLoop's for that stream
alone, with rows of different lengths, a stream joining, one leaving, a
prefill from a saved prefix, and a row above the scheduler's batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.ort import BoundDecodeLoop, OrtSession
from cosyedge_models.batching.batched_step import BatchedDecodeStep
from cosyedge_models.batching.fused_step import FusedDecodeStep
from cosyedge_models.errors import SynthesisError

POSITIONS = 40
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def fused_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cosyedge_build.export.llm_fused import export_fused_decode
    from cosyedge_build.reference.modules import load_reference

    out = tmp_path_factory.mktemp("fused")
    export_fused_decode(load_reference(tiny_model_dir).llm, out, [1, 2, 4], POSITIONS)
    return out


def _session(name: str, path: Path, device: str = "cpu", capture: bool = False) -> OrtSession:
    providers = ["CPUExecutionProvider"] if device == "cpu" else ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return OrtSession(name, path, providers, 0, 1, cuda_graph=capture)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_rows_equal_the_plain_loop_alone(fused_dir: Path, tiny_bundle: Path) -> None:
    _compare(fused_dir, tiny_bundle, "cpu", TOLERANCE)


@pytest.mark.gpu
def test_captured_rows_equal_the_plain_loop_alone_on_cuda(fused_dir: Path, tiny_bundle: Path) -> None:
    """ort-cuda: every batch size captured once (gpu_graph_id), the steps replayed."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider here")
    _compare(fused_dir, tiny_bundle, "cuda", 1e-3)


def _compare(fused_dir: Path, tiny_bundle: Path, device: str, tolerance: float) -> None:
    prefill = _session("llm_prefill", tiny_bundle / "llm_prefill.onnx", device)
    decode = _session("llm_decode", tiny_bundle / "llm_decode.onnx", device)
    steps = {b: _session(f"fused{b}", fused_dir / f"llm_decode_fused_b{b}.onnx", device, capture=device == "cuda")
             for b in (1, 2, 4)}
    fused = FusedDecodeStep(steps, _session("insert", fused_dir / "llm_fused_kv_insert.onnx", device), prefill,
                            (device, 0), rows=4, decode=decode)
    protocol: BatchedDecodeStep = fused  # the scheduler's interface (mypy checks the match)
    assert protocol.batch_sizes == (1, 2, 4) and protocol.rows == 4 and protocol.positions == POSITIONS
    fused.warm_up()
    d = int(decode.input_shapes["inputs_embeds"][2])
    rng = np.random.default_rng(5)
    speech = np.load(tiny_bundle / "llm_speech_embedding.npy")
    alone: dict[int, BoundDecodeLoop] = {}
    lengths: dict[int, int] = {}  # row -> cache length

    def join(row: int, t: int, prefix: int = 0) -> None:
        x = (rng.standard_normal((1, t, d)) * 0.05).astype(np.float32)
        loop = BoundDecodeLoop(prefill, decode, device)
        if prefix:  # a saved prefix cache, then the prompt's rest (the voice prompt cache)
            head = BoundDecodeLoop(prefill, decode, device)
            head.prefill(x[:, :prefix])
            past = np.asarray(head._kv.numpy())  # noqa: SLF001 - the prefix cache as a host array
            ref = loop.prefill(x[:, prefix:], past)
            got = fused.prefill(row, x[:, prefix:], past)
        else:
            ref, got = loop.prefill(x), fused.prefill(row, x)
        assert _rel(got, ref) < tolerance
        alone[row], lengths[row] = loop, t

    def step(rows: list[int], batch_size: int) -> None:
        tokens = rng.integers(0, speech.shape[0] - 3, len(rows))
        x = speech[tokens]
        logp = fused.step(rows, x, [lengths[r] for r in rows], batch_size)
        assert logp.shape == (len(rows), speech.shape[0])
        for j, row in enumerate(rows):
            ref = alone[row].step(x[j].reshape(1, 1, d))
            assert _rel(logp[j], ref[0]) < tolerance
            lengths[row] += 1
            plain = np.asarray(alone[row]._kv.numpy())[:, :, 0]  # noqa: SLF001
            assert _rel(fused.row_cache(row, lengths[row]), plain) < tolerance

    join(0, 7)
    step([0], 1)
    join(1, 12, prefix=5)  # joins with a different length, from a saved prefix
    step([0, 1], 2)
    step([1, 0], 2)  # any order of rows
    join(2, 3)
    step([0, 1, 2], 4)
    step([1, 2], 2)  # row 0 leaves; row 2 is above batch size 2: the step runs the 4-row graph
    step([2], 1)
    with pytest.raises(SynthesisError):
        fused.prefill(3, np.zeros((1, POSITIONS, d), np.float32))
    with pytest.raises(ValueError):
        fused.step([0, 0], speech[:2], [8, 8], 2)

"""edge_build/tools/capture_memory.py (docs/gpu.md, the nineteenth run): its synthetic graphs compute what
they claim on the CPU provider, and without a GPU it stops with a message instead of measuring nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from cosyedge_build.tools.capture_memory import _chain_model, main


@pytest.mark.parametrize(("nodes", "conv"), [(1, False), (7, False), (4, True)])
def test_the_chain_adds_one_a_node_and_keeps_its_shape(tmp_path: Path, nodes: int, conv: bool) -> None:
    path = tmp_path / "chain.onnx"
    _chain_model(path, nodes, 16 * 16, conv=conv)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.zeros(256, np.float32)
    (y,) = sess.run(None, {"x": x})
    assert y.shape == (256,)
    # the Conv (a 3x3 of ones) and the identity MatMul map zeros to zeros: each Add then adds one
    np.testing.assert_array_equal(y, np.full(256, nodes, np.float32))


def test_without_a_gpu_it_stops_with_a_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cosyedge_models.backends import gpu_probe

    monkeypatch.setattr(gpu_probe, "device_memory_used", lambda device_id=0: None)  # what it answers without one
    out = tmp_path / "m.json"
    with pytest.raises(SystemExit, match="no GPU"):
        main(["--out", str(out)])
    assert not out.exists()

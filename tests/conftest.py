"""Shared fixtures: the tiny checkpoint and bundle (built once per run and
cached under .cache/ keyed by the build code), and a real Mosquitto broker."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support import hypothesis_seed
from tests.support.broker import Broker, mosquitto_binary, running_broker
from tests.support.components import missing, not_here
from tests.support.module_tmp import ModuleTmp

if TYPE_CHECKING:
    from tests.support.trt_emulator import Emulation

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("COSYEDGE_TEST_CACHE", ROOT / ".cache" / "tests"))


def pytest_configure(config: pytest.Config) -> None:
    hypothesis_seed.configure(config)


def pytest_report_header(config: pytest.Config) -> str:
    return hypothesis_seed.header()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    hypothesis_seed.add_seed_to_failure(item, outcome.get_result())


def _code_hash(*packages: str) -> str:
    h = hashlib.sha256()
    for pkg in packages:
        assert (ROOT / pkg).is_dir(), f"no folder {pkg}: the cache key would not follow the code"
        for path in sorted((ROOT / pkg).rglob("*.py")):
            h.update(path.relative_to(ROOT).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleTmp]:
    """Folders for the module's shared fixtures, removed when its tests end (tests/support/module_tmp.py)."""
    tmp = ModuleTmp(tmp_path_factory)
    yield tmp
    tmp.remove()


def _cached_dir(name: str, key: str, build) -> Path:  # type: ignore[no-untyped-def]
    """Build into CACHE/name-key once; a finished build is marked by .done."""
    out = CACHE / f"{name}-{key}"
    if (out / ".done").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    build(out)
    (out / ".done").write_text("ok")
    return out


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from cosyedge_build.checkpoint.tiny import build_tiny_checkpoint

    key = _code_hash("edge_build")
    return _cached_dir("tiny-ckpt", key, lambda out: build_tiny_checkpoint(out, seed=0, size="tiny"))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_model_dir: Path) -> Path:
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-bundle", key, lambda out: export_bundle(tiny_model_dir, out))


STATIC_DECODE_LEN = 256  # positions of the tiny bundle's fixed-size decode step


@pytest.fixture(scope="session")
def tiny_static_bundle(tiny_model_dir: Path) -> Path:
    """The tiny bundle with the optional fixed-size decode step (build export --static-decode-len)."""
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-static-bundle", key,
                       lambda out: export_bundle(tiny_model_dir, out, static_decode_len=STATIC_DECODE_LEN))


FUSED_DECODE_BATCHES = (1, 2)  # the fused batched LLM step's batch sizes in fused_bundle


@pytest.fixture(scope="session")
def fused_bundle(tiny_model_dir: Path) -> Path:
    """The tiny bundle with the fused batched LLM step (build export --fused-decode-batches), fp32."""
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-fused-bundle", key,
                       lambda out: export_bundle(tiny_model_dir, out, fused_decode_batches=FUSED_DECODE_BATCHES,
                                                 fused_decode_len=STATIC_DECODE_LEN))


STATIC_FLOW_WINDOWS = (64, 160)  # the tiny bundle's fixed-shape flow estimator windows
STATIC_FLOW_CACHE = 320  # and their cache frames
BATCH_FLOW_SIZES = (1, 2)  # and the batch sizes of their batched graphs (flow_batch.py)


@pytest.fixture(scope="session")
def static_flow_bundle(tiny_model_dir: Path) -> Path:
    """The tiny bundle with the fixed-shape flow estimator graphs (build export --static-flow-windows),
    single-stream and batched (--batch-flow-sizes)."""
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-static-flow-bundle", key,
                       lambda out: export_bundle(tiny_model_dir, out, static_flow_windows=STATIC_FLOW_WINDOWS,
                                                 static_flow_cache=STATIC_FLOW_CACHE,
                                                 batch_flow_sizes=BATCH_FLOW_SIZES))


@pytest.fixture(scope="session")
def every_graph_bundle(tiny_model_dir: Path) -> Path:
    """The tiny bundle with every graph the GPU serves a batch with, as the H200 plan exports it at full
    size: the fused batched LLM step with its fixed-length prefill graphs, the fixed-shape flow graphs
    single-stream and batched (1, 2, 4 streams), the fixed-length vocoder graphs."""
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-every-graph-bundle", key,
                       lambda out: export_bundle(tiny_model_dir, out, fused_decode_batches=(1, 2, 4),
                                                 fused_decode_len=STATIC_DECODE_LEN,
                                                 static_flow_windows=STATIC_FLOW_WINDOWS,
                                                 static_flow_cache=STATIC_FLOW_CACHE, batch_flow_sizes=(1, 2, 4),
                                                 static_vocoder=True, fused_prefill_lengths=(16, 64)))


@pytest.fixture(scope="session")
def static_flow_fp16_bundle(tiny_model_dir: Path) -> Path:
    """static_flow_bundle with its batched graphs in fp16 (build export --batch-flow-precision fp16:
    the fp16 K/V lanes)."""
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-static-flow-fp16-bundle", key,
                       lambda out: export_bundle(tiny_model_dir, out, static_flow_windows=STATIC_FLOW_WINDOWS,
                                                 static_flow_cache=STATIC_FLOW_CACHE,
                                                 batch_flow_sizes=BATCH_FLOW_SIZES, batch_flow_precision="fp16"))


@pytest.fixture(scope="session")
def static_flow_fused_fp16_bundle(tiny_model_dir: Path) -> Path:
    """static_flow_fp16_bundle with onnxruntime's MultiHeadAttention in the batched graphs
    (build export --batch-flow-attention fused): what the GPU serves its lanes with."""
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-static-flow-fused-fp16-bundle", key,
                       lambda out: export_bundle(tiny_model_dir, out, static_flow_windows=STATIC_FLOW_WINDOWS,
                                                 static_flow_cache=STATIC_FLOW_CACHE,
                                                 batch_flow_sizes=BATCH_FLOW_SIZES, batch_flow_precision="fp16",
                                                 batch_flow_attention="fused"))


STATIC_VOCODER_FIRST_HOP = 15  # graph_bundle's fixed-length vocoder graphs also hold this first hop's first chunk
STATIC_VOCODER_LATER_HOP = 50  # ... and the steady chunk of this later hop (a growing hop capped there)


@pytest.fixture(scope="session")
def graph_bundle(tiny_model_dir: Path) -> Path:
    """The tiny bundle with every CUDA-graph stage: the fixed-size decode step, the fixed-shape flow
    graphs and the fixed-length vocoder graphs (the default chunks, a first hop of
    STATIC_VOCODER_FIRST_HOP tokens and a later hop of STATIC_VOCODER_LATER_HOP)."""
    from cosyedge_build.export import export_bundle

    key = _code_hash("edge_build", "models")
    return _cached_dir("tiny-graph-bundle", key,
                       lambda out: export_bundle(tiny_model_dir, out, static_decode_len=STATIC_DECODE_LEN,
                                                 static_flow_windows=STATIC_FLOW_WINDOWS,
                                                 static_flow_cache=STATIC_FLOW_CACHE, static_vocoder=True,
                                                 static_vocoder_first_hops=(STATIC_VOCODER_FIRST_HOP,),
                                                 static_vocoder_hops=(STATIC_VOCODER_LATER_HOP,)))


@pytest.fixture()
def broker() -> Iterator[Broker]:
    if mosquitto_binary() is None:
        missing("mosquitto is not installed (apt-get install mosquitto); .ci/setup installs it")
    with running_broker() as b:
        yield b


@pytest.fixture()
def emulated_tensorrt(request: pytest.FixtureRequest) -> Iterator[Emulation]:
    """TensorRT + pycuda + libcuda emulated (tests/support/trt_emulator) for the test; TensorRT 10.13
    unless parametrized indirectly with a version ("10.3", "10.13", "11"). Skips where a real
    TensorRT is importable: the emulator never replaces it."""
    from tests.support.trt_emulator import emulated_tensorrt as emulate
    from tests.support.trt_emulator import real_tensorrt_present

    if real_tensorrt_present():
        not_here("a real TensorRT is importable here; the emulator never replaces it")
    version = getattr(request, "param", "10.13")
    with emulate(version) as emu:
        yield emu
        # what would have crashed or faulted a real GPU process fails the test, even if it caught the error
        assert not emu.faults(), emu.faults()

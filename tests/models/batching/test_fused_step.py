"""FusedDecodeStep (the BatchedDecodeStep over the fused graphs) on the CPU:
each row's log-probabilities equal the plain BoundDecodeLoop's for that stream
alone, with rows of different lengths, a stream joining, one leaving, a
prefill from a saved prefix, and a row above the scheduler's batch size. The
fp16 graphs (what ort-cuda runs: its GroupQueryAttention is fp16-only) over an
fp16 buffer: each row's greedy tokens and log-probabilities follow the fp32
plain loop's alone within fp16's error. With `-m gpu`: the fp16 graphs captured
on ort-cuda (the fp32 ones are not run there: onnxruntime's CUDA provider has no
fp32 GroupQueryAttention, so their attention would fall to the CPU provider and
the capture be refused; docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cosyedge_models.backends.ort import BoundDecodeLoop, OrtSession
from cosyedge_models.backends.shared_weights import SharedWeightsRegistry
from cosyedge_models.batching.batched_step import BatchedDecodeStep
from cosyedge_models.batching.fused_step import FusedDecodeStep, fused_entries, fused_kv_dtypes, load_fused_step
from cosyedge_models.errors import SynthesisError

from tests.support.components import require_cuda_provider
from tests.support.module_tmp import ModuleTmp

POSITIONS = 40
PREFILL_LENGTHS = (4, 8)  # the fixed-length prefill graphs exported beside the steps
TOLERANCE = 1e-4
# fp16 graphs against the fp32 plain step: the logits are |z| < 32 here, where fp16's
# spacing is 2^-6 (0.016); two such steps bound the rounding of the last layers and
# the head (measured on the CPU: at most 0.0062 over 20 steps of two rows)
FP16_LOGP_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def fused_dir(tiny_model_dir: Path, module_tmp: ModuleTmp) -> Path:
    """The fused graphs as `build export` writes them: fp32 here, fp16 under fp16/, each set's step and
    prefill graphs with their weights in one shared data file (on CUDA served through REGISTRY, as
    load_fused_step does; on the CPU each session reads it)."""
    from cosyedge_build.export.llm_fused import export_fused_decode, has_layer_weights
    from cosyedge_build.export.shared_weights import SHARED_FUSED_FILE, share_stages
    from cosyedge_build.reference.modules import load_reference

    llm = load_reference(tiny_model_dir).llm
    out = module_tmp.mktemp("fused")
    (out / "fp16").mkdir()
    for root, precision in ((out, "fp32"), (out / "fp16", "fp16")):
        stages = export_fused_decode(llm, root, [1, 2, 4], POSITIONS, precision, prefill_lengths=PREFILL_LENGTHS)
        assert share_stages(root, [s for s in stages if has_layer_weights(s.name)], SHARED_FUSED_FILE)
    return out


REGISTRY = SharedWeightsRegistry()  # the shared weights of the graphs open at a time (one mapping each)


def _session(name: str, path: Path, device: str = "cpu", capture: bool = False) -> OrtSession:
    providers = ["CPUExecutionProvider"] if device == "cpu" else ["CUDAExecutionProvider", "CPUExecutionProvider"]
    shared = REGISTRY.for_graph(path) if device == "cuda" else None  # as load_fused_step: on CUDA only
    return OrtSession(name, path, providers, 0, 1, cuda_graph=capture, shared=shared, registry=REGISTRY)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_rows_equal_the_plain_loop_alone(fused_dir: Path, tiny_bundle: Path) -> None:
    _compare(fused_dir, tiny_bundle, "cpu", TOLERANCE)


def _fused_with_decode(fused_dir: Path, tiny_bundle: Path, device: str, prefill_lengths: tuple[int, ...] = ()
                       ) -> tuple[FusedDecodeStep, OrtSession, OrtSession]:
    """The fused step of batch sizes 1, 2, 4 over 4 rows (captured on CUDA), with the plain prefill and
    decode sessions (a prefill from a saved prefix runs on the latter), and the fixed-length prefill
    graphs of `prefill_lengths`."""
    prefill = _session("llm_prefill", tiny_bundle / "llm_prefill.onnx", device)
    decode = _session("llm_decode", tiny_bundle / "llm_decode.onnx", device)
    steps = {b: _session(f"fused{b}", fused_dir / f"llm_decode_fused_b{b}.onnx", device, capture=device == "cuda")
             for b in (1, 2, 4)}
    prefills = {t: _session(f"prefill{t}", fused_dir / f"llm_prefill_fused_t{t}.onnx", device,
                            capture=device == "cuda") for t in prefill_lengths}
    fused = FusedDecodeStep(steps, _session("insert", fused_dir / "llm_fused_kv_insert.onnx", device), prefill,
                            (device, 0), rows=4, decode=decode, prefills=prefills)
    return fused, prefill, decode


def _compare(fused_dir: Path, tiny_bundle: Path, device: str, tolerance: float) -> None:
    fused, prefill, decode = _fused_with_decode(fused_dir, tiny_bundle, device)
    protocol: BatchedDecodeStep = fused  # the scheduler's interface (mypy checks the match)
    # the last position is the idle rows' scratch
    assert protocol.batch_sizes == (1, 2, 4) and protocol.rows == 4 and protocol.positions == POSITIONS - 1
    assert fused.kv_dtype == np.float32
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


def _fused(fused_dir: Path, tiny_bundle: Path, device: str) -> FusedDecodeStep:
    prefill = _session("llm_prefill", tiny_bundle / "llm_prefill.onnx", device)
    steps = {b: _session(f"fused{b}", fused_dir / f"llm_decode_fused_b{b}.onnx", device, capture=device == "cuda")
             for b in (1, 2, 4)}
    return FusedDecodeStep(steps, _session("insert", fused_dir / "llm_fused_kv_insert.onnx", device), prefill,
                           (device, 0), rows=4)


def test_fp16_rows_follow_the_fp32_plain_loop_alone(fused_dir: Path, tiny_bundle: Path) -> None:
    _compare_fp16(fused_dir, tiny_bundle, "cpu", FP16_LOGP_TOLERANCE, FP16_LOGP_TOLERANCE / 10)


@pytest.mark.gpu
def test_captured_fp16_rows_follow_the_fp32_plain_loop_alone_on_cuda(fused_dir: Path, tiny_bundle: Path) -> None:
    """ort-cuda with the fp16 graphs: GroupQueryAttention on the CUDA provider (no node
    left on the CPU), every batch size captured, each row within fp16's error of the
    fp32 plain step alone and equal to the same fp16 graphs run alone."""
    require_cuda_provider()
    # the fp32 side may use TF32 there; and the kernels cuBLAS picks per batch size may sum in
    # another order, so a row alone and batched may differ by two fp16 steps of the logits
    _compare_fp16(fused_dir, tiny_bundle, "cuda", 2 * FP16_LOGP_TOLERANCE, FP16_LOGP_TOLERANCE)


def test_kv_dtypes_must_agree(fused_dir: Path, tiny_bundle: Path) -> None:
    steps = {1: _session("fused1", fused_dir / "fp16" / "llm_decode_fused_b1.onnx")}
    with pytest.raises(SynthesisError, match="KV cache types differ"):
        FusedDecodeStep(steps, _session("insert", fused_dir / "llm_fused_kv_insert.onnx"),
                        _session("llm_prefill", tiny_bundle / "llm_prefill.onnx"), ("cpu", 0))


def _compare_fp16(fused_dir: Path, tiny_bundle: Path, device: str, tolerance: float, alone_tolerance: float) -> None:
    """Three streams (two from the start, one joining into batch size 4) step through
    the fp16 fused graphs, each fed the fp32 plain loop's greedy token (so that one
    near-tie cannot send the two sides down different paths): the fused argmax equals
    the plain one wherever the plain top-two gap exceeds twice the tolerance, and logp
    is within the tolerance. Then each stream alone through the same fp16 graphs
    (row 0, batch size 1) gives its batched rows' logp: a row does not depend on its
    neighbours."""
    batched = _fused(fused_dir / "fp16", tiny_bundle, device)
    assert batched.kv_dtype == np.float16
    batched.warm_up()
    if device == "cuda":
        for b, session in batched._steps.items():  # noqa: SLF001 - the sessions' providers
            assert session.providers[0] == "CUDAExecutionProvider" and session.cuda_graph, b
    prefill = _session("llm_prefill", tiny_bundle / "llm_prefill.onnx", device)
    decode = _session("llm_decode", tiny_bundle / "llm_decode.onnx", device)
    speech = np.load(tiny_bundle / "llm_speech_embedding.npy")
    d = speech.shape[1]
    rng = np.random.default_rng(7)
    prompts = {row: (rng.standard_normal((1, t, d)) * 0.05).astype(np.float32) for row, t in ((0, 7), (1, 12), (2, 4))}
    plain: dict[int, BoundDecodeLoop] = {}
    fed: dict[int, list[int]] = {}  # row -> the tokens it was fed
    got: dict[int, list[np.ndarray]] = {}  # row -> its batched logp per step
    length: dict[int, int] = {}
    compared = 0

    def join(row: int) -> None:
        plain[row] = BoundDecodeLoop(prefill, decode, device)
        ref = plain[row].prefill(prompts[row])
        assert float(np.abs(batched.prefill(row, prompts[row]) - ref).max()) < 1e-4  # the plain fp32 prefill
        fed[row], got[row], length[row] = [int(ref[0].argmax())], [], prompts[row].shape[1]

    def step(rows: list[int], batch_size: int) -> None:
        nonlocal compared
        x = speech[[fed[r][-1] for r in rows]]
        logp = batched.step(rows, x, [length[r] for r in rows], batch_size)
        for j, row in enumerate(rows):
            ref = plain[row].step(x[j].reshape(1, 1, d))[0]
            assert float(np.abs(logp[j] - ref).max()) < tolerance, (row, length[row])
            top = np.sort(ref)[::-1]
            if top[0] - top[1] > 2 * tolerance:
                assert int(logp[j].argmax()) == int(ref.argmax()), (row, length[row])
                compared += 1
            got[row].append(logp[j])
            fed[row].append(int(ref.argmax()))
            length[row] += 1

    join(0)
    join(1)
    for _ in range(6):
        step([0, 1], 2)
    join(2)
    for _ in range(6):
        step([0, 1, 2], 4)
    assert compared >= 20  # most of the 30 steps are not near-ties (23 of 30 on the H200, run 7)

    alone = _fused(fused_dir / "fp16", tiny_bundle, device)
    alone.warm_up()
    for row in (0, 2):
        alone.prefill(0, prompts[row])
        n = prompts[row].shape[1]
        for k, batched_logp in enumerate(got[row]):
            logp = alone.step([0], speech[[fed[row][k]]], [n + k], 1)[0]
            assert float(np.abs(logp - batched_logp).max()) < alone_tolerance, (row, k)


def _manifest(fp32: bool, fp16: bool) -> dict[str, Any]:
    """Fused stage entries over fused_dir's files: fp32 as the stage, fp16 as its variant
    (or the stage, when there is no fp32), the fields the export writes."""
    stages: dict[str, Any] = {}
    graphs: list[tuple[str, dict[str, Any]]] = [
        *((f"llm_decode_fused_b{b}", {"batch": b, "positions": POSITIONS}) for b in (1, 2, 4)),
        *((f"llm_prefill_fused_t{t}", {"length": t, "positions": POSITIONS}) for t in PREFILL_LENGTHS),
        ("llm_fused_kv_insert", {})]
    for name, extra in graphs:
        f32 = {"file": f"{name}.onnx", "precision": "fp32", "kv_cache": {"dtype": "float32"}, **extra}
        f16 = {"file": f"fp16/{name}.onnx", "precision": "fp16", "kv_cache": {"dtype": "float16"}, **extra}
        if fp32:
            stages[name] = {**f32, "variants": {"fp16": f16}} if fp16 else f32
        elif fp16:
            stages[name] = f16
    return {"stages": {"llm_decode": {"file": "llm_decode.onnx"}, **stages}}


def test_fused_entries_follow_the_provider() -> None:
    both = _manifest(fp32=True, fp16=True)
    assert fused_kv_dtypes(cuda=True) == ("float16",)
    assert {n: e["file"] for n, e in fused_entries(both, "float16").items()} == {
        **{f"llm_decode_fused_b{b}": f"fp16/llm_decode_fused_b{b}.onnx" for b in (1, 2, 4)},
        **{f"llm_prefill_fused_t{t}": f"fp16/llm_prefill_fused_t{t}.onnx" for t in PREFILL_LENGTHS},
        "llm_fused_kv_insert": "fp16/llm_fused_kv_insert.onnx"}
    assert fused_entries(both, "float32")["llm_decode_fused_b2"]["file"] == "llm_decode_fused_b2.onnx"
    assert fused_entries(_manifest(fp32=True, fp16=False), "float16") == {}
    no_insert = _manifest(fp32=False, fp16=True)
    del no_insert["stages"]["llm_fused_kv_insert"]
    assert fused_entries(no_insert, "float16") == {}


def test_load_fused_step_picks_the_graphs_the_provider_runs(fused_dir: Path, tiny_bundle: Path) -> None:
    prefill = _session("llm_prefill", tiny_bundle / "llm_prefill.onnx")
    cpu = ["CPUExecutionProvider"]
    step = load_fused_step(fused_dir, _manifest(fp32=True, fp16=True), prefill, cpu, ("cpu", 0))
    assert step is not None and step.kv_dtype == np.float32 and step.batch_sizes == (1, 2, 4)
    step = load_fused_step(fused_dir, _manifest(fp32=False, fp16=True), prefill, cpu, ("cpu", 0))
    assert step is not None and step.kv_dtype == np.float16
    # ort-cuda with fp32 fused graphs only: none (no session is made, so this runs without a GPU)
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert load_fused_step(fused_dir, _manifest(fp32=True, fp16=False), prefill, cuda, ("cuda", 0)) is None


def test_load_fused_step_takes_the_prefill_graphs_when_asked(fused_dir: Path, tiny_bundle: Path) -> None:
    """llm_captured_prefill: the prefill graphs of the steps' cache length; one exported for another
    cache length is left out (its rows would not be the buffer's)."""
    prefill = _session("llm_prefill", tiny_bundle / "llm_prefill.onnx")
    cpu = ["CPUExecutionProvider"]
    manifest = _manifest(fp32=True, fp16=False)
    off = load_fused_step(fused_dir, manifest, prefill, cpu, ("cpu", 0))
    assert off is not None and not off.captured_prefill and off.prefill_lengths == ()
    on = load_fused_step(fused_dir, manifest, prefill, cpu, ("cpu", 0), captured_prefill=True)
    assert on is not None and on.captured_prefill and on.prefill_lengths == PREFILL_LENGTHS
    manifest["stages"]["llm_prefill_fused_t8"]["positions"] = POSITIONS * 2
    other = load_fused_step(fused_dir, manifest, prefill, cpu, ("cpu", 0), captured_prefill=True)
    assert other is not None and other.prefill_lengths == (4,)


def test_a_prefill_graph_that_fails_its_warm_up_leaves_the_steps_serving(
        fused_dir: Path, tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused capture of a prefill graph (a GPU failure, made here by its run raising) turns the
    captured prefill off, not the fused step: prompts then take the one-run dynamic path."""
    fused, prefill, decode = _fused_with_decode(fused_dir, tiny_bundle, "cpu", PREFILL_LENGTHS)

    def refused(*_: Any) -> None:
        raise RuntimeError("CUDA graph capture refused")

    monkeypatch.setattr(fused._prefills[8], "run_bound", refused)  # noqa: SLF001 - the session's own run fails
    fused.warm_up()
    assert not fused.captured_prefill and fused.batched_prefill
    d = int(decode.input_shapes["inputs_embeds"][2])
    x = (np.random.default_rng(3).standard_normal((1, 6, d)) * 0.05).astype(np.float32)
    loop = BoundDecodeLoop(prefill, decode, "cpu")
    first = loop.prefill(x)
    fused.prefill_rows([1], [x])
    assert _rel(fused.step([1], x[0, -1:], [5], 2)[0], first[0]) < TOLERANCE


@pytest.mark.parametrize("prefix", [0, 4])
def test_a_batched_prefill_gives_each_row_its_prompt_alone(fused_dir: Path, tiny_bundle: Path, prefix: int) -> None:
    """Three prompts of different lengths (after a saved prefix or none) in one prefill run into rows
    0, 2 and 3 (not adjacent): each row's first step, fed its prompt's last position, gives the logp
    of that prompt's whole prefill alone, and its next step the plain loop's next step; a row's cache
    equals the plain loop's (the padding never reaches a real position)."""
    _batched_prefill(fused_dir, tiny_bundle, prefix, "cpu", TOLERANCE)


@pytest.mark.gpu
def test_a_batched_prefill_on_cuda_follows_the_plain_loop(fused_dir: Path, tiny_bundle: Path) -> None:
    """The same on ort-cuda with the fp16 fused graphs (captured steps, the fp16 insert), within fp16's error."""
    require_cuda_provider()
    _batched_prefill(fused_dir / "fp16", tiny_bundle, 4, "cuda", 2 * FP16_LOGP_TOLERANCE)


@pytest.mark.parametrize(("prefix", "lengths"), [(0, (4, 8)), (4, (4, 8)), (4, (4,))])
def test_a_captured_prefill_gives_each_row_its_prompt_alone(fused_dir: Path, tiny_bundle: Path, prefix: int,
                                                            lengths: tuple[int, ...]) -> None:
    """The same three prompts (8, 2 and 5 positions to prefill) through the fixed-length prefill graphs (the
    scratch row, then each prompt's row copied from it): right-padded to 8, 4 and 8, each row's cache and
    steps are the plain loop's alone; with the 4 graph only, the prompts it does not fit take the one-run
    path in the same call."""
    _batched_prefill(fused_dir, tiny_bundle, prefix, "cpu", TOLERANCE, lengths)


def test_a_captured_prefill_in_fp16_follows_the_fp32_plain_loop(fused_dir: Path, tiny_bundle: Path) -> None:
    """The fp16 graphs (what ort-cuda runs) over the fp16 buffer, within fp16's error."""
    _batched_prefill(fused_dir / "fp16", tiny_bundle, 4, "cpu", 2 * FP16_LOGP_TOLERANCE, PREFILL_LENGTHS)


@pytest.mark.gpu
def test_a_captured_prefill_on_cuda_follows_the_plain_loop(fused_dir: Path, tiny_bundle: Path) -> None:
    """The fp16 prefill graphs captured on ort-cuda (each length once, the scratch row at a fixed address,
    then replayed for rows of other lengths and pasts)."""
    require_cuda_provider()
    for prefix in (0, 4):
        _batched_prefill(fused_dir / "fp16", tiny_bundle, prefix, "cuda", 2 * FP16_LOGP_TOLERANCE, PREFILL_LENGTHS)


def _batched_prefill(fused_dir: Path, tiny_bundle: Path, prefix: int, device: str, tolerance: float,
                     prefill_lengths: tuple[int, ...] = ()) -> None:
    fused, prefill, decode = _fused_with_decode(fused_dir, tiny_bundle, device, prefill_lengths)
    assert fused.batched_prefill and fused.captured_prefill == bool(prefill_lengths)
    fused.warm_up()
    d = int(decode.input_shapes["inputs_embeds"][2])
    speech = np.load(tiny_bundle / "llm_speech_embedding.npy")
    rng = np.random.default_rng(11)
    rows, lengths = [0, 2, 3], [9, 3, 6]
    prompts = [(rng.standard_normal((1, prefix + t, d)) * 0.05).astype(np.float32) for t in lengths]
    loops, firsts, pasts = [], [], []
    for x in prompts:
        loop = BoundDecodeLoop(prefill, decode, device)
        if prefix:
            head = BoundDecodeLoop(prefill, decode, device)
            head.prefill(x[:, :prefix])
            pasts.append(np.asarray(head._kv.numpy()))  # noqa: SLF001 - the prefix cache as a host array
            firsts.append(loop.prefill(x[:, prefix:], pasts[-1]))
        else:
            firsts.append(loop.prefill(x))
        loops.append(loop)
    fused.prefill_rows(rows, [x[:, prefix:] for x in prompts], pasts if prefix else None)
    cache = [prefix + t - 1 for t in lengths]
    _first_steps_alone(fused, rows, prompts, cache, firsts, loops, tolerance)
    tokens = speech[rng.integers(0, speech.shape[0] - 3, len(rows))]
    logp = fused.step(rows, tokens, [c + 1 for c in cache], 4)
    for j in range(len(rows)):
        assert _rel(logp[j], loops[j].step(tokens[j].reshape(1, 1, d))[0]) < tolerance
    with pytest.raises(SynthesisError, match="do not fit"):
        fused.prefill_rows([1], [prompts[0][:, :1]], None)  # a one-position prompt has nothing to prefill


def _first_steps_alone(fused: FusedDecodeStep, rows: list[int], prompts: list[np.ndarray], cache: list[int],
                       firsts: list[np.ndarray], loops: list[BoundDecodeLoop], tolerance: float) -> None:
    """After prefill_rows: each row's first step, fed its prompt's last position, gives the logp of the
    prompt's whole prefill alone (`firsts`), and the row's cache is that loop's."""
    logp = fused.step(rows, np.stack([x[0, -1] for x in prompts]), cache, 4)
    for j, row in enumerate(rows):
        assert _rel(logp[j], firsts[j][0]) < tolerance
        plain = np.asarray(loops[j]._kv.numpy())[:, :, 0]  # noqa: SLF001
        assert _rel(fused.row_cache(row, cache[j] + 1).astype(np.float32), plain) < tolerance


def test_a_voice_prefix_stays_in_the_scratch_row_between_prompts(fused_dir: Path, tiny_bundle: Path) -> None:
    """Prompts after one saved prefix (a voice's: one read-only array for all its requests) through the captured
    prefill graphs: the prefix goes into the scratch row once and stays there for the next prompts (a prefill
    writes only the positions after it); a prompt without a prefix, or another array, puts it in again. Each
    row's cache and steps are the plain loop's alone throughout."""
    _prefix_kept(fused_dir, tiny_bundle, "cpu", TOLERANCE)


@pytest.mark.gpu
def test_a_voice_prefix_stays_in_the_scratch_row_on_cuda(fused_dir: Path, tiny_bundle: Path) -> None:
    """The same with the fp16 prefill graphs captured on ort-cuda (the scratch row written in place under
    capture keeps the prefix before the prompt's positions), within fp16's error."""
    require_cuda_provider()
    _prefix_kept(fused_dir / "fp16", tiny_bundle, "cuda", 2 * FP16_LOGP_TOLERANCE)


def _prefix_kept(fused_dir: Path, tiny_bundle: Path, device: str, tolerance: float) -> None:
    fused, prefill, decode = _fused_with_decode(fused_dir, tiny_bundle, device, PREFILL_LENGTHS)
    fused.warm_up()
    d = int(decode.input_shapes["inputs_embeds"][2])
    rng = np.random.default_rng(21)
    head = (rng.standard_normal((1, 4, d)) * 0.05).astype(np.float32)
    voice = BoundDecodeLoop(prefill, decode, device)
    voice.prefill(head)
    kv = np.array(voice._kv.numpy())  # noqa: SLF001 - the prefix cache as a host array
    kv.setflags(write=False)  # as LlmPrefix keeps it

    def check(rows: list[int], lengths: list[int], past: np.ndarray | None) -> None:
        tails = [(rng.standard_normal((1, t, d)) * 0.05).astype(np.float32) for t in lengths]
        firsts, loops = [], []
        for x in tails:
            loop = BoundDecodeLoop(prefill, decode, device)
            firsts.append(loop.prefill(x, past) if past is not None else loop.prefill(x))
            loops.append(loop)
        fused.prefill_rows(rows, tails, None if past is None else [past] * len(rows))
        p = 0 if past is None else 4
        _first_steps_alone(fused, rows, tails, [p + t - 1 for t in lengths], firsts, loops, tolerance)

    check([0, 2, 3], [9, 3, 6], kv)  # in once, then kept for the two after it
    assert fused.prefix_reuses == 2
    check([1], [5], kv)  # still there from the last call
    assert fused.prefix_reuses == 3
    check([0], [6], None)  # a prompt from position 0 overwrites it
    check([2], [4], kv)
    assert fused.prefix_reuses == 3
    writable = np.array(kv)  # the same values in an array that could change: in again each time
    check([3, 1], [7, 2], writable)
    assert fused.prefix_reuses == 3


def test_a_bundle_whose_insert_takes_one_prompt_has_no_batched_prefill(fused_dir: Path, tiny_bundle: Path,
                                                                        tmp_path: Path) -> None:
    """A bundle exported before the insert graph took a batch's row still prefills row by row
    (`batched_prefill` False) and refuses `prefill_rows` with a message that says what to do."""
    import onnx

    model = onnx.load(str(fused_dir / "llm_fused_kv_insert.onnx"))
    graph = model.graph
    gather = next(n for n in graph.node if n.output[0] == "present_row")
    graph.node.remove(gather)
    for n in graph.node:  # the old graph read present_kv (batch 1) directly
        n.input[:] = ["present_kv" if i == "present_row" else i for i in n.input]
    graph.input.remove(next(i for i in graph.input if i.name == "batch_row"))
    onnx.save(model, str(tmp_path / "old_insert.onnx"))
    prefill = _session("llm_prefill", tiny_bundle / "llm_prefill.onnx")
    fused = FusedDecodeStep({1: _session("fused1", fused_dir / "llm_decode_fused_b1.onnx")},
                            _session("insert", tmp_path / "old_insert.onnx"), prefill, ("cpu", 0), rows=1)
    assert not fused.batched_prefill
    d = int(prefill.input_shapes["inputs_embeds"][2])
    x = (np.random.default_rng(2).standard_normal((1, 5, d)) * 0.05).astype(np.float32)
    ref = BoundDecodeLoop(prefill, _session("llm_decode", tiny_bundle / "llm_decode.onnx"), "cpu").prefill(x)
    assert _rel(fused.prefill(0, x), ref) < TOLERANCE
    with pytest.raises(SynthesisError, match="re-export it for batched prefills"):
        fused.prefill_rows([0], [x])

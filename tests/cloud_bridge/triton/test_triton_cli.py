"""`cosyedge triton --bundle DIR` as a user runs it: a server on the
product repository with the tiny bundle, ready for streaming requests, and
stopped cleanly by SIGTERM."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from cosyedge_cloud.triton.launcher import TritonError, find_server
from cosyedge_cloud.triton.model_io import OUTPUTS, request_tensors

from tests.support.broker import free_port
from tests.support.components import missing
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]


def test_triton_command_serves_the_bundle(tiny_bundle: Path, tmp_path: Path) -> None:
    try:
        find_server()
    except TritonError as exc:
        missing(f"tritonserver is not available: {exc}")
    import tritonclient.grpc as grpcclient

    grpc, http, metrics = free_port(), free_port(), free_port()
    log = tmp_path / "triton.log"
    cmd = [
        sys.executable,
        "-m",
        "cosyedge_daemon",
        "triton",
        "--bundle",
        str(tiny_bundle),
        "--grpc-port",
        str(grpc),
        "--http-port",
        str(http),
        "--metrics-port",
        str(metrics),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: "Triton ready" in log.read_text() or proc.poll() is not None, 300), log.read_text()
        assert proc.poll() is None, log.read_text()
        assert "model cosyvoice2 versions 1, 2" in log.read_text()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        responses: queue.Queue = queue.Queue()  # type: ignore[type-arg]
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = []
        for name, array in request_tensors("Hi.", seed=1).items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.async_stream_infer(
            "cosyvoice2",
            inputs,
            request_id="cli",
            enable_empty_final_response=True,
            outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
        )
        chunks = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            if result.get_response().outputs:
                chunks.append(result.as_numpy("AUDIO"))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        client.close()
        assert chunks and all(c.dtype == np.float32 for c in chunks) and sum(c.size for c in chunks) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkilled_launcher_leaves_no_server(tiny_bundle: Path, tmp_path: Path) -> None:
    """`cosyedge triton` killed by SIGKILL (no cleanup code runs): the kernel
    stops tritonserver (PR_SET_PDEATHSIG) and its ports are free again."""
    from tests.support.broker import wait_for_port

    try:
        find_server()
    except TritonError as exc:
        missing(f"tritonserver is not available: {exc}")
    import socket

    grpc, http, metrics = free_port(), free_port(), free_port()
    log = tmp_path / "triton.log"
    cmd = [sys.executable, "-m", "cosyedge_daemon", "triton", "--bundle", str(tiny_bundle), "--grpc-port", str(grpc),
           "--http-port", str(http), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: "Triton ready" in log.read_text() or proc.poll() is not None, 300), log.read_text()
        wait_for_port(http, 5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

        def port_free() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", http)) != 0

        assert wait_for(port_free, 60), "tritonserver outlived its SIGKILLed launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

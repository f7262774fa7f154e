"""CPU use of the idle microphone + VAD loop (the daemon's standing cost while
nobody speaks), as % of one core of this process (all its threads: PortAudio's
callback, the capture thread, the VAD worker).

    python -m cosyedge_daemon.tools.bench_vad [--seconds 20] [--source auto|device|jack|paced] [--with-output]

Sources: `device` = the default (or --device) input through sounddevice;
`jack` = a private JACK server with the dummy driver (real-time paced, no
hardware; jackd's own CPU is not counted: on a board ALSA does that work in
the kernel); `paced` = silence delivered in real time by a thread (no
PortAudio at all); `auto` = device if one exists, else jack if jackd is
installed, else paced."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
from cosyedge_daemon.audio.sources import ArraySource
from cosyedge_daemon.audio.vad_worker import VadWorker
from cosyedge_daemon.settings.audio import AudioSettings, VadSettings

GOAL_PERCENT = 3.0


@contextmanager
def private_jack(rate: int = 16000, period: int = 480) -> Iterator[None]:
    """A JACK dummy-driver server for this process only (PortAudio re-initialised to see it)."""
    name = f"cosyedge-bench-{os.getpid()}"
    env = {**os.environ, "JACK_NO_START_SERVER": "1"}
    cmd = ["jackd", "--no-realtime", "-t", "5000", "-n", name,
           "-d", "dummy", "-r", str(rate), "-p", str(period)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    import sounddevice as sd

    try:
        deadline = time.monotonic() + 15
        while True:
            ports = subprocess.run(["jack_lsp", "-s", name], capture_output=True, text=True, env=env).stdout
            if "system:capture_1" in ports:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("jackd did not start")
            time.sleep(0.1)
        os.environ["JACK_DEFAULT_SERVER"] = name
        sd._terminate()
        sd._initialize()
        yield
    finally:
        sd._terminate()
        os.environ.pop("JACK_DEFAULT_SERVER", None)
        proc.terminate()
        proc.wait(timeout=10)
        sd._initialize()


def _has_input_device() -> bool:
    try:
        import sounddevice as sd

        return any(d["max_input_channels"] > 0 for d in sd.query_devices())
    except OSError:
        return False


def measure(source_kind: str, seconds: float, vad: VadSettings, audio: AudioSettings,
            with_output: bool) -> dict[str, Any]:
    from cosyedge_daemon.audio.devices import create_sink, create_source

    events: list[Any] = []
    if source_kind == "paced":
        source: Any = ArraySource(np.zeros(16000, np.int16), vad.frame_ms, realtime=True, loop=True)
    else:
        source = create_source(audio, vad)
    sink = create_sink(audio, 24000) if with_output and source_kind != "paced" else None
    worker = VadWorker(source, vad, events.append, lambda *a: None)
    worker.start()
    if sink is not None:
        sink.start()
    try:
        time.sleep(1.0)  # settle: stream start-up is not the idle cost
        frames0 = worker.frames_in
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        frames = worker.frames_in - frames0
    finally:
        worker.stop()
        if sink is not None:
            sink.close()
    return {"source": source_kind, "with_output": sink is not None, "seconds": round(wall, 2),
            "cpu_percent_of_one_core": round(100.0 * cpu / wall, 3), "frames": frames,
            "frames_expected": round(wall * 1000 / vad.frame_ms), "frame_ms": vad.frame_ms,
            "aggressiveness": vad.aggressiveness, "vad_events": len(events),
            "dropped": worker.frames_dropped, "overflows": source.overflows, "goal_percent": GOAL_PERCENT}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_daemon.tools.bench_vad", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--source", choices=["auto", "device", "jack", "paced"], default="auto")
    p.add_argument("--device", default="default", help="input device for --source device")
    p.add_argument("--frame-ms", type=int, choices=[10, 20, 30], default=30)
    p.add_argument("--with-output", action="store_true", help="also keep an idle output stream open")
    p.add_argument("--json", help="append the result as one JSON line to this file")
    args = p.parse_args(argv)

    kind = args.source
    if kind == "auto":
        kind = "device" if _has_input_device() else ("jack" if shutil.which("jackd") else "paced")
    if kind == "jack" and not shutil.which("jackd"):
        print("jackd is not installed (apt-get install jackd2)", file=sys.stderr)
        return 2
    vad = VadSettings(frame_ms=args.frame_ms)
    device = "system" if kind == "jack" else args.device
    audio = AudioSettings(input_device=device, output_device=device)
    with private_jack() if kind == "jack" else nullcontext():
        result = measure(kind, args.seconds, vad, audio, args.with_output)
    line = json.dumps(result)
    print(line)
    print(f"idle capture+VAD ({kind}{', with an idle output stream' if result['with_output'] else ''}): "
          f"{result['cpu_percent_of_one_core']:.2f}% of one core over {result['seconds']} s "
          f"(goal < {GOAL_PERCENT}%)", file=sys.stderr)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

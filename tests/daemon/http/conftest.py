"""The HTTP speech API inside an in-process daemon on the CosyVoice tiny
bundle (the product's engine), asked through OpenAI's own Python client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from cosyedge_daemon.service.service import Service
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.daemon.conftest import DaemonFactory, SynthesizerFactory

HTTP = {"listen": "127.0.0.1:0"}
KEY = "sk-test-4b1e"


@pytest.fixture()
def engine_factory(tiny_bundle: Path) -> SynthesizerFactory:
    return lambda: load_synthesizer(tiny_bundle)


def base_url(svc: Service) -> str:
    assert svc.http is not None
    return f"http://127.0.0.1:{svc.http.port}/v1"


def client(svc: Service, key: str = KEY, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(svc), api_key=key, max_retries=0, timeout=120, **kw)


def start(daemons: DaemonFactory, **http: Any) -> Service:
    return daemons.start(fallback=None, http={**HTTP, **http})

"""The router in front of the real CPU vLLM, driven by the official `openai` client: the same script the component
tier runs against the vLLM double (tests/openai_client.py), so what the double passes, vLLM itself passes too."""

from __future__ import annotations

import pytest

from r3090d.router.link import ModelKind
from tests import openai_client
from tests.component.test_router import LinkServer, RouterProcess, entry, short_dir  # noqa: F401 (a fixture)
from tests.e2e.real_vllm import engine_python, start_server  # noqa: F401 (a fixture)
from tests.fakevllm.harness import http
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

PUBLIC_KEY = "router-public-key"
ENGINE_KEY = "engine-private-key"


def test_the_openai_client_through_the_router_to_the_real_vllm(engine_python, tiny_model, vllm_lock, short_dir, tmp_path):  # noqa: F811
    engine = start_server(engine_python, tiny_model, tmp_path / "vllm.log", "--api-key", ENGINE_KEY, served_name="tiny")
    link = LinkServer(short_dir / "router.sock")
    router = RouterProcess(link.path, log_path=tmp_path / "router.log", queue_timeout=120.0, api_key=PUBLIC_KEY)
    try:
        engine.wait_ready()
        link.send(entry("tiny", upstream=engine.url, key=ENGINE_KEY, kind=ModelKind.GENERATE))
        router.start()
        wait_until(lambda: http().get(router.url + "/healthz").status_code == 200, 30, what="the router linked")
        # One engine serves the one model: no embeddings here (the component tier has them, against the double).
        openai_client.exercise(router.url + "/v1", PUBLIC_KEY, chat="tiny", coder="tiny", embed=None, listed=["tiny"])
    finally:
        router.kill()
        link.close()
        engine.stop()

"""``tandem serve`` with an EAGLE-3 head: its flags, ``spec_verify_ct`` in the native
API, the accept length in /metrics, greedy output equal to the plain server's."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server, metric_at_least

from tandem.scheduler.models.tiny import default_model_path
from tandem.spec_eagle import write_random_head

PROMPT = "Once upon a time"
MODEL = "tandem-tiny"  # the tiny test model's served name (live_server serves it)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    cache = tmp_path_factory.mktemp("cache")
    target = default_model_path(cache_dir=cache)
    head = write_random_head(target, tmp_path_factory.mktemp("head") / "eagle3", seed=5)
    flags = [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(head),
        "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "2",
        "--speculative-num-draft-tokens", "6",
        # Draft at every batch size and every measured gain (the gate would turn this
        # random head off after a few steps).
        "--speculative-disable-by-batch-size", "64", "--speculative-disable-adaptive",
    ]  # fmt: skip
    with live_server(cache, *flags) as live:
        yield live


def test_generate_reports_verify_steps(spec_server: LiveServer, tmp_path: Path) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    out = httpx.post(f"{spec_server.url}/generate", json=body, timeout=60).json()
    ct = out["meta_info"]["spec_verify_ct"]
    assert isinstance(ct, int)
    assert 1 <= ct <= 12
    from tandem.scheduler import Engine

    target = default_model_path(cache_dir=tmp_path)
    with Engine(model_path=str(target), device="cpu") as engine:
        plain = engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0})
    assert out["output_ids"] == plain["output_ids"]
    assert metric_at_least(spec_server.url, "tandem_spec_accept_length", 1.0) >= 1.0
    assert metric_at_least(spec_server.url, "tandem_spec_verify_steps_total", ct) >= ct
    info = httpx.get(f"{spec_server.url}/get_server_info", timeout=60).json()
    assert info["speculative_disable_adaptive"] is True  # the flag reached the engine
    assert info["spec_gate"] is None


def test_openai_stream_and_refused_logprobs(spec_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
        temperature=0.7, seed=3, stream=True,
    )  # fmt: skip
    finish = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finish[-1] in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2)

"""``tandem bench serve`` against a live ``tandem serve``, checked through ``--output-json``."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server

from tandem.server.bench import serve as bench_serve
from tandem.server.cli import main

KEYS = {
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "concurrency",
    *(
        f"{s}_{m}_ms"
        for s in ("mean", "median", "p99")
        for m in ("ttft", "itl", "tpot", "e2e_latency")
    ),
}
N = 4
SMALL = ["--num-prompts", str(N), "--random-input-len", "10", "--random-output-len", "5"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(cache))
        with live_server(cache) as live:
            yield live


def _run(server: LiveServer, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    argv = ["--base-url", server.url, *SMALL, *extra, "--output-json", str(out)]
    assert bench_serve.main(argv) == 0
    return json.loads(out.read_text())


def _check(result: dict) -> None:
    assert set(result) >= KEYS
    assert result["completed"] == N
    assert result["failed"] == 0
    assert result["output_lens"] == result["requested_output_lens"]
    assert result["total_output_tokens"] == sum(result["requested_output_lens"])
    assert result["total_input_tokens"] > 0
    assert all(result[k] is not None for k in KEYS)


def test_completions_all_at_once(server: LiveServer, tmp_path: Path) -> None:
    result = _run(server, tmp_path, "--random-range-ratio", "0.5")
    _check(result)
    assert result["request_rate"] == "inf"
    assert result["endpoint"] == "completions"
    assert result["total_input_tokens"] >= N * 5


def test_chat_finite_rate_capped(server: LiveServer, tmp_path: Path) -> None:
    extra = ["--endpoint", "chat", "--request-rate", "20", "--max-concurrency", "2"]
    result = _run(server, tmp_path, *extra, "--workload", "shared-prefix")
    _check(result)
    assert result["max_concurrency"] == 2
    assert result["request_rate"] == 20
    assert result["concurrency"] <= 2.0 + 1e-6


def test_cli_registration(server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2"]
    argv += ["--random-input-len", "6", "--random-output-len", "3", "--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 2
    assert result["output_lens"] == result["requested_output_lens"]


def test_unreachable_server_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        bench_serve.main(["--base-url", "http://127.0.0.1:1", "--num-prompts", "1"])
    assert info.value.code == 2


def test_fairness_one_heavy_request_barely_slows_the_others(
    server: LiveServer, tmp_path: Path
) -> None:
    """Plain streams alone, then beside one request carrying the most and longest stop
    strings and top logprobs the server allows: their median TPOT stays within 3x
    (the benchmark's bar, on a quiet machine, is 1.5x: docs/benchmarks.md). Before
    stop strings were one automaton, such a request made every step scan each string."""
    out = tmp_path / "fair.json"
    argv = ["--base-url", server.url, "--num-prompts", "8", "--random-input-len", "16"]
    argv += ["--random-output-len", "48", "--fairness", "--output-json", str(out)]
    assert bench_serve.main(argv) == 0
    fair = json.loads(out.read_text())["fairness"]
    assert fair["heavy"] == {"stop_strings": 64, "stop_string_length": 1024, "top_logprobs": 20}
    for run in ("alone", "beside"):
        assert fair[run]["completed"] == 8
        assert fair[run]["failed"] == 0
    assert fair["tpot_ratio"] < 3.0, fair["tpot_ratio"]


def test_accept_length_of_a_speculative_server(tmp_path: Path) -> None:
    """Against a server that speculates, the run's accept length comes from the server's
    counters around it; a plain server's run has none (``test_completions_all_at_once``
    checks only the common keys, so it is asserted here)."""
    from tandem.scheduler.models.tiny import default_model_path
    from tandem.spec_eagle import write_random_head

    cache = tmp_path / "cache"
    head = write_random_head(default_model_path(cache_dir=cache), tmp_path / "head")
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head)]
    with live_server(cache, *spec) as live:
        result = _run(live, tmp_path, "--max-concurrency", "1")
    _check(result)
    assert result["spec_verify_steps"] >= 1
    assert 1.0 <= result["spec_accept_length"] <= 4.0


def test_no_accept_length_without_speculation() -> None:
    assert bench_serve._accept_length((3, 9), (3, 9)) == {}
    assert bench_serve._accept_length(None, (4, 10)) == {}
    assert bench_serve._accept_length((2, 5), (6, 15)) == {
        "spec_verify_steps": 4,
        "spec_accept_length": 2.5,
    }


def test_apply_chat_template_is_for_tandem_bench(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        bench_serve.main(["--base-url", "http://127.0.0.1:1", "--apply-chat-template"])
    assert info.value.code == 2

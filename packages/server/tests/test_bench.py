"""``tandem bench``: small runs of each workload, checked through ``--output-json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.server.bench import offline as bench
from tandem.server.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from repo_scripts import HOOK, ROOT, load_module

KEYS = {
    "output_throughput",
    "request_throughput",
    "input_throughput",
    "total_output_tokens",
    "duration_s",
    "device_idle_fraction",
    "overshoot_steps",
    "host_us_per_decode_step",
    *(f"{s}_{m}_ms" for s in ("mean", "p50", "p99") for m in ("ttft", "itl", "tpot")),
}
SMALL = ["--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "6"]
TINY = ["--model-path", "tandem-tiny"]


@pytest.fixture(autouse=True)
def _env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache))


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    assert main(["bench", "--device", "cpu", *TINY, *extra, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    # The file names the command that reproduces it.
    assert report.pop("command").startswith("tandem bench --device cpu")
    return report


def _expected(*extra: str) -> list[int]:
    from tokenizers import Tokenizer

    from tandem.scheduler.models.tiny import default_model_path

    args = bench.build_parser().parse_args(list(extra))
    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    return bench.build_workload(args, 429, tokenizer, 2048).output_lens


def test_random_compare_overlap_and_transformers(tmp_path: Path, capsys) -> None:
    extra = [*SMALL, "--random-range-ratio", "0.5", "--seed", "3"]
    report = _run(tmp_path, *extra, "--compare-overlap", "--compare-transformers")
    assert set(report) == {"normal", "overlap", "transformers"}
    expected = _expected(*extra)
    assert all(3 <= k <= 6 for k in expected)
    for name, result in report.items():
        assert set(result) >= KEYS, name
        assert result["output_lens"] == expected, name
        assert result["total_output_tokens"] == sum(expected)
        assert result["output_throughput"] > 0
        assert result["duration_s"] > 0
    for name in ("normal", "overlap"):
        assert report[name]["mean_ttft_ms"] > 0
        assert report[name]["p99_itl_ms"] > 0
        assert 0 <= report[name]["device_idle_fraction"] <= 1
        assert report[name]["overshoot_steps"] >= 0
        assert report[name]["host_us_per_decode_step"] > 0
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "device_idle_fraction"):
        assert report["transformers"][key] is None
    assert report["transformers"]["host_us_per_decode_step"] is None
    table = capsys.readouterr().out
    assert "output tok/s" in table
    assert "decode host (us)" in table
    assert "transformers" in table


def test_shared_prefix(tmp_path: Path) -> None:
    extra = [*SMALL, "--workload", "shared-prefix", "--shared-prefix-len", "10"]
    report = _run(tmp_path, *extra, "--random-range-ratio", "1")
    assert set(report) == {"overlap"}
    assert report["overlap"]["output_lens"] == [6] * 6
    assert report["overlap"]["total_input_tokens"] == 6 * (10 + 12)
    args = bench.build_parser().parse_args([*extra])
    prompts = bench.build_workload(args, 429, None, 2048).prompts
    assert len({tuple(p[:10]) for p in prompts}) == 1


def test_sharegpt(tmp_path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": f"Tell me about item {i}."},
                           {"from": "gpt", "value": "It is a thing. " * (i + 1)}]}
        for i in range(8)
    ] + [{"conversations": [{"from": "human", "value": "no answer"}]}]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    extra = ["--workload", "sharegpt", "--dataset-path", str(path), "--num-prompts", "6"]
    report = _run(tmp_path, *extra, "--compare-transformers")
    assert set(report) == {"overlap", "transformers"}
    expected = _expected(*extra)
    assert len(expected) == 6
    assert len(set(expected)) > 1
    for result in report.values():
        assert result["output_lens"] == expected
        assert result["total_output_tokens"] == sum(expected)


def test_sharegpt_with_the_chat_template(tmp_path: Path) -> None:
    """``--apply-chat-template``: each human turn is a one-turn chat in the model's
    template, so the prompt is the rendered chat's tokens."""
    from tandem.scheduler.models.tiny import default_model_path
    from tandem.scheduler.text.tokenizer import Tokenizer
    from tandem.server.bench import offline

    data = [{"conversations": [{"from": "human", "value": "Tell me about tea."},
                               {"from": "gpt", "value": "It is a drink."}]}]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    tokenizer = Tokenizer.from_pretrained(default_model_path())
    args = offline.build_parser().parse_args(
        ["--workload", "sharegpt", "--dataset-path", str(path), "--apply-chat-template"]
    )
    work = offline.build_workload(args, 0, tokenizer, 1 << 20)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about tea."}])
    assert work.prompts == [tokenizer.encode(chat, add_special_tokens=False)]
    assert work.output_lens == [len(tokenizer.encode("It is a drink.", add_special_tokens=False))]


def test_sharegpt_needs_dataset() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--workload", "sharegpt"])
    assert exc.value.code == 2


def test_compare_speculative_on_a_text_workload(tmp_path: Path, cache: Path) -> None:
    from tandem.scheduler.models.tiny import default_model_path
    from tandem.spec_eagle import write_random_head

    head = write_random_head(default_model_path(cache_dir=cache), tmp_path / "head")
    text = tmp_path / "text.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 20)
    report = _run(
        tmp_path, "--workload", "text", "--dataset-path", str(text), *SMALL,
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
        "--speculative-disable-by-batch-size", "64", "--speculative-disable-adaptive",
        "--compare-speculative",
    )  # fmt: skip
    assert set(report) == {"plain", "speculative"}
    assert set(report["speculative"]) >= KEYS
    assert report["speculative"]["spec_accept_length"] >= 1.0
    assert report["speculative"]["speedup"] > 0
    assert "spec_accept_length" not in report["plain"]
    assert report["plain"]["total_output_tokens"] == report["speculative"]["total_output_tokens"]


def test_the_speculative_options_reach_the_engine_as_given() -> None:
    args = bench.build_parser().parse_args(
        ["--speculative-algorithm", "EAGLE3", "--speculative-disable-adaptive"]
    )
    assert bench.speculative_options(args) == {
        "speculative_algorithm": "EAGLE3",
        "speculative_disable_adaptive": True,
    }
    assert bench.speculative_options(bench.build_parser().parse_args([])) == {}


def test_compare_speculative_needs_an_algorithm(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", *TINY, "--compare-speculative", *SMALL])


def test_stream_reads_the_same_tokens_as_streams(tmp_path: Path) -> None:
    extra = [*SMALL, "--seed", "5"]
    report = _run(tmp_path, *extra, "--stream", "--repeats", "1")
    (result,) = report.values()
    assert set(result) >= KEYS
    assert result["output_lens"] == _expected(*extra)
    assert result["mean_ttft_ms"] > 0
    assert result["p50_itl_ms"] > 0


def test_engine_times_count_each_token_of_an_arrival() -> None:
    """Tokens that share a time arrived together (one step, or a speculative step's
    several): an arrival of k tokens after a gap counts k latencies of gap / k."""
    assert bench._grouped([1.0, 1.5, 1.5, 1.5, 2.0]) == [(1.0, 1), (1.5, 3), (2.0, 1)]

    class _Counters:
        def get_server_info(self) -> dict[str, float]:
            return dict.fromkeys(
                ("spec_verify_steps", "spec_committed_tokens", "device_busy_s",
                 "device_idle_s", "overshoot_steps", "decode_steps", "decode_scheduler_s"), 0.0,
            )  # fmt: skip

    workload = bench.Workload([[1, 2]], [5])
    arrivals = [bench._grouped([1.0, 1.5, 1.5, 1.5, 2.0])]
    result = bench._engine_result(_Counters(), workload, 2.0, _Counters().get_server_info(),
                                  0.5, arrivals)  # fmt: skip
    assert result["output_lens"] == [5]
    assert result["mean_ttft_ms"] == pytest.approx(500.0)
    # gaps: 0.5 over 3 tokens (three of 1/6 s), then 0.5 over 1 token
    assert result["mean_itl_ms"] == pytest.approx(1000 * (3 * (0.5 / 3) + 0.5) / 4)
    assert result["mean_tpot_ms"] == pytest.approx(1000 * 1.0 / 4)
    assert result["host_us_per_decode_step"] is None  # no decode step counted


# -- host cost per decode step ---------------------------------------------------------------------


def test_host_cost_counts_decode_iterations_only() -> None:
    """``decode_scheduler_s`` grows only in iterations that launch a decode batch: a
    prefill-only run leaves it (and ``decode_steps``) unchanged while ``scheduler_s``
    grows; a decoding run adds to it, never more than to ``scheduler_s``."""
    from tandem.scheduler import Engine

    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    for overlap in (False, True):
        with Engine(
            model_path="tandem-tiny", device="cpu", disable_overlap_schedule=not overlap,
            disable_progress_bar=True,
        ) as engine:  # fmt: skip
            first = engine.get_server_info()
            engine.generate(input_ids=prompts, sampling_params=params)
            prefilled = engine.get_server_info()
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 9})
            decoded = engine.get_server_info()
        assert prefilled["scheduler_s"] > first["scheduler_s"], overlap
        assert prefilled["decode_steps"] == first["decode_steps"] == 0, overlap
        assert prefilled["decode_scheduler_s"] == first["decode_scheduler_s"] == 0, overlap
        assert decoded["decode_steps"] == 8, overlap
        decode_s = decoded["decode_scheduler_s"]
        assert 0 < decode_s <= decoded["scheduler_s"] - prefilled["scheduler_s"], overlap


def test_bench_without_decode_steps_reports_no_host_cost(tmp_path: Path) -> None:
    """One output token per request: the prefill samples it, nothing decodes, so the
    per-decode-step figure is null rather than a prefill's cost."""
    report = _run(tmp_path, *SMALL[:4], "--random-output-len", "1", "--repeats", "1")
    assert report["overlap"]["output_lens"] == [1] * 6
    assert report["overlap"]["host_us_per_decode_step"] is None


def test_bench_max_running_requests_reaches_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tandem.scheduler

    rows: list[int] = []

    class Recording(tandem.scheduler.Engine):
        def __init__(self, *args: Any, **options: Any) -> None:
            super().__init__(*args, **options)
            rows.append(self.config.max_running_requests)

    monkeypatch.setattr(tandem.scheduler, "Engine", Recording)
    extra = ["--num-prompts", "80", "--random-input-len", "4", "--random-output-len", "3"]
    extra += ["--random-range-ratio", "1", "--max-running-requests", "80", "--repeats", "1"]
    report = _run(tmp_path, *extra)
    assert rows == [80]
    assert report["overlap"]["total_output_tokens"] == 80 * 3
    assert report["overlap"]["host_us_per_decode_step"] > 0
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", *TINY, *SMALL, "--max-running-requests", "0"])


def test_docs_hook_reads_the_host_cost(tmp_path: Path) -> None:
    """The site build checks ``tandem bench`` files: the new figure is a number or null."""
    from mkdocs.exceptions import PluginError

    hook = load_module(HOOK, "bench_figures_of_test_bench")
    run = {
        "duration_s": 1.0,
        "output_throughput": 10.0,
        "num_requests": 1,
        "total_output_tokens": 10,
    }
    path = tmp_path / "bench.json"
    for value in (123.4, None):
        path.write_text(json.dumps({"overlap": {**run, "host_us_per_decode_step": value}}))
        assert hook._load(path, tmp_path).value("overlap", "host_us_per_decode_step") == value
    path.write_text(json.dumps({"overlap": {**run, "host_us_per_decode_step": "fast"}}))
    with pytest.raises(PluginError, match="host_us_per_decode_step"):
        hook._load(path, tmp_path)


def test_asv_host_cost_benchmark_runs_as_asv_calls_it() -> None:
    """setup, the track function, teardown, per parameter combination; a combination
    without its device is skipped through NotImplementedError in setup."""
    module = load_module(ROOT / "benchmarks" / "benchmarks" / "host_cost.py", "asv_host_cost")
    suite = module.HostCost
    assert suite.params[1] == [1, 64, 256]
    assert suite.track_host_us_per_decode_step.unit == "us"
    benchmark = suite()
    try:
        benchmark.setup("cpu", 1, True)
        assert benchmark.track_host_us_per_decode_step("cpu", 1, True) > 0
    finally:
        benchmark.teardown("cpu", 1, True)
    import torch

    if not torch.cuda.is_available():
        skipped = suite()
        with pytest.raises(NotImplementedError):
            skipped.setup("cuda", 1, True)
        skipped.teardown("cuda", 1, True)


def test_constrained_fraction_masks_every_other_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tandem.scheduler

    sent: list[dict[str, Any]] = []

    class Recording(tandem.scheduler.Engine):
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            sent.extend(kwargs["sampling_params"])
            return super().generate(*args, **kwargs)

    monkeypatch.setattr(tandem.scheduler, "Engine", Recording)
    extra = ["--num-prompts", "4", "--random-input-len", "6", "--random-output-len", "5"]
    extra += ["--random-range-ratio", "1", "--repeats", "1", "--constrained-fraction", "0.5"]
    report = _run(tmp_path, *extra)
    measured = sent[-4:]  # after the warm-up
    assert [("regex" in p) for p in measured] == [False, True, False, True]
    # The regex is long enough that every request runs its full length.
    assert report["overlap"]["total_output_tokens"] == 4 * 5
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", *TINY, *SMALL, "--constrained-fraction", "2"])

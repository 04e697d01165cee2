"""The comparison with vLLM's CPU build, without vLLM: ``tools/bench_checkpoint.py``'s
checkpoint (the same bytes on every build, loadable by transformers and by tandem's
Engine), ``tools/bench_vllm_cpu.py``'s server handling and results file, and the docs
hook that renders that file."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tandem.scheduler import Engine

sys.path.insert(0, str(Path(__file__).parent))
from repo_scripts import HOOK, ROOT, load_module

TOOLS = ROOT / "tools"


checkpoint_tool = load_module(TOOLS / "bench_checkpoint.py", "bench_checkpoint")
bench_tool = load_module(TOOLS / "bench_vllm_cpu.py", "bench_vllm_cpu_under_test")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 10m checkpoint, built through the cache."""
    cache = tmp_path_factory.mktemp("cache")
    path = checkpoint_tool.checkpoint_path("10m", cache)
    assert path == cache / "tandem" / "bench-llama-10m-v1"
    return Path(path)


def test_builds_are_byte_identical_and_cached(small: Path, tmp_path: Path) -> None:
    """A second build, in another process, writes the same bytes; the cache is reused."""
    other = tmp_path / "other"
    command = [sys.executable, str(TOOLS / "bench_checkpoint.py"), "10m", "--output", str(other)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in small.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    assert "model.safetensors" in names
    for name in names:
        assert (small / name).read_bytes() == (other / name).read_bytes(), name

    stamp = (small / "model.safetensors").stat().st_mtime_ns
    assert checkpoint_tool.checkpoint_path("10m", small.parent.parent) == small
    assert (small / "model.safetensors").stat().st_mtime_ns == stamp


def test_config_is_the_llama_shape(small: Path) -> None:
    config = json.loads((small / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is False
    assert (config["max_position_embeddings"], config["rope_theta"]) == (2048, 10000.0)
    assert config["rms_norm_eps"] == 1e-5
    assert config["vocab_size"] == checkpoint_tool.VOCAB_SIZE == 9000
    shape = {k: config[k] for k in checkpoint_tool.SIZES["10m"]}
    assert shape == {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
    }
    assert checkpoint_tool.SIZES["100m"] == {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
    }


def test_transformers_and_the_engine_load_it(small: Path) -> None:
    """transformers reads the folder as written (tokenizer, chat template, every weight);
    its greedy tokens all carry text, and tandem's Engine makes the same ones."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(small)
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    ids = tokenizer("To be, or not to be").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "To be, or not to be"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|begin_of_text|><|im_start|>user\nHi<|im_end|>")

    model = transformers.AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == checkpoint_tool.parameter_count("10m")
    prompt = list(range(300, 364))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
        )
    expected = out[0, len(prompt) :].tolist()
    assert all(t < 128 or 256 <= t < 8996 for t in expected), expected

    with Engine(model_path=str(small), device="cpu", dtype="float32") as engine:
        result = engine.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
    assert result["output_ids"] == expected


# -- tools/bench_vllm_cpu.py ---------------------------------------------------------------------
def _figures(throughput: float) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "completed": 16,
        "failed": 0,
        "duration_s": 2.0,
        "total_input_tokens": 16 * 96,
        "total_output_tokens": 16 * 128,
        "output_lens": [128] * 16,
        "request_throughput": 8.0,
        "output_throughput": throughput,
    }
    for i, what in enumerate(("ttft", "tpot", "itl", "e2e_latency")):
        for stat, scale in (("mean", 1.0), ("median", 0.9), ("p99", 2.0)):
            figures[f"{stat}_{what}_ms"] = (10.0 + i) * scale
    return figures


def _record() -> dict[str, Any]:
    args = argparse.Namespace(
        model="10m",
        dtype="float32",
        concurrency=[1, 8],
        engines=["tandem", "vllm"],
        num_prompts=None,
        input_len=96,
        output_len=128,
        repeats=1,
        workload="random",
    )
    engines = {
        "tandem": {"command": ["python", "-m", "tandem.server.cli", "serve"], "env": {}},
        "vllm": {
            "command": ["<vllm venv>/bin/python", "-m", "vllm.entrypoints.openai.api_server"],
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        },
    }
    figures = {
        "tandem": {1: _figures(30.0), 8: _figures(200.0)},
        "vllm": {1: _figures(40.0), 8: _figures(100.0)},
    }
    versions = {"tandem_commit": "0123456789abcdef", "torch": "2.13.0+cpu", "vllm": "0.32.0"}
    argv = ["--model", "10m", "--concurrency", "1", "8"]
    return dict(bench_tool.build_record(args, argv, versions, engines, figures))


def test_record_holds_the_figures_and_ratios() -> None:
    record = _record()
    assert record["benchmark"] == "vs_vllm_cpu"
    assert record["command"] == "python tools/bench_vllm_cpu.py --model 10m --concurrency 1 8"
    assert [row["concurrency"] for row in record["results"]] == [1, 8]
    assert [row["num_prompts"] for row in record["results"]] == [16, 16]
    ratios = [row["tandem_vs_vllm_output_throughput"] for row in record["results"]]
    assert ratios == pytest.approx([0.75, 2.0])
    assert record["machine"]["cores"] >= 1
    assert record["model"]["parameters"] == checkpoint_tool.parameter_count("10m")
    assert "tandem/vllm" in bench_tool.format_table(record)


def test_rounds_alternate_the_engines_and_keep_each_ones_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every level runs both engines each round, the order reversed every other round;
    each engine's figures are its median round's, with every round listed."""
    speeds = iter([50.0, 40.0, 44.0, 30.0, 60.0, 10.0, 300.0, 200.0, 100.0, 250.0, 280.0, 150.0])
    calls: list[tuple[str, int, int]] = []

    def timed_run(args: Any, server: Any, url: str, ckpt: Path, c: int, r: int) -> Any:
        calls.append((server.name, c, r))
        return {**_figures(next(speeds)), "median_tpot_ms": float(len(calls))}

    monkeypatch.setattr(bench_tool, "timed_run", timed_run)
    args = argparse.Namespace(concurrency=[1, 8], repeats=3, num_prompts=None)
    servers = {
        name: (bench_tool.Server(name, ["true"], {}, Path(name)), "url")
        for name in ("tandem", "vllm")
    }
    figures = bench_tool.run_rounds(args, servers, Path("ckpt"))
    one_level = ["tandem", "vllm", "vllm", "tandem", "tandem", "vllm"]
    assert [name for name, _, _ in calls] == one_level * 2
    assert [(c, r) for _, c, r in calls[:6]] == [(1, 0), (1, 0), (1, 1), (1, 1), (1, 2), (1, 2)]
    expected = {
        ("tandem", 1): (50.0, [50.0, 30.0, 60.0], 1.0),
        ("vllm", 1): (40.0, [40.0, 44.0, 10.0], 2.0),
        ("tandem", 8): (280.0, [300.0, 250.0, 280.0], 11.0),
        ("vllm", 8): (150.0, [200.0, 100.0, 150.0], 12.0),
    }
    for (engine, c), (median, rounds, call) in expected.items():
        row = figures[engine][c]
        assert row["output_throughput"] == median
        assert row["output_throughput_runs"] == rounds
        assert row["median_tpot_ms"] == call, "every figure comes from the median round"


def test_every_round_sends_new_prompts_and_both_engines_the_same(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A round may not repeat an earlier run's prompts (they would be prefix-cache hits);
    within a round both engines get the same ones."""
    seeds: list[tuple[str, int, int]] = []

    def bench_serve(args: Any, engine: str, url: str, ckpt: Path, **kw: Any) -> Any:
        seeds.append((engine, kw["concurrency"], kw["seed"]))
        return _figures(10.0)

    monkeypatch.setattr(bench_tool, "bench_serve", bench_serve)
    args = argparse.Namespace(
        concurrency=[1, 8], repeats=3, num_prompts=None, input_len=96, output_len=128,
        tag="t", work_dir=tmp_path,
    )  # fmt: skip
    servers = {
        name: (bench_tool.Server(name, ["true"], {}, Path(name)), "url")
        for name in ("tandem", "vllm")
    }
    bench_tool.run_rounds(args, servers, Path("ckpt"))
    assert len(seeds) == 12
    for engine in servers:
        mine = [seed for e, _, seed in seeds if e == engine]
        assert len(set(mine)) == 6, "a seed (a prompt set) repeated"
    by_round = {(c, seed) for _, c, seed in seeds}
    assert len(by_round) == 6, "the engines of one round got different prompts"


def test_an_even_number_of_rounds_keeps_the_lower_middle() -> None:
    runs = [_figures(speed) for speed in (30.0, 10.0, 40.0, 20.0)]
    assert bench_tool.median_run(runs)["output_throughput"] == 20.0
    assert bench_tool.median_run(runs[:1])["output_throughput_runs"] == [30.0]
    assert bench_tool.round_order(["vllm", "tandem"], 3) == ["tandem", "vllm"]


def test_recorded_commands_hold_no_path_of_the_machine(small: Path) -> None:
    venv = ROOT / ".venvs" / "vllm-cpu"
    command = [str(venv / "bin" / "python"), "--model", str(small), "--x", sys.executable]
    shown = bench_tool.portable(command, small, venv)
    assert shown == ["<vllm venv>/bin/python", "--model", "<checkpoint bench-llama-10m-v1>",
                     "--x", "python"]  # fmt: skip


def _group_members(group: int) -> list[int]:
    """Live processes of ``group`` (a killed child may linger a moment as a zombie)."""
    return [
        pid
        for pid in bench_tool._pids()
        if bench_tool._pgid(pid) == group and not bench_tool._zombie(pid)
    ]


def test_a_stopped_server_leaves_no_process(tmp_path: Path) -> None:
    """The server and a child it started both go: the whole process group is signalled."""
    child = "import time; time.sleep(300)"
    parent = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print('up', flush=True); time.sleep(300)"
    )
    log = tmp_path / "server.log"
    server = bench_tool.Server("dummy", [sys.executable, "-c", parent], {}, log)
    server.launch()
    group = server.process.pid
    deadline = time.monotonic() + 60
    while len(_group_members(group)) < 2 or "up" not in log.read_text():
        assert time.monotonic() < deadline, "the dummy server did not start its child"
        time.sleep(0.1)
    server.stop()
    assert server.process is None
    assert _group_members(group) == []


def test_a_server_that_dies_is_reported_with_its_log(tmp_path: Path) -> None:
    code = "import sys; print('no model here', flush=True); sys.exit(3)"
    server = bench_tool.Server("dummy", [sys.executable, "-c", code], {}, tmp_path / "x.log")
    server.launch()
    with pytest.raises(bench_tool.Failure, match=r"(?s)status 3.*no model here"):
        server.wait_ready("http://127.0.0.1:9", timeout=60)
    server.stop()


# -- the docs hook -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hook() -> ModuleType:
    return load_module(HOOK, "bench_figures_vs_vllm_under_test")


def _write(folder: Path, record: dict[str, Any]) -> Path:
    path = folder / "vs-vllm-10m-float32.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def test_docs_hook_renders_the_file(hook: ModuleType, tmp_path: Path) -> None:
    record = _record()
    record["machine"]["isa"] = ["avx2", "avx512_bf16", "avx512f"]
    result = hook._load(_write(tmp_path, record), tmp_path)
    assert result.kind == "vs_vllm_cpu"
    table = hook._vs_table([result])
    row = "| 10m | float32 | AVX-512 | 1 | 30.0 | 40.0 | 0.75 | 9.9 ms | 9.9 ms | 9 ms | 9 ms |"
    assert row in table
    assert "| 10m | float32 | AVX-512 | 8 | 200.0 | 100.0 | 2.00 |" in table
    assert f"({record['machine']['cores']} cores, AVX-512)" in table
    assert "(10m float32, AVX-512)" in hook._vs_summary([result])
    # The vector instructions the machine had: AVX2 alone, or none recorded.
    record["machine"]["isa"] = ["avx2"]
    avx2 = hook._load(_write(tmp_path, record), tmp_path)
    assert "| 10m | float32 | AVX2 | 1 |" in hook._vs_table([avx2])
    del record["machine"]["isa"]
    unknown = hook._load(_write(tmp_path, record), tmp_path)
    assert "| 10m | float32 |  | 1 |" in hook._vs_table([unknown])
    assert "(10m float32)" in hook._vs_summary([unknown])
    assert "python tools/bench_vllm_cpu.py --model 10m --concurrency 1 8" in table
    assert "VLLM_CPU_KVCACHE_SPACE=1 '<vllm venv>/bin/python' -m" in table
    assert "0.75 at 1, 2.00 at 8" in hook._vs_summary([result])
    want = "Against the target over vLLM (1.2 at every level): reached at 8; missed at 1 by 0.45."
    assert want in hook._vs_summary([result])
    assert hook._vs_plot([result], "cpu").startswith(b"<?xml")


def _broken(record: dict[str, Any], how: str) -> dict[str, Any]:
    record = copy.deepcopy(record)
    row = record["results"][1]
    if how == "ratio":
        row["tandem_vs_vllm_output_throughput"] = 1.5
    elif how == "failed":
        row["vllm"]["failed"] = 2
    elif how == "missing":
        del row["tandem"]["median_tpot_ms"]
    elif how == "order":
        record["results"].reverse()
    elif how == "key":
        record["notes"] = "typo"
    elif how == "engine":
        del row["vllm"]
    return record


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("ratio", "its parts give"),
        ("failed", "failed requests"),
        ("missing", "median_tpot_ms' is missing"),
        ("order", "must increase"),
        ("key", "unexpected top-level key"),
        ("engine", r"results\[1\].vllm' must be an object"),
    ],
)
def test_docs_hook_rejects_a_malformed_file(
    hook: ModuleType, tmp_path: Path, how: str, message: str
) -> None:
    from mkdocs.exceptions import PluginError

    path = _write(tmp_path, _broken(_record(), how))
    with pytest.raises(PluginError, match=message):
        hook._load(path, tmp_path)


def _with_rounds(record: dict[str, Any]) -> dict[str, Any]:
    """``_record`` as ``--repeats 3`` writes it: each engine's median round and all three."""
    record = copy.deepcopy(record)
    rounds = [
        {"tandem": [33.0, 30.0, 25.0], "vllm": [45.0, 40.0, 35.0]},
        {"tandem": [200.0, 190.0, 210.0], "vllm": [100.0, 95.0, 105.0]},
    ]
    for row, by_engine in zip(record["results"], rounds, strict=True):
        for engine, speeds in by_engine.items():
            row[engine]["output_throughput_runs"] = speeds
    return record


def test_docs_hook_shows_the_spread_of_the_rounds(hook: ModuleType, tmp_path: Path) -> None:
    result = hook._load(_write(tmp_path, _with_rounds(_record())), tmp_path)
    summary = hook._vs_summary([result])
    assert "0.75 at 1 [0.71-0.75], 2.00 at 8 [2.00-2.00]" in summary
    assert "median of 3 rounds" in summary


def test_docs_hook_rejects_figures_that_are_not_the_median_round(
    hook: ModuleType, tmp_path: Path
) -> None:
    from mkdocs.exceptions import PluginError

    record = _with_rounds(_record())
    record["results"][0]["tandem"]["output_throughput_runs"] = [31.0, 32.0, 33.0]
    with pytest.raises(PluginError, match="not the median of its rounds"):
        hook._load(_write(tmp_path, record), tmp_path)


def test_a_results_file_does_not_count_as_a_local_change(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The previous file of a series (written by this script) leaves the tree clean;
    a change to anything else that is tracked does not."""
    results = tmp_path / "benchmarks" / "results" / "cpu"
    results.mkdir(parents=True)
    (results / "vs-vllm-10m-float32.json").write_text("{}\n")
    (tmp_path / "engine.py").write_text("x = 1\n")

    def git(*command: str) -> None:
        identity = ("-c", "user.name=t", "-c", "user.email=t@example.com")
        subprocess.run(["git", *identity, *command], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    monkeypatch.setattr(bench_tool, "ROOT", tmp_path)
    assert not bench_tool.tree_modified()
    (results / "vs-vllm-10m-float32.json").write_text('{"new": 1}\n')
    assert not bench_tool.tree_modified()
    (tmp_path / "engine.py").write_text("x = 2\n")
    assert bench_tool.tree_modified()

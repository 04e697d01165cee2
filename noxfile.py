"""Every developer command of tandem, as nox sessions (``nox -l`` lists them).

CPU sessions pin torch first: ``torch==2.13.0`` is a local CPU wheel on our machines,
and an unpinned ``torch`` (asked for directly or by a dependency) would pull a
multi-GB CUDA build from the registry. Everything after that is installed with a
constraint file that holds torch where it is.

GPU sessions (``tests-cuda``, ``tests-rocm``) run on machines with their own
preinstalled torch and no registry access: they reuse the running interpreter and put
the four packages on ``PYTHONPATH`` instead of installing them.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).parent
TORCH_CPU = "torch==2.13.0"
PACKAGES = ("core-futuremap", "scheduler", "spec-eagle", "server")
PACKAGE_DIRS = tuple(f"packages/{name}" for name in PACKAGES)
# transformers is the reference implementation the engine is checked against; the
# official openai client (over httpx) is the reference client of the server.
TEST_DEPS = (
    "pytest>=8",
    "hypothesis>=6.100",
    "hatchling>=1.21",
    "transformers>=4.56",
    "openai>=1.40",
    "httpx>=0.27",
    "schemathesis>=4.32",
    "triton==3.6.0",
)
DEBUG_ENV = {"TANDEM_DEBUG_FUTURES": "1"}


def _constraints(session: nox.Session) -> str:
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text(f"{TORCH_CPU}\n")
    return str(path)


def _install_cpu_stack(session: nox.Session, *extra: str) -> None:
    """torch first (the CPU wheel), then the four layers (editable) under a constraint."""
    session.install(TORCH_CPU)
    editable = [arg for pkg in PACKAGE_DIRS for arg in ("-e", pkg)]
    session.install("-c", _constraints(session), *editable, *extra)


def _gpu_tests(session: nox.Session, *, want_hip: bool) -> None:
    probe = (
        "import sys, torch; ok = torch.cuda.is_available() and "
        f"(torch.version.hip is not None) == {want_hip}; sys.exit(0 if ok else 1)"
    )
    kind = "ROCm" if want_hip else "CUDA"
    try:
        session.run("python", "-c", probe, silent=True)
    except nox.command.CommandFailed:
        session.error(f"no {kind} device visible to this interpreter's torch")
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
        "PYTHONPATH": os.pathsep.join(paths),
        "PATH": os.pathsep.join([str(layers / "bin"), os.environ.get("PATH", "")]),
    }
    session.run("python", "-m", "pytest", *session.posargs, env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite of all four packages, debug invariants on (the default session)."""
    _install_cpu_stack(session, *TEST_DEPS)
    session.run("pytest", *session.posargs, env=DEBUG_ENV)


@nox.session(name="tests-cuda", python=False)
def tests_cuda(session: nox.Session) -> None:
    """The suite plus CUDA-marked tests, on a CUDA machine's preinstalled torch."""
    _gpu_tests(session, want_hip=False)


@nox.session(name="tests-rocm", python=False)
def tests_rocm(session: nox.Session) -> None:
    """The suite plus ROCm-marked tests, on a ROCm machine's preinstalled torch."""
    _gpu_tests(session, want_hip=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) over everything; mypy --strict on core-futuremap."""
    session.install(TORCH_CPU)
    session.install("-c", _constraints(session), "ruff", "mypy", "-e", PACKAGE_DIRS[0])
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "packages/core-futuremap/src/tandem")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with mkdocs --strict (into build/site)."""
    session.install("mkdocs-material>=9.5", "mkdocstrings[python]>=0.25", "matplotlib")
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
    session.install(
        "mkdocs-material>=9.5", "mkdocstrings[python]>=0.25", "matplotlib", "playwright"
    )
    session.run("mkdocs", "build", "--strict", "--site-dir", "build/site")
    session.run(
        "python", "tools/check_site.py", "build/site", "--chromium", chromium, *session.posargs
    )


@nox.session
def bench(session: nox.Session) -> None:
    """The asv benchmark suite in quick mode, against this checkout, then the HTML
    dashboard (asv publish, into benchmarks/html).

    Results are recorded under the HEAD commit for a stable machine name,
    ``cpu-<cores>core`` (``TANDEM_ASV_MACHINE`` overrides it), and renamed so that no
    path of this checkout ends up in them (benchmarks/portable_results.py).
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
    """The main job: generate text offline with the embedded default model (on the CPU)."""
    _install_cpu_stack(session)
    args = session.posargs or ["--prompt", "Once upon a time", "--max-new-tokens", "32"]
    session.run("python", "-m", "tandem.scheduler", "--device", "cpu", *args)


@nox.session
def serve(session: nox.Session) -> None:
    """The main job: serve the embedded default model (or args after --) on :30000."""
    _install_cpu_stack(session)
    session.run("tandem", "serve", "--device", "cpu", *session.posargs)

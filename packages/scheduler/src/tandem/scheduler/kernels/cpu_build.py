"""tandem's CPU kernels: its own C++ ops, built on a machine's first CPU start.

Five sources make one library: ``cpu_decode.cpp`` (``decode_attention``),
``cpu_fused.cpp`` (the fused ``rms_norm``, ``silu_mul`` and ``rotary``),
``cpu_linear.cpp`` (the product over weights in panels, ``linear_panels``),
``cpu_quant.cpp`` (the same over quantized weights, ``linear_quant``) and
``cpu_stream.cpp`` (the weight stream that reads ahead of them). The first CPU
engine on a machine compiles them against the running torch into ``<cache>/kernels/``;
later starts load that build, and builds unused for ``UNUSED_FOR_S`` are removed. Without
a compiler, or when the build fails, the torch formulas stay, with a warning."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = (
    Path(__file__).with_name("cpu_decode.cpp"),
    Path(__file__).with_name("cpu_fused.cpp"),
    Path(__file__).with_name("cpu_linear.cpp"),
    Path(__file__).with_name("cpu_quant.cpp"),
    Path(__file__).with_name("cpu_stream.cpp"),
)
HEADERS = (  # cpu_math.h: included by every source
    Path(__file__).with_name("cpu_math.h"),
    Path(__file__).with_name("cpu_stream.h"),
)
COMPILERS = ("c++", "g++", "clang++")
BUILD_TIMEOUT_S = 600
UNUSED_FOR_S = 30 * 24 * 3600
BUILD_PREFIXES = ("cpu_kernels-", "decode_attention-")  # the second: before 0.1.0's rename


def loaded() -> bool:
    """Whether tandem's CPU kernels are registered in this process."""
    return hasattr(torch.ops.tandem, "decode_attention")


def load_cpu_kernels(cache_dir: Path) -> bool:
    """Register tandem's CPU kernels, building them into ``cache_dir`` first unless
    they are built already; False (and a warning) when this machine cannot build
    them. Processes that build at once take turns (a file lock): one compiles, the
    others load its library."""
    if loaded():
        return True
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler on PATH: the CPU forward keeps torch's kernels")
        return False
    flags = _flags()
    library = library_path(cache_dir, compiler, flags)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(library.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not library.exists():
                _build(compiler, flags, library)
            torch.ops.load_library(str(library))
            mark_used(library)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels not built, the forward keeps torch's kernels: %s", exc)
        return False
    remove_unused(cache_dir, keep=library)
    return True


def mark_used(library: Path) -> None:
    """Set ``library``'s access time to now (its modification time stays the build's):
    the access time is when a process last loaded it. A library loaded from a file
    this process may not change stays loaded."""
    try:
        os.utime(library, (time.time(), library.stat().st_mtime))
    except OSError as exc:
        log.debug("could not mark %s used: %s", library, exc)


def remove_unused(cache_dir: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove the builds in ``cache_dir`` other than ``keep`` that no process has
    loaded for ``UNUSED_FOR_S`` seconds, each with its lock file; one whose lock a
    process holds (building or loading it) stays. Returns the removed libraries."""
    now = time.time() if now is None else now
    removed = []
    for library in sorted(cache_dir.glob("*.so")):
        if library == keep or not library.name.startswith(BUILD_PREFIXES):
            continue
        lock_path = library.with_suffix(".lock")
        try:
            if now - library.stat().st_atime < UNUSED_FOR_S:
                continue
            with open(lock_path, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # in use: BlockingIOError
                library.unlink()
            lock_path.unlink(missing_ok=True)
        except OSError:
            continue
        removed.append(library)
    if removed:
        days = UNUSED_FOR_S // 86400
        log.info("removed %d CPU kernel builds unused for %d days", len(removed), days)
    return removed


def library_path(cache_dir: Path, compiler: str, flags: list[str]) -> Path:
    """The built library in ``cache_dir``, named by a hash of what makes it: the
    sources and their header, the torch version, the compiler and the flags."""
    made_of = [*(path.read_bytes() for path in (*SOURCES, *HEADERS)), torch.__version__.encode()]
    made_of += [compiler.encode(), *(f.encode() for f in flags)]
    key = hashlib.sha256(b"\0".join(made_of)).hexdigest()
    return cache_dir / f"cpu_kernels-{key[:16]}.so"


def _compiler() -> str | None:
    """The first C++ compiler of ``COMPILERS`` on ``PATH``."""
    return next((found for name in COMPILERS if (found := shutil.which(name))), None)


def _flags() -> list[str]:
    """Compiler flags: optimized, OpenMP (``at::parallel_for`` runs on the forward's
    intra-op threads only when the kernel is built with it), the running torch's C++
    ABI, and the vector instructions torch itself dispatches to on this CPU.

    ``-fno-trapping-math``: no code here reads the floating-point exception flags, and
    without it GCC keeps a loop with a float comparison in it (``exp_fast``'s clamps, in
    SiLU-and-multiply and the attention's softmax) scalar on AVX2, a branch per element,
    rather than select lanes it might compare a signalling NaN in. The arithmetic is
    the same either way."""
    abi = int(torch.compiled_with_cxx11_abi())
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-trapping-math"]
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={abi}")
    if platform.machine() in ("x86_64", "AMD64"):
        capability = torch.backends.cpu.get_cpu_capability()
        if capability in ("AVX2", "AVX512"):
            flags += ["-mavx2", "-mfma", "-mf16c"]
        if capability == "AVX512":
            flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]
            if _has_avx512_bf16():
                flags.append("-mavx512bf16")
            if _has_avx512_vnni():
                flags.append("-mavx512vnni")
    return flags


def _has_avx512_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (Cascade Lake, Ice Lake, Zen 4 and later), as
    torch's own CPU detection reports it."""
    supported = getattr(torch.cpu, "_is_vnni_supported", None)  # AVX512-VNNI only
    return bool(supported is not None and supported())


def _has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512-BF16, as torch reports it."""
    supported = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(supported is not None and supported())


@functools.cache
def bf16_kernels() -> bool:
    """Whether the kernels built on this machine have their AVX512-BF16 paths: the
    decode kernel's only bfloat16 path (``cpu_decode.cpp``; without it the engine
    attends bfloat16 with the float32 path over widened operands) and one of
    ``linear_panels``' two (``bf16_panels``). Fixed for the process, so asked once."""
    return "-mavx512bf16" in _flags()


@functools.cache
def bf16_panels() -> bool:
    """Whether tandem's product (``linear_panels``, ``cpu_linear.cpp``) takes
    bfloat16 in the kernels built on this machine: with AVX512-BF16's pairwise dot
    product, or, in an AVX2 build (no AVX-512), with float32 arithmetic over the
    widened pairs. An AVX-512 CPU without BF16 has oneDNN's bfloat16 product instead."""
    return "-mavx512bf16" in _flags() or panel_halves()


@functools.cache
def panel_halves() -> bool:
    """Whether the kernels built on this machine are the AVX2 build (no AVX-512), whose
    ``linear_panels`` reads a float32 panel by halves of 24 columns
    (``packing.to_panels``)."""
    flags = _flags()
    return "-mavx2" in flags and "-mavx512f" not in flags


def _build(compiler: str, flags: list[str], library: Path) -> None:
    """Compile ``SOURCES`` into ``library``, atomically (a temporary file renamed): each
    source by a compiler of its own, all at once (the machine's cores share the work),
    then one link."""
    # torch's own headers and libraries, found beside its package (what
    # torch.utils.cpp_extension would give, without the setuptools it imports).
    root = Path(torch.__file__).parent
    libdir = root / "lib"
    includes = [f"-I{root / 'include'}"]
    links = [f"-L{libdir}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{libdir}"]
    log.info("building tandem's CPU kernels (once per machine and torch version)")
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        objects = [Path(work) / f"{source.stem}.o" for source in SOURCES]
        compile_flags = [f for f in flags if f != "-shared"]
        runs = [
            subprocess.Popen(
                [compiler, *compile_flags, *includes, "-c", str(source), "-o", str(obj)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        try:
            for run in runs:
                _, err = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if run.returncode != 0:
                    raise RuntimeError(f"{Path(compiler).name} failed: {err.strip()[-2000:]}")
        finally:
            for run in runs:
                if run.poll() is None:
                    run.kill()
                    run.wait()
        partial = Path(work) / library.name
        command = [compiler, *flags, *map(str, objects), "-o", str(partial), *links]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, library)

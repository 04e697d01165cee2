"""The tiny test model, ``tandem-tiny``: a Llama-shaped checkpoint tandem builds itself.

Tests, benchmarks and quick experiments need a model that starts in a second with no
download, so tandem carries the recipe of a tiny one instead of its bytes: random weights
from a fixed seed and a byte-level BPE tokenizer trained on a paragraph embedded here (its
text is gibberish by design). It is served by naming it (``--model-path tandem-tiny``); the
default model is a real one (``models.source``). The result is an ordinary Hugging Face
folder written once into the cache, byte-identical on every build, so two machines (or two
racing processes) agree. Its folder still says "default model": it was tandem's default once.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from tandem.futuremap import read_env
from tandem.scheduler.text.tokenizer import byte_alphabet

# The tiny model's cache folder. Bump the suffix whenever any byte of the output changes:
# caches keyed on the old name must never be mistaken for the new model.
DEFAULT_MODEL_NAME = "default-model-v1"

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

_COMPLETE_MARKER = ".tandem-complete"
_MARKER_TEXT = f"tandem {DEFAULT_MODEL_NAME} complete\n"
_SEED = 20240917
_INIT_STD = 0.02
_NUM_BYTES = 256
_MAX_MERGES = 256

# A ChatML template; it writes the BOS token itself (as Llama 3's does), so the rendered
# prompt is encoded with add_special_tokens=False. List-of-parts content (OpenAI's
# multimodal form) contributes its text parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the BPE merges: plain English so common words get short token
# sequences, which keeps test prompts and generations short.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A tandem bicycle is a bicycle built for
two riders, one behind the other. The rider in front steers and the rider behind only
pedals, yet both of them move the bicycle forward at the same time, and neither of them
waits for the other. When the road goes up a hill, the riders push harder together;
when the road goes down, they rest together. This is the idea behind the engine that
serves a language model: while the device works on one batch of requests, the host
already prepares the next one. A request comes in with a prompt, the prompt is split
into tokens, and the model reads the tokens and writes new ones, one at a time, until it
writes the end of the text or reaches the length the user asked for. Each new token is
turned back into text and sent to the user as soon as it is ready. Hello, world! How are
you today? I am fine, thank you, and I hope that you are well. What is the capital of
France? The capital of France is Paris. What is two plus two? Two plus two is four.
Once upon a time there was a little house in the middle of a green forest, and in the
house there lived an old man with his cat and his dog. Every morning the old man went
out to the river to get water, and every evening he sat by the fire and told stories
to the cat and the dog, who listened to every word he said.
"""


def cache_root(cache_dir: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """Where tandem's own cache lives, without creating it.

    The argument wins, then ``TANDEM_CACHE_DIR``, then the platform convention
    (``$XDG_CACHE_HOME``, else ``~/.cache``), read from ``environ`` (default: the process
    environment, by ``read_env``).
    """
    if cache_dir is not None:
        return Path(cache_dir) / "tandem"
    env = read_env(environ)
    base = env.cache_dir or env.xdg_cache_home or Path.home() / ".cache"
    return base / "tandem"


def tiny_model_path(
    cache_dir: Path | None = None, *, environ: Mapping[str, str] | None = None
) -> Path:
    """The folder of the tiny test model in tandem's cache (``cache_root``), built on
    first use (``tiny_model_folder``)."""
    return tiny_model_folder(cache_root(cache_dir, environ))


# Its name from when the tiny model was tandem's default; tests and tools still use it.
default_model_path = tiny_model_path


def tiny_model_folder(root: Path) -> Path:
    """The tiny test model's folder under tandem's cache folder ``root``, built on first
    use.

    Safe when several processes call it at once: each builds in its own hidden sibling
    folder and renames it into place, which is atomic; whoever loses the race discards
    its copy. A folder without the completion marker (left by a crash or by hand) is
    never returned: it is set aside and rebuilt.
    """
    return build_once(root / DEFAULT_MODEL_NAME, write_default_model, is_complete)


def build_once(
    target: Path, write: Callable[[Path], None], complete: Callable[[Path], bool]
) -> Path:
    """``target``, written by ``write`` (into an existing, empty folder) unless
    ``complete`` already says it is there: built in a hidden sibling folder and renamed
    into place, so that no reader sees a half-written folder and racing builders agree."""
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.building"
    staging.mkdir()
    try:
        write(staging)
        _publish(staging, target, complete)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished build (its marker is written last)."""
    marker = folder / _COMPLETE_MARKER
    try:
        return marker.read_text(encoding="utf-8") == _MARKER_TEXT
    except OSError:
        return False


def _publish(staging: Path, target: Path, complete: Callable[[Path], bool]) -> None:
    """Rename ``staging`` to ``target`` unless a complete ``target`` already exists."""
    for _ in range(3):
        try:
            os.rename(staging, target)
            return
        except OSError:
            # rename refuses a non-empty target: another process got there first, or
            # debris of an interrupted copy sits there.
            if complete(target):
                return
        _discard(target)
    raise RuntimeError(f"could not move {staging.name} into {target}")


def _discard(folder: Path) -> None:
    """Remove an incomplete folder without racing a reader: rename it away first, so
    nobody ever sees it half-deleted."""
    trash = folder.parent / f".{folder.name}.{uuid.uuid4().hex}.trash"
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def write_default_model(folder: Path) -> None:
    """Write every file of the tiny model into the existing, empty ``folder``."""
    tokenizer = build_default_tokenizer()
    config = default_model_config(tokenizer)
    (folder / "tokenizer.json").write_bytes((tokenizer.to_str(pretty=True) + "\n").encode())
    write_json(folder / "tokenizer_config.json", tokenizer_config())
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", _generation_config(tokenizer))
    save_file(llama_weights(config, _SEED), str(folder / "model.safetensors"), {"format": "pt"})
    # Last: the marker is the promise that everything above is on disk.
    (folder / _COMPLETE_MARKER).write_text(_MARKER_TEXT, encoding="utf-8")


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as JSON with a fixed layout."""
    # Sorted keys and a fixed layout: the bytes, not just the content, must repeat.
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_bytes(text.encode("utf-8"))


def train_merges(text: str, vocab_size: int, min_frequency: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from ``text``, for a trainer vocabulary of
    ``vocab_size`` (the 256 bytes included).

    ``BpeTrainer`` breaks ties between equally frequent pairs deterministically (the
    tests check that two builds in two processes agree byte for byte).
    """
    scratch = Tokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    scratch.train_from_iterator([text], trainer=trainer)
    merges = json.loads(scratch.to_str())["model"]["merges"]
    return [(str(left), str(right)) for left, right in merges]


def build_default_tokenizer() -> Tokenizer:
    """The tiny model's tokenizer: ``bpe_tokenizer`` over the embedded text's merges."""
    return bpe_tokenizer(train_merges(_TRAINING_TEXT, _NUM_BYTES + _MAX_MERGES, 2))


def bpe_tokenizer(merges: list[tuple[str, str]]) -> Tokenizer:
    """A byte-level BPE tokenizer over ``merges``.

    Ids 0-255 are the bytes, then one id per merge in merge order, then the special
    tokens. Encoding adds the BOS token, like Llama 3.
    """
    vocab = {char: byte for byte, char in enumerate(byte_alphabet())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"the tokenizer lacks its special token {token}")
    return int(token_id)


_DEFAULT_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
_CONTEXT = 2048


def default_model_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tiny model's config.json (``llama_config``)."""
    return llama_config(tokenizer, _DEFAULT_SHAPE, _CONTEXT)


def llama_config(tokenizer: Tokenizer, shape: Mapping[str, int], context: int) -> dict[str, Any]:
    """config.json of a Llama of ``shape`` (hidden, intermediate and layer sizes, head
    counts) over ``tokenizer``: Llama's field names, so any Llama loader (ours,
    transformers, other engines) reads it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": False,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": special_id(tokenizer, BOS_TOKEN),
        "eos_token_id": special_id(tokenizer, END_OF_TEXT_TOKEN),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """Both chat end (``<|im_end|>``) and text end stop generation, as in Llama 3 instruct."""
    return {
        "bos_token_id": special_id(tokenizer, BOS_TOKEN),
        "eos_token_id": [
            special_id(tokenizer, IM_END_TOKEN),
            special_id(tokenizer, END_OF_TEXT_TOKEN),
        ],
    }


def tokenizer_config(eos_token: str = IM_END_TOKEN, context: int = _CONTEXT) -> dict[str, Any]:
    """tokenizer_config.json; the tiny model's end of turn is ``eos_token``."""
    return {
        # Without it transformers would pick its Llama tokenizer class, which rebuilds
        # a SentencePiece-style pipeline instead of using tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": eos_token,
        "pad_token": END_OF_TEXT_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "chat_template": CHAT_TEMPLATE,
    }


def default_model_weights(config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tiny model's weights (``llama_weights``)."""
    return llama_weights(config, _SEED)


def llama_weights(config: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights from ``seed`` under Hugging Face's Llama parameter names: normal
    with std 0.02, norm weights 1.

    Drawn in float64 and rounded to float32: the float32 sampler has vectorised paths
    that differ between CPUs, float64 sampling followed by rounding does not.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    hidden = int(config["hidden_size"])
    inner = int(config["intermediate_size"])
    head_dim = int(config["head_dim"])
    q_size = int(config["num_attention_heads"]) * head_dim
    kv_size = int(config["num_key_value_heads"]) * head_dim
    vocab = int(config["vocab_size"])

    def normal(*shape: int) -> torch.Tensor:
        draw = torch.randn(shape, generator=generator, dtype=torch.float64)
        return (draw * _INIT_STD).to(torch.float32).contiguous()

    weights = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(q_size, hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_size, hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_size, hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_size)
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(inner, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(inner, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inner)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights

"""The model layer against transformers: same logits for every family, GQA ratio and
embedding tie, from the same checkpoint folders, plus the loader's contracts (shards,
dummy weights, dtype, errors that name every bad tensor)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.scheduler.kernels.cpu_build import load_cpu_kernels
from tandem.scheduler.models import (
    SUPPORTED_ARCHITECTURES,
    CausalLM,
    ModelConfig,
    cpu_path,
    decoder,
    load_model,
    resolve_dtype,
)
from tandem.scheduler.models.tiny import cache_root
from tandem.scheduler.models.weights import dummy_tensor

pytest.importorskip("transformers")


def _import_reference_models() -> ModuleType:
    """The helper sits beside this file; pytest's importlib mode puts no test folder on
    ``sys.path``, so it is imported by location."""
    path = Path(__file__).with_name("reference_models.py")
    spec = importlib.util.spec_from_file_location("tandem_tests_reference_models", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref = _import_reference_models()

PROMPT_LENS = (5, 40, 11)
TOLERANCE = 1e-4


def _prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=generator) for n in PROMPT_LENS]


@torch.no_grad()
def _tandem_logits(model: CausalLM, prompts: list[torch.Tensor]) -> torch.Tensor:
    """All prompts as ONE packed forward; logits at every token."""
    input_ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    attn = ref.DenseCausalAttention([len(p) for p in prompts])
    return model.compute_logits(model(input_ids, positions, attn))


@torch.no_grad()
def _reference_logits(path: Path, prompts: list[torch.Tensor]) -> torch.Tensor:
    """transformers' logits, one unpadded prompt at a time."""
    hf = ref.load_reference(path)
    return torch.cat([hf(input_ids=p[None]).logits[0].float() for p in prompts])


def _load(path: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    return load_model(path, ModelConfig.from_pretrained(path), dtype=dtype, device="cpu")


def _assert_parity(path: Path, seed: int, fused: bool = False) -> None:
    model = _load(path)
    if fused:
        model.use_fused_cpu_ops()
    prompts = _prompts(model.config.vocab_size, seed)
    ours, theirs = _tandem_logits(model, prompts), _reference_logits(path, prompts)
    assert ours.dtype == torch.float32
    assert ours.shape == theirs.shape == (sum(PROMPT_LENS), ref.VOCAB)
    assert theirs.std() > 0.5, "logits too flat for the comparison to mean much"
    assert (ours - theirs).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("kv_ratio", [1, 2, 4])
@pytest.mark.parametrize("family", ref.FAMILIES)
def test_logits_match_transformers(tmp_path: Path, family: str, kv_ratio: int) -> None:
    seed = 1000 + 10 * ref.FAMILIES.index(family) + kv_ratio
    path = ref.make_family(family, tmp_path, seed=seed, kv_ratio=kv_ratio)
    _assert_parity(path, seed)


@pytest.mark.parametrize("family", ref.FAMILIES)
def test_logits_match_transformers_with_the_fused_cpu_ops(tmp_path: Path, family: str) -> None:
    """The model's RMSNorm (q/k norms included), SiLU-and-multiply and rotary embedding
    run by tandem's fused CPU ops (``kernels/cpu_fused.cpp``)."""
    assert load_cpu_kernels(cache_root() / "kernels")
    seed = 2000 + ref.FAMILIES.index(family)
    path = ref.make_family(family, tmp_path, seed=seed, kv_ratio=2)
    _assert_parity(path, seed, fused=True)


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_logits_match_transformers_with_tied_embeddings(tmp_path: Path, family: str) -> None:
    path = ref.make_family(family, tmp_path, seed=7, kv_ratio=2, tied=True)
    _assert_parity(path, seed=7)


def test_logits_match_transformers_with_llama_biases(tmp_path: Path) -> None:
    """Llama's ``attention_bias`` covers o_proj too, and ``mlp_bias`` the MLP."""
    path = ref.make_llama(tmp_path, seed=8, kv_ratio=2, bias=True)
    config = ModelConfig.from_pretrained(path)
    assert config.attention_bias
    assert config.attention_out_bias
    assert config.mlp_bias
    _assert_parity(path, seed=8)


def test_logits_match_transformers_with_the_feed_forward_in_row_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long CPU batch's feed-forward runs in row blocks (``cpu_path.MLP_BLOCK_BYTES``);
    blocks of 9 rows, the last one short, give the same logits."""
    path = ref.make_llama(tmp_path, seed=11, kv_ratio=2)
    model = _load(path)
    inner = model.config.intermediate_size
    monkeypatch.setattr(cpu_path, "MLP_BLOCK_BYTES", 9 * 2 * inner * 4)
    blocks: list[int] = []
    local = decoder.MLP._local

    def counted(
        self: decoder.MLP, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        blocks.append(x.shape[0])
        assert residual is None or residual.shape[0] == x.shape[0]
        return local(self, x, residual)

    monkeypatch.setattr(decoder.MLP, "_local", counted)
    prompts = _prompts(model.config.vocab_size, seed=11)
    ours, theirs = _tandem_logits(model, prompts), _reference_logits(path, prompts)
    tokens = sum(PROMPT_LENS)
    assert tokens % 9 != 0
    per_layer = blocks[: -(-tokens // 9)]
    assert per_layer == [9] * (tokens // 9) + [tokens % 9], per_layer
    assert len(blocks) == len(per_layer) * model.config.num_hidden_layers
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_sharded_checkpoint_loads_every_tensor(tmp_path: Path) -> None:
    path = ref.make_llama(tmp_path, seed=9, kv_ratio=2, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    ours = _load(path)
    theirs = ref.load_reference(path).state_dict()
    for name, param in ours.state_dict().items():
        assert torch.equal(param, theirs[name]), name


def test_tied_embeddings_share_storage(tmp_path: Path) -> None:
    path = ref.make_family("qwen2", tmp_path, seed=10, tied=True)
    model = _load(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    dummy = load_model(None, model.config, dtype=torch.float32, device="cpu", load_format="dummy")
    assert dummy.lm_head.weight.data_ptr() == dummy.model.embed_tokens.weight.data_ptr()


def _dummy(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    model = load_model(None, config, dtype=dtype, device="cpu", load_format="dummy", seed=seed)
    return dict(model.named_parameters())


def test_dummy_weights_are_reproducible_and_dtype_independent() -> None:
    config = ref.tiny_model_config()
    first, second = _dummy(config, torch.float32), _dummy(config, torch.float32)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[n], second[n]) for n in first)
    as_bf16 = _dummy(config, torch.bfloat16)
    assert all(torch.equal(first[n].to(torch.bfloat16), as_bf16[n]) for n in first)
    other_seed = _dummy(config, torch.float32, seed=1)
    assert not torch.equal(first["lm_head.weight"], other_seed["lm_head.weight"])
    # Each value comes from its own name, not from the order parameters were created in.
    name = "model.layers.1.mlp.up_proj.weight"
    alone = dummy_tensor(name, tuple(first[name].shape), 0, is_norm=False)
    assert torch.equal(alone, first[name])
    assert not torch.equal(first[name], first["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(first["model.layers.0.self_attn.q_norm.weight"], torch.ones(16))
    assert first["model.norm.weight"].eq(1).all()


def _rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Replace (tensor) or drop (None) tensors of a single-file checkpoint."""
    tensors = load_file(path / "model.safetensors")
    for name, value in edit.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_checkpoint_errors_name_every_bad_tensor(tmp_path: Path) -> None:
    path = ref.make_llama(tmp_path, seed=11, kv_ratio=2)
    _rewrite(
        path,
        {
            "model.layers.1.mlp.up_proj.weight": None,
            "lm_head.weight": None,
            "model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64),
            "model.layers.0.self_attn.extra.weight": torch.zeros(2),
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8),
        },
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM") as info:
        _load(path)
    message = str(info.value)
    assert "missing: lm_head.weight, model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight (expected [32, 64], got [3, 64])" in message
    assert "unexpected: model.layers.0.self_attn.extra.weight" in message
    assert "inv_freq" not in message


def test_inv_freq_buffers_are_ignored(tmp_path: Path) -> None:
    path = ref.make_llama(tmp_path, seed=12)
    _rewrite(path, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    _load(path)


def test_missing_checkpoint_files(tmp_path: Path) -> None:
    config = ref.tiny_model_config()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(tmp_path, config, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="model_path"):
        load_model(None, config, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="'pt'"):
        load_model(tmp_path, config, dtype=torch.float32, device="cpu", load_format="pt")


def test_unknown_architecture_is_named() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        ref.tiny_model_config(architectures=["GPT2LMHeadModel"])
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_named() -> None:
    config = ref.tiny_model_config(rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn'"):
        load_model(None, config, dtype=torch.float32, device="cpu", load_format="dummy")


def test_bf16_checkpoint_loads_in_bf16(tmp_path: Path) -> None:
    path = ref.make_llama(tmp_path / "bf16", seed=13, kv_ratio=2, dtype=torch.bfloat16)
    config = ModelConfig.from_pretrained(path)
    assert config.dtype == "bfloat16"
    dtype = resolve_dtype("auto", config)
    assert dtype == torch.bfloat16
    model = load_model(path, config, dtype=dtype, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    rope_table = model.model.rotary_emb.cos_sin_cache
    assert rope_table.dtype == torch.float32
    prompts = _prompts(config.vocab_size, 13)
    ours = _tandem_logits(model, prompts)
    assert ours.dtype == torch.float32
    # The same bf16 weights run in float32: bf16 activations may only add rounding noise.
    exact = _tandem_logits(_load(path, torch.float32), prompts)
    assert (ours - exact).abs().max().item() < 0.1 * exact.abs().max().item()


def test_resolve_dtype() -> None:
    config = ref.tiny_model_config()
    assert resolve_dtype("auto", config) == torch.float32
    assert resolve_dtype("auto", ref.tiny_model_config(torch_dtype="float16")) == torch.float16
    expected = {
        "float32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    assert {name: resolve_dtype(name, config) for name in expected} == expected
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtype("fp8", config)


def test_config_reads_old_and_new_forms() -> None:
    old = ref.tiny_model_config(
        architectures=["LlamaForCausalLM"],
        head_dim=None,
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        torch_dtype="bfloat16",
        eos_token_id=[5, 7],
    )  # fmt: skip
    new = ref.tiny_model_config(
        architectures=["LlamaForCausalLM"],
        head_dim=None,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
        dtype="bfloat16",
        eos_token_id=[5, 7],
    )  # fmt: skip
    assert old == new
    assert old.head_dim == 8
    assert old.rope_theta == 500000.0
    assert old.dtype == "bfloat16"
    assert old.rope_scaling is not None
    assert old.rope_scaling["rope_type"] == "llama3"
    assert old.eos_token_id == (5, 7)
    plain = ref.tiny_model_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert plain.rope_scaling is None
    assert plain.rope_theta == 1e6
    assert plain.qk_norm
    assert plain.head_dim == 16
    assert not plain.attention_bias
    qwen2 = ref.tiny_model_config(architectures=["Qwen2ForCausalLM"], eos_token_id=3)
    assert qwen2.attention_bias
    assert not qwen2.attention_out_bias
    assert not qwen2.qk_norm
    assert qwen2.eos_token_id == (3,)
    assert qwen2.max_position_embeddings == 64
    assert qwen2.num_key_value_heads == 2
    bare = ref.tiny_model_config(architectures=None, model_type="mistral", sliding_window=4096)
    assert bare.architecture == "MistralForCausalLM"
    assert bare.sliding_window == 4096
    assert hash(old) == hash(new)


def test_config_rejects_bad_head_counts() -> None:
    with pytest.raises(ValueError, match="multiple"):
        ref.tiny_model_config(num_key_value_heads=3)


def test_config_from_pretrained_matches_saved_files(tmp_path: Path) -> None:
    path = ref.make_family("qwen3", tmp_path, seed=14, kv_ratio=4, tied=True)
    config = ModelConfig.from_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    assert config.architecture == saved["architectures"][0] == "Qwen3ForCausalLM"
    assert (config.head_dim, config.num_key_value_heads) == (32, 1)
    assert config.tie_word_embeddings
    assert config.qk_norm
    assert config.rope_theta == 1000000.0
    assert config.rms_norm_eps == 1e-5
    assert config.eos_token_id == (2,)
    assert config.bos_token_id == 1

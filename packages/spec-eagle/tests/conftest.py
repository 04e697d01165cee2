"""Fixtures: a small unseen Llama target (random weights, saved by transformers) and
random draft heads in the public formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.spec_eagle import write_random_head


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.5 if "embed" in name else 0.15)
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def heads(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "eagle3": write_random_head(target, root / "eagle3", algorithm="EAGLE3", seed=1),
        "eagle3_small_vocab": write_random_head(
            target, root / "eagle3_sv", algorithm="EAGLE3", draft_vocab_size=64, seed=2
        ),
        "eagle3_2layers": write_random_head(
            target, root / "eagle3_2l", algorithm="EAGLE3", num_layers=2, seed=3
        ),
        "eagle": write_random_head(target, root / "eagle", algorithm="EAGLE", seed=4),
    }

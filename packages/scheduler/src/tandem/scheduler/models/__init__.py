"""Llama-family models (Llama 2/3, Qwen2, Qwen3, Mistral): config, layers, weights.

GGUF files get their folder from ``gguf_file.gguf_folder``, imported from there: it
brings the gguf library, which this package does not import until a GGUF is loaded."""

from __future__ import annotations

from tandem.scheduler.models.decoder import CausalLM
from tandem.scheduler.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from tandem.scheduler.models.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding, apply_rotary
from tandem.scheduler.models.weights import (
    LOAD_FORMATS,
    is_gguf_folder,
    load_model,
    resolve_dtype,
)

__all__ = [
    "LOAD_FORMATS",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "CausalLM",
    "ModelConfig",
    "RotaryEmbedding",
    "apply_rotary",
    "is_gguf_folder",
    "load_model",
    "resolve_dtype",
]

"""A draft head's configuration, read from its ``config.json`` in the public formats.

Two architectures (``ARCHITECTURES``): ``LlamaForCausalLMEagle`` (EAGLE-1/2), whose
``fc`` reads ``[token embedding; target final hidden]`` and whose output goes to the
target's ``lm_head``, and ``LlamaForCausalLMEagle3`` (EAGLE-3), whose ``fc`` folds
three captured target hidden states and whose own ``lm_head`` covers a draft
vocabulary mapped to the target's through ``d2t``. ``DraftConfig`` holds what building
either needs; docs/guides/speculative-decoding.md, "Draft heads", has the layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.scheduler.models import ModelConfig

ARCHITECTURES = {
    "LlamaForCausalLMEagle": "EAGLE",
    "LlamaForCausalLMEagle3": "EAGLE3",
}


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The public default EAGLE-3 capture points: the outputs of layers 1,
    ``n // 2 - 1`` and ``n - 4`` (clamped into the model for very shallow targets)."""
    top = num_target_layers - 1

    def clamp(i: int) -> int:
        return max(0, min(top, i))

    return clamp(1), clamp(num_target_layers // 2 - 1), clamp(num_target_layers - 4)


@dataclass(frozen=True)
class DraftConfig:
    """What building a draft head needs.

    Attributes:
        algorithm: ``EAGLE`` or ``EAGLE3``.
        aux_layers: EAGLE-3 only: target layers whose outputs are captured, in order.
        draft_vocab_size: rows of the head's ``lm_head`` (the target vocabulary for
            EAGLE, which uses the target's head).
        fc_bias: whether ``fc`` has a bias (some EAGLE-1 heads do); the loader sets
            it from the checkpoint's tensors.
    """

    algorithm: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    attention_bias: bool
    fc_bias: bool = False

    @classmethod
    def from_dict(
        cls,
        d: Mapping[str, Any],
        target: ModelConfig,
        *,
        algorithm: str | None = None,
    ) -> DraftConfig:
        """Parse ``config.json``; ``algorithm`` (the engine option) must agree with the
        checkpoint's architecture. Shapes the target dictates are checked against it."""
        archs = d.get("architectures") or []
        found = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not found:
            raise ValueError(
                f"draft architecture {archs!r} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        kind = found[0]
        if algorithm is not None and algorithm.upper() != kind:
            raise ValueError(
                f"speculative_algorithm={algorithm!r} but the draft checkpoint is {kind} "
                f"({archs[0]})"
            )
        hidden = int(d.get("hidden_size", target.hidden_size))
        if hidden != target.hidden_size:
            raise ValueError(
                f"draft hidden_size {hidden} differs from the target's {target.hidden_size}"
            )
        heads = int(d.get("num_attention_heads", target.num_attention_heads))
        layers = int(d.get("num_hidden_layers", 1))
        if layers < 1:
            raise ValueError(f"draft num_hidden_layers must be >= 1, got {layers}")
        vocab = int(d.get("vocab_size", target.vocab_size))
        if vocab != target.vocab_size:
            raise ValueError(
                f"draft vocab_size {vocab} differs from the target's {target.vocab_size}"
            )
        draft_vocab = int(d.get("draft_vocab_size") or vocab)
        aux: tuple[int, ...] = ()
        if kind == "EAGLE3":
            aux = _aux_layers(d, target.num_hidden_layers)
        scaling = d.get("rope_scaling")
        return cls(
            algorithm=kind,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d.get("intermediate_size", target.intermediate_size)),
            num_hidden_layers=layers,
            rms_norm_eps=float(d.get("rms_norm_eps", target.rms_norm_eps)),
            rope_theta=float(d.get("rope_theta", target.rope_theta)),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(
                d.get("max_position_embeddings", target.max_position_embeddings)
            ),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            aux_layers=aux,
            attention_bias=bool(d.get("attention_bias", False)),
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, target: ModelConfig, *, algorithm: str | None = None
    ) -> DraftConfig:
        folder = Path(path)
        config = folder / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"speculative_draft_model_path {folder} has no config.json")
        return cls.from_dict(
            json.loads(config.read_text(encoding="utf-8")), target, algorithm=algorithm
        )


def _aux_layers(d: Mapping[str, Any], num_target_layers: int) -> tuple[int, ...]:
    eagle = d.get("eagle_config") or {}
    ids: Sequence[int] | None = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layers(num_target_layers)
    out = tuple(int(i) for i in ids)
    if len(out) != 3:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids needs 3 layers, got {list(out)}")
    bad = [i for i in out if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(out)} names layers outside the target's "
            f"0..{num_target_layers - 1}"
        )
    return out

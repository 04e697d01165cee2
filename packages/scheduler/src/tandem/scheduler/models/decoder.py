"""The Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral) over packed tokens.

One module tree serves all four families; ``ModelConfig`` switches the few places they
differ (q/k/v bias, per-head q/k norm, head_dim, tied embeddings). Tokens arrive packed,
``[T]`` for the whole batch, never padded: attention is the only place that needs to know
where one request ends, and it learns that from the backend's plan, not from the model.
Module and parameter names are those of the Hugging Face checkpoints, so loading weights
is a copy by name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tandem.scheduler.attention import triton_available
from tandem.scheduler.attention.base import AttentionBackend
from tandem.scheduler.attention.casting import as_dtype
from tandem.scheduler.kernels import cpu_build
from tandem.scheduler.models import cpu_path
from tandem.scheduler.models.model_config import ModelConfig
from tandem.scheduler.models.packing import (
    ONEDNN_MIN_HIDDEN,
    PackedLinear,
    make_column_major,
    onednn_available,
    pack_linears,
    with_onednn,
    with_panels,
)
from tandem.scheduler.models.quant_panels import QuantPanels
from tandem.scheduler.models.quantized import QuantizedEmbedding, QuantizedLinear, pack_quantized
from tandem.scheduler.models.rope import RotaryEmbedding, apply_rotary
from tandem.scheduler.models.tensor_parallel import (
    SINGLE,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)

_HAS_TRITON = triton_available()  # importing the model never imports Triton

log = logging.getLogger(__name__)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False
) -> torch.Tensor:
    """``apply_rotary``; on CUDA/ROCm with Triton installed, the same formula in one
    kernel launch (``kernels.triton_rope``); with ``fused`` on the CPU, in one pass
    (``torch.ops.tandem.rotary``)."""
    if fused and cpu_path.fused_fits(x):
        return cpu_path.rotary(x, cos, sin)
    if x.is_cuda and _HAS_TRITON:
        from tandem.scheduler.kernels.triton_rope import rotary

        return rotary(x, cos, sin)
    return apply_rotary(x, cos, sin)


class RMSNorm(nn.Module):
    """Root-mean-square norm. Statistics in float32 (bf16 sums of squares lose the small
    activations), the result cast back before the weight, as the checkpoints were trained."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False  # torch.ops.tandem.rms_norm (set by CausalLM.use_fused_cpu_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return cpu_path.rms_norm(x, self.weight, self.eps, self.fused)
        # Accelerators' fused kernel takes the statistics in float32 and rounds once to
        # x's dtype: the formula in one launch instead of four, which a batch-1 decode
        # step (launch-bound) feels in every layer.
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)


class Attention(nn.Module):
    """Self-attention: project, optionally norm q/k per head, rotate, then hand the heads
    to the attention backend, which owns the KV cache and the causal mask. Under tensor
    parallelism ``config`` counts this rank's heads, and the output projection's
    partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=config.attention_out_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qkv: PackedLinear | None = None  # set by ``pack``
        self.o: PackedLinear | None = None
        self.fused = False  # rotate with torch.ops.tandem.rotary (use_fused_cpu_ops)

    def pack(self, column_major: bool, onednn: bool, forward_threads: int) -> None:
        """Fuse q/k/v into one projection (see ``models.packing``; quantized weights:
        ``models.quantized``)."""
        self.qkv = pack_quantized((self.q_proj, self.k_proj, self.v_proj))
        self.o = pack_quantized((self.o_proj,))
        if self.qkv is not None and self.o is not None:
            return
        self.qkv = pack_linears((self.q_proj, self.k_proj, self.v_proj), column_major)
        self.o = pack_linears((self.o_proj,), column_major)
        if onednn:
            self.qkv = with_onednn(self.qkv, forward_threads)
            self.o = with_onednn(self.o, forward_threads)

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.qkv is not None:
            return self.qkv(hidden)
        return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention's output for the normed ``hidden``, plus ``residual`` if given
        (folded into the output projection where it can be: one rank, packed)."""
        t = hidden.shape[0]
        q, k, v = self._project(hidden)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin, self.fused), _rotate(k, cos, sin, self.fused)
        out = attn.forward(self.layer_id, q, k, v, scale=self.scale)
        if residual is not None and self.o is not None and self.tp.size == 1:
            return self.o.plus(out, residual)
        out = self.o(out)[0] if self.o is not None else self.o_proj(out)
        out = self.tp.all_reduce(out)
        return out if residual is None else residual + out


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; under tensor parallelism
    over this rank's intermediate units, ``down``'s partial sums all-reduced."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up: PackedLinear | None = None  # set by ``pack``
        self.down: PackedLinear | None = None
        self.fused = False  # torch.ops.tandem.silu_mul (set by CausalLM.use_fused_cpu_ops)

    def pack(self, column_major: bool, onednn: bool, forward_threads: int) -> None:
        """Fuse gate and up into one projection (see ``models.packing``; quantized
        weights: ``models.quantized``)."""
        self.gate_up = pack_quantized((self.gate_proj, self.up_proj))
        self.down = pack_quantized((self.down_proj,))
        if self.gate_up is not None and self.down is not None:
            return
        self.gate_up = pack_linears((self.gate_proj, self.up_proj), column_major)
        self.down = pack_linears((self.down_proj,), column_major)
        if onednn:
            self.gate_up = with_onednn(self.gate_up, forward_threads)
            self.down = with_onednn(self.down, forward_threads)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The feed-forward of ``x``, plus ``residual`` if given (folded into the down
        projection where it can be: one rank, packed)."""
        cpu = x.device.type == "cpu"
        rows = cpu_path.mlp_block_rows(x, self.gate_proj.out_features) if cpu else x.shape[0]
        fold = residual is not None and self.down is not None and self.tp.size == 1
        if x.shape[0] > rows:
            blocks = x.split(rows)
            adds = residual.split(rows) if fold and residual is not None else [None] * len(blocks)
            out = torch.cat([self._local(b, r) for b, r in zip(blocks, adds, strict=True)])
        else:
            out = self._local(x, residual if fold else None)
        if fold:
            return out
        out = self.tp.all_reduce(out)
        return out if residual is None else residual + out

    def _local(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial sums for the tokens ``x`` (plus ``residual``, given only
        when ``down`` is packed and this is the only rank)."""
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fused and cpu_path.fused_fits(gate, up):
            inner = cpu_path.silu_mul(gate, up)
        else:
            inner = F.silu(gate).mul_(up)
        if self.down is None:
            return self.down_proj(inner)
        return self.down(inner)[0] if residual is None else self.down.plus(inner, residual)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin, attn, residual=hidden)
        out: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden), residual=hidden)
        return out


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm: the checkpoints' ``model.`` prefix."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # Built on the meta device and filled by the loader: passing the (empty) weight
        # skips the random init, whose meta-device path imports torch._dynamo (slow).
        self.embed_tokens: nn.Embedding
        if tp.size > 1:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        else:
            self.embed_tokens = nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Shared by every layer: one gather of the cos/sin table per forward, not per layer.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-norm hidden states, and the residual stream after each layer in
        ``capture`` (EAGLE-3 drafts read those), in the order given."""
        cos, sin = self.rotary_emb(positions)
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        outputs: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, attn)
            if i in capture:
                outputs[i] = hidden
        out: torch.Tensor = self.norm(hidden)
        return out, [outputs[i] for i in capture]


def _panels(packed: PackedLinear | None) -> PackedLinear | None:
    return None if packed is None else with_panels(packed)


class CausalLM(nn.Module):
    """A Llama-family causal LM over packed tokens.

    ``forward`` stops at the final norm so the caller picks which rows need logits
    (usually one per request) before paying for the vocabulary projection.

    ``tp``: this rank's place under tensor parallelism (``models.tensor_parallel``);
    ``config`` is then the rank's share (``TensorParallel.local_config``).
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, tp)
        self.lm_head: nn.Linear
        if tp.size > 1:
            self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tp)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head: PackedLinear | None = None  # the CPU's blocked head, set by ``pack``
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding's storage when the config ties them.

        Called again after materializing a meta-built model, since replacing parameters
        one module at a time (``to_empty``) can leave the two names pointing apart.
        """
        if self.config.tie_word_embeddings and not isinstance(self.lm_head, QuantizedLinear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_fused_cpu_ops(self) -> None:
        """Run every layer's RMSNorm, SiLU-and-multiply and rotary embedding (and the
        final norm) with tandem's fused CPU ops, ``torch.ops.tandem.rms_norm``,
        ``silu_mul`` and ``rotary`` (``kernels/cpu_fused.cpp``, registered by the
        caller: see ``kernels.cpu_build``). The same arithmetic in one pass each;
        inputs the ops do not take keep the torch formulas. Float32 products with a
        oneDNN copy trade it for panels and tandem's own product, ``linear_panels``
        (``packing.with_panels``; call after ``pack``)."""
        for module in self.model.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.fused = True
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv, attn.o = _panels(attn.qkv), _panels(attn.o)
            mlp.gate_up, mlp.down = _panels(mlp.gate_up), _panels(mlp.down)
        self.head = _panels(self.head)

    def pack(
        self,
        column_major: bool | None = None,
        onednn: bool | None = None,
        forward_threads: int | None = None,
    ) -> None:
        """Lay the weights out for inference: fused q/k/v and gate/up projections,
        column-major weights (default: on the CPU) and oneDNN copies (default: on the
        CPU, for a hidden size of at least ``ONEDNN_MIN_HIDDEN``, where oneDNN takes the
        dtype; the products are then ``blocked``, for panels). ``forward_threads``:
        the intra-op threads the forward will run on (default: the calling thread's),
        which pick the product for one float32 token (``packing.dense_up_to``). Call
        after loading and placing the model (see ``models.packing``); the forward is
        the same function of the weights either way."""
        weight = self.model.norm.weight  # the model's device and dtype (a head may be quantized)
        cpu = weight.device.type == "cpu"
        threads = forward_threads or torch.get_num_threads()
        if column_major is None:
            column_major = cpu
        if onednn is None:
            onednn = column_major and self.config.hidden_size >= ONEDNN_MIN_HIDDEN
        dtype = weight.dtype
        # Without oneDNN, tandem's product multiplies bfloat16 on AVX2 (with the fused ops).
        panels = dtype == torch.bfloat16 and cpu_build.bf16_panels()
        low = dtype in (torch.bfloat16, torch.float16)
        if cpu and low and not onednn_available(dtype) and not panels:
            log.warning(
                "oneDNN cannot multiply %s on this CPU (bfloat16 needs AVX-512 BW/VL/DQ, "
                "float16 AVX-512 FP16, or either AVX-NE-CONVERT): the model's products take "
                "torch's fallback, up to hundreds of times slower than in float32 here; serve "
                "it with --dtype float32",
                str(dtype).removeprefix("torch."),
            )
        onednn = onednn and cpu
        for layer in self.model.layers:
            layer.self_attn.pack(column_major, onednn, threads)
            layer.mlp.pack(column_major, onednn, threads)
        if isinstance(self.lm_head, QuantizedLinear):
            rows = self.lm_head.out_features
            stand_in = torch.empty(0, self.lm_head.in_features)
            self.head = PackedLinear(stand_in, None, (rows,), quant=(self.lm_head.panels_once(),))
            return
        if column_major and not self.config.tie_word_embeddings:
            make_column_major(self.lm_head)  # a tied head keeps the embedding's rows
        if onednn:
            # Not a view of the parameter: the head is also the embedding when tied,
            # and EAGLE's draft multiplies by ``lm_head`` itself.
            rows = self.lm_head.weight.shape[0]
            self.head = with_onednn(PackedLinear(self.lm_head.weight, None, (rows,)), threads)

    def packed_weights(self) -> tuple[torch.Tensor, ...]:
        """Every weight copy the forward to the final norm reads: oneDNN's layout,
        panels or quantized panels (with a quantized embedding's), empty unless packed
        so."""
        packed = self._layer_products()
        copies = [w for p in packed for w in (p.onednn, p.panels)]
        quant = [q for p in packed for q in p.quant]
        embedding = self.model.embed_tokens
        if isinstance(embedding, QuantizedEmbedding):
            quant.append(embedding.head.panels_once())
        copies += [t for q in quant for t in q.tensors]
        return tuple(w for w in copies if w is not None)

    def quant_products(self) -> list[QuantPanels]:
        """The quantized panels a step multiplies by, in the order it calls them: each
        layer's q/k/v, o, gate/up and down, then the head (empty unless packed so)."""
        heads = [self.head] if self.head is not None else []
        return [q for p in [*self._layer_products(), *heads] for q in p.quant]

    def _layer_products(self) -> list[PackedLinear]:
        """The layers' packed products in the order a step calls them (none unpacked)."""
        packed = []
        for layer in self.model.layers:
            packed += [layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down]
        return [p for p in packed if p is not None]

    def weights_bytes(self) -> int:
        """Bytes of the weights held: parameters, the layers' copies (oneDNN's layout,
        panels, quantized panels) and the head's, each storage counted once."""
        tensors = [*self.parameters(), *self.packed_weights()]
        if self.head is not None:
            tensors += [self.head.onednn, self.head.panels]
            tensors += [t for q in self.head.quant for t in q.tensors]
        held: dict[int, int] = {}
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            if t.is_mkldnn:  # oneDNN's layout has no storage to share: counted by its size
                held[id(t)] = t.numel() * t.element_size()
            else:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(held.values())

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """``[T]`` token ids and positions -> ``[T, hidden]`` final-norm hidden states.

        ``attn`` must already be planned for this batch (the runner does that once).
        """
        hidden, _ = self.model(input_ids, positions, attn)
        return hidden

    def forward_capture(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        capture: Sequence[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` that also returns the residual stream after each layer in
        ``capture`` (before the final norm), for drafts that read several layers."""
        hidden, captured = self.model(input_ids, positions, attn, capture)
        return hidden, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 logits (sampling wants float32)."""
        if self.head is None:
            logits = self.lm_head(hidden)  # a ``VocabParallelHead`` gathers its blocks
        elif isinstance(self.lm_head, VocabParallelHead):
            logits = self.lm_head.gather(self.head(hidden)[0])
        else:
            logits = self.head(hidden)[0]
        return as_dtype(logits, torch.float32)

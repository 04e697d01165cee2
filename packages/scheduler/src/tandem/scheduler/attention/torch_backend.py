"""The ``torch`` attention backend: SDPA over gathered pages, any device, exact in fp32.

``TorchAttention`` makes one batched SDPA call per layer for the whole batch: queries
padded to ``[B, max_new_tokens]``, keys gathered to ``[B, max_seq_len]`` through the
request-to-token table, a boolean mask for causality and padding, all planned once per
batch. CPU decode adds a grouped layout (``attention.cpu_decode``) and the decode stage
(``attention.decode_stage``); a step that continues its stage reads tensors only
(``StagedDecode``), which lets ``decode_trace`` replay it.
See docs/guides/adding-an-attention-backend.md, "The two backends".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.scheduler.attention.base import (
    AttentionBackend,
    KVCacheView,
    masked_shape,
    native_store,
    write_kv,
    write_kv_buffers,
)
from tandem.scheduler.attention.casting import as_dtype
from tandem.scheduler.attention.cpu_decode import grouped_decode, whole_stage
from tandem.scheduler.attention.decode_stage import (
    DecodeStage,
    append_to_stage,
    capacity_for,
    stage_fits,
)
from tandem.scheduler.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _Plan:
    out_cache_loc: torch.Tensor  # [T]
    # [B, L] slot of each key position; None when a decode stage holds the keys already.
    kv_slots: torch.Tensor | None
    # [T] index of each new token in the padded [B * Q] layout; None when every request
    # brings exactly Q tokens (decode, verify), so the packed layout is the padded one.
    query_slot: torch.Tensor | None
    # [B, 1, Q, L] True where a query may attend a key; on the CPU an additive float
    # mask instead (0 or -inf), in the KV cache's dtype.
    mask: torch.Tensor
    batch: int
    max_query: int
    grouped_decode: bool = False  # attend with ``grouped_decode``


@dataclass(frozen=True)
class StagedDecode:
    """A CPU decode step that continues its decode stage, as tensors only.

    This is everything such a step's attention reads, in every layer: the paged cache
    (written at ``out_cache_loc``), the stage (appended at ``append``) and the additive
    mask. Having no Python state is the point: ``decode_trace`` passes these tensors to
    a traced forward, so the eager step and the replayed one run ``attend``, the same
    code, on the same data. The keys' length is the mask's last size, so a trace follows
    it from step to step.
    """

    out_cache_loc: torch.Tensor  # [B] KV slot of each request's new token
    append: torch.Tensor  # [B * Hkv] flat stage index of each new key (DecodeStage.append)
    bias: torch.Tensor  # [B, 1, 1, L] additive mask, 0 or -inf
    k_cache: tuple[torch.Tensor, ...]  # per layer, [slots, Hkv, D]
    v_cache: tuple[torch.Tensor, ...]
    k_stage: tuple[torch.Tensor, ...]  # per layer, [B, Hkv, capacity, D]
    v_stage: tuple[torch.Tensor, ...]
    kernel: bool = False  # attend with torch.ops.tandem.decode_attention

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor, flat, in the order ``from_tensors`` reads them."""
        return (
            self.out_cache_loc, self.append, self.bias,
            *self.k_cache, *self.v_cache, *self.k_stage, *self.v_stage,
        )  # fmt: skip

    @staticmethod
    def count(num_layers: int) -> int:
        """How many tensors ``tensors`` gives for a ``num_layers``-layer model."""
        return 3 + 4 * num_layers

    @classmethod
    def from_tensors(
        cls, tensors: tuple[torch.Tensor, ...], num_layers: int, kernel: bool
    ) -> StagedDecode:
        """The inverse of ``tensors``, for a step attended with the decode kernel or
        not (``kernel``)."""
        loc, append, bias, *layers = tensors
        if len(tensors) != cls.count(num_layers):
            raise ValueError(f"{len(tensors)} tensors are not a {num_layers}-layer StagedDecode")
        per = [tuple(layers[i * num_layers : (i + 1) * num_layers]) for i in range(4)]
        return cls(loc, append, bias, *per, kernel=kernel)

    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``AttentionBackend.forward`` of this step: write the new K/V to the paged
        cache and the stage, attend over the stage's first L keys."""
        k_cache, v_cache = self.k_cache[layer_id], self.v_cache[layer_id]
        keys, values = self.k_stage[layer_id], self.v_stage[layer_id]
        if native_store(k_cache, k, self.out_cache_loc) and keys.dtype == k.dtype:
            torch.ops.tandem.store_kv(
                k, v, k_cache, v_cache, self.out_cache_loc, keys, values, self.append
            )
        else:
            write_kv_buffers(k_cache, v_cache, self.out_cache_loc, k, v)
            append_to_stage(keys, self.append, k)
            append_to_stage(values, self.append, v)
        length = self.bias.shape[-1]  # the stage's capacity when whole_stage
        keys, values = keys[:, :, :length], values[:, :, :length]
        keys, values = as_dtype(keys, q.dtype), as_dtype(values, q.dtype)
        bias = as_dtype(self.bias, q.dtype)
        return grouped_decode(q, keys, values, bias, scale, self.kernel)


class TorchAttention(AttentionBackend):
    """SDPA over the paged KV cache. ``plan`` builds the index tensors and the mask
    once per batch; every layer's ``forward`` reuses them."""

    def __init__(
        self,
        kv_cache: KVCacheView,
        req_to_token: torch.Tensor,
        decode_stage: bool = True,
        check_stage: bool = False,
        decode_kernel: bool = False,
    ) -> None:
        """``decode_stage``: keep a CPU decode batch's K/V across steps (see
        ``attention.decode_stage``); off, every step gathers them. ``check_stage``
        (a debug invariant): every step that continues the stage first checks that the
        stage still equals the paged cache (``DecodeStage.check``). ``decode_kernel``:
        CPU decode steps attend with ``torch.ops.tandem.decode_attention``
        (``kernels.cpu_build``, registered by the caller) instead of SDPA (float32)
        or two matrix products (bfloat16)."""
        self.kv_cache = kv_cache
        self.req_to_token = req_to_token
        self.decode_stage = decode_stage
        self.check_stage = check_stage
        self.decode_kernel = decode_kernel
        self._plan: _Plan | None = None
        self._stage: DecodeStage | None = None
        self._staged: StagedDecode | None = None  # planned step continues the stage

    def _kv_slots(self, batch: ForwardBatch, max_seq: int) -> torch.Tensor:
        """Slot table rows of this batch, cut to the longest sequence: a device gather,
        so it sees the req_to_token writes queued before it on the forward stream."""
        table = self.req_to_token[:, :max_seq]
        return table.index_select(0, batch.rows).long()

    def plan(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        max_query = max(batch.extend_lens_cpu, default=0)
        max_seq = max(batch.seq_lens_cpu, default=0)
        b = batch.batch_size
        stage, self._stage = self._stage, None  # only a CPU decode step keeps it
        self._staged = None
        if max_query == 1 and min(batch.extend_lens_cpu, default=1) == 1:
            # Decode: one query per request, at the end of its sequence
            # (seq_lens = prefix_lens + 1), so the causal mask is just k < seq_len.
            k_pos = torch.arange(max_seq, device=device)
            seq_lens = batch.seq_lens.view(b, 1)
            if device.type == "cpu":
                self._stage = self._next_stage(stage, batch, max_seq)
                dtype = self.kv_cache.k_buffer(0).dtype
                if self._stage is not None and whole_stage(dtype, self.decode_kernel):
                    # Attend over the whole stage, its keys past each request masked.
                    k_pos = torch.arange(self._stage.capacity, device=device)
                bias = _additive_mask(k_pos >= seq_lens, dtype).view(b, 1, 1, -1)
                if self._stage is not None and self._stage.append is not None:
                    self._staged = self._staged_decode(self._stage, batch, bias)
                kv_slots = None if self._staged is not None else self._kv_slots(batch, max_seq)
                self._plan = _Plan(batch.out_cache_loc, kv_slots, None, bias, b, 1, True)
                return
            mask = (k_pos < seq_lens).view(b, 1, 1, max_seq)
            kv_slots = self._kv_slots(batch, max_seq)
            self._plan = _Plan(batch.out_cache_loc, kv_slots, None, mask, b, 1)
            return
        kv_slots = self._kv_slots(batch, max_seq)
        offsets = None
        if any(n != max_query for n in batch.extend_lens_cpu):
            offsets = torch.tensor(
                [i * max_query + j for i, n in enumerate(batch.extend_lens_cpu) for j in range(n)],
                dtype=torch.int64,
            ).to(device, non_blocking=True)
        q_pos = torch.arange(max_query, device=device).view(1, max_query, 1)
        k_pos = torch.arange(max_seq, device=device).view(1, 1, max_seq)
        prefix = batch.prefix_lens.view(b, 1, 1)
        seq = batch.seq_lens.view(b, 1, 1)
        extend = batch.extend_lens.view(b, 1, 1)
        causal = (k_pos < seq) & (k_pos <= prefix + q_pos)
        # Padded query rows attend key 0 only, so SDPA never sees an all-masked row
        # (which would produce NaN); their outputs are dropped.
        padded_query = q_pos >= extend
        mask = torch.where(padded_query, k_pos == 0, causal).unsqueeze(1)
        if device.type == "cpu":
            # The same mask as additive floats: SDPA's CPU kernel gives equal results
            # (it converts a boolean mask to these), faster in bfloat16, the same in
            # float32 (measurements: docs/benchmarks.md, Measurements behind the code).
            mask = _additive_mask(~mask, self.kv_cache.k_buffer(0).dtype)
        self._plan = _Plan(batch.out_cache_loc, kv_slots, offsets, mask, b, max_query)

    def plan_masked(
        self, kv_slots: torch.Tensor, mask: torch.Tensor, out_cache_loc: torch.Tensor
    ) -> None:
        b, q, _ = masked_shape(kv_slots, mask, out_cache_loc)
        self._stage, self._staged = None, None
        if mask.device.type == "cpu":
            # As in ``plan``: additive floats, made once for every layer.
            mask = _additive_mask(~mask, self.kv_cache.k_buffer(0).dtype)
        # Exactly Q tokens per request: the packed layout is the padded one.
        self._plan = _Plan(out_cache_loc, kv_slots, None, mask.unsqueeze(1), b, q)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self._staged is not None:
            return self._staged.attend(layer_id, q, k, v, scale)
        plan = self._plan
        if plan is None:
            raise RuntimeError("TorchAttention.forward called before plan()")
        k_buf, v_buf = write_kv(self.kv_cache, layer_id, plan.out_cache_loc, k, v)
        _, num_heads, head_dim = q.shape
        assert plan.kv_slots is not None, "only a continued stage gathers nothing"
        gathered = _gather(k_buf, plan.kv_slots), _gather(v_buf, plan.kv_slots)
        if self._stage is not None:
            length = plan.mask.shape[-1]
            keys, values = (x[:, :, :length] for x in self._stage.start(layer_id, gathered))
        else:
            keys, values = (x.transpose(1, 2) for x in gathered)  # [B, Hkv, L, D]
        keys, values = as_dtype(keys, q.dtype), as_dtype(values, q.dtype)
        if plan.grouped_decode:
            mask = as_dtype(plan.mask, q.dtype)
            return grouped_decode(q, keys, values, mask, scale, self.decode_kernel)
        padded = q
        if plan.query_slot is not None:
            padded = q.new_zeros((plan.batch * plan.max_query, num_heads, head_dim))
            padded.index_copy_(0, plan.query_slot, q)
        queries = padded.view(plan.batch, plan.max_query, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=plan.mask if plan.mask.dtype == torch.bool else as_dtype(plan.mask, q.dtype),
            scale=scale,
            enable_gqa=keys.shape[1] != num_heads,
        )
        out = out.transpose(1, 2).reshape(plan.batch * plan.max_query, num_heads * head_dim)
        return out if plan.query_slot is None else out.index_select(0, plan.query_slot)

    def staged_decode(self) -> StagedDecode | None:
        """The planned step as tensors when it is a CPU decode step that continues its
        decode stage (most steps of a steady decode batch), else None."""
        return self._staged

    def _staged_decode(
        self, stage: DecodeStage, batch: ForwardBatch, bias: torch.Tensor
    ) -> StagedDecode:
        """The step continuing ``stage`` as tensors."""
        assert stage.append is not None
        k_stage, v_stage = stage.layers()
        layers = range(len(k_stage))
        cache = self.kv_cache
        return StagedDecode(
            batch.out_cache_loc, stage.append, bias,
            tuple(cache.k_buffer(i) for i in layers),
            tuple(cache.v_buffer(i) for i in layers),
            k_stage, v_stage, self.decode_kernel,
        )  # fmt: skip

    def _next_stage(
        self, stage: DecodeStage | None, batch: ForwardBatch, max_seq: int
    ) -> DecodeStage | None:
        """The decode stage of this CPU decode step: ``stage`` advanced when the step
        continues it, a new one when the batch is small enough, else None."""
        rows, seq_lens = batch.rows_cpu, batch.seq_lens_cpu
        if not self.decode_stage or rows is None:
            return None
        num_kv_heads = self.kv_cache.k_buffer(0).shape[1]
        device = batch.input_ids.device
        # Only a decode step continues a stage: its requests were all in the step
        # before it (see ``attention.decode_stage``). A prefill of one token is planned
        # like a decode step but may be a new request on a row the stage knows.
        if (
            stage is not None
            and batch.mode is ForwardMode.DECODE
            and stage.continues(rows, seq_lens)
        ):
            stage.advance(list(rows), seq_lens, num_kv_heads, device)
            if self.check_stage:
                stage.check(self.kv_cache, self.req_to_token)
            return stage
        dtype = self.kv_cache.k_buffer(0).dtype
        capacity = capacity_for(max_seq, whole_stage(dtype, self.decode_kernel))
        if not stage_fits(len(rows), capacity, self.kv_cache.layout):
            return None
        return DecodeStage(list(rows), list(seq_lens), capacity)


def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buffer[slots]`` for a ``[B, L]`` slot table, as one ``index_select`` over the
    flattened table: on the CPU that is several times faster than advanced indexing,
    which is the largest cost of a small model's decode step."""
    b, length = slots.shape
    return buffer.index_select(0, slots.reshape(-1)).view(b, length, *buffer.shape[1:])


def _additive_mask(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's additive float mask, -inf where ``masked`` is True and 0 elsewhere. SDPA
    converts a boolean mask this way on every call; built once in ``plan``, every
    layer reuses it (in the KV cache's dtype, which is the model's, so the per-layer
    cast to the queries' dtype is a no-op). No NaN: every decode query attends at
    least its own key."""
    bias = torch.zeros(masked.shape, dtype=dtype, device=masked.device)
    return bias.masked_fill_(masked, float("-inf"))

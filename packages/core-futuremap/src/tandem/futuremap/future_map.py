"""The FutureMap: per-row device buffers that carry one forward's outputs to the next.

Indexed by row (a request's ``req_pool_idx``), ``num_rows + 1`` entries, row 0 the
padding row. There is no ring buffer and no slot allocator: a row's future lives
exactly as long as its request. Every method here is device work: call it on the
forward stream (inside ``Stream.submit`` on the CPU host stream), never to read values
on the host. Correctness rests on stream order alone: a batch's resolve is enqueued
after the previous batch's stash, so it reads that batch's values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import torch

from tandem.futuremap.checks import CheckKernels
from tandem.futuremap.env import CompileChecks, read_env
from tandem.futuremap.runtime import Event, create_event, current_stream
from tandem.futuremap.schema import RelayField

Rows = torch.Tensor | Sequence[int]


class FutureMap:
    """Per-row futures of the overlap loop: ``output_tokens``, ``new_seq_lens`` and the
    relay fields a speculative worker declares.

    Args:
        num_rows: rows of the request pool (the buffers get ``num_rows + 1`` entries;
            row 0 is padding and belongs to nobody).
        device: where the buffers live; the forward stream's device.
        debug: consume-once checks (W R W R per row). ``None`` reads
            ``TANDEM_DEBUG_FUTURES`` (``read_env``); an engine passes its
            ``debug_futures`` option. In debug mode buffers start at -1 ("unwritten"),
            every resolve asserts what it reads was stashed since the last resolve and
            marks it read. Without debug there are no checks and no extra work.
        relay_fields: relay fields to declare now (more can be declared later).
        compile_checks: whether the debug checks are ``torch.compile``'d (``auto``,
            ``on``, ``off``; see ``CheckKernels``). ``None`` reads
            ``TANDEM_COMPILE_CHECKS``; an engine passes its ``compile_checks`` option.
    """

    def __init__(
        self,
        num_rows: int,
        device: torch.device | str,
        debug: bool | None = None,
        *,
        relay_fields: Iterable[RelayField] = (),
        compile_checks: CompileChecks | None = None,
    ) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows must be a positive int, got {num_rows!r}")
        self.num_rows = num_rows
        self.device = torch.device(device)
        self.debug = read_env().debug_futures if debug is None else bool(debug)
        self._checks = None
        if self.debug:
            mode = read_env().compile_checks if compile_checks is None else compile_checks
            self._checks = CheckKernels(self.device, mode)
        unwritten = -1 if self.debug else 0
        self.output_tokens = torch.full(
            (num_rows + 1,), unwritten, dtype=torch.int64, device=self.device
        )
        self.output_tokens[0] = 0
        self.new_seq_lens = torch.full(
            (num_rows + 1,), unwritten, dtype=torch.int64, device=self.device
        )
        self.new_seq_lens[0] = 1
        self._fields: dict[str, RelayField] = {}
        self._relay: dict[str, torch.Tensor] = {}
        self._written: dict[str, torch.Tensor] = {}  # debug: 1 while a row holds an unread value
        self._publish_event: Event | None = None
        self.declare(*relay_fields)

    # -- schema -----------------------------------------------------------------------
    def declare(self, *fields: RelayField) -> None:
        """Declare relay fields. Re-declaring an identical field is a no-op; a
        different field under a taken name is an error."""
        for spec in fields:
            known = self._fields.get(spec.name)
            if known is not None and known != spec:
                raise ValueError(f"relay field {spec.name!r} already declared as {known}")
            self._fields[spec.name] = spec

    @property
    def relay_fields(self) -> Mapping[str, RelayField]:
        """The declared relay fields by name (read-only)."""
        return MappingProxyType(self._fields)

    def relay_buffer(self, name: str) -> torch.Tensor | None:
        """A relay field's buffer, or ``None`` before its first stash (lazy allocation)."""
        self._field(name)
        return self._relay.get(name)

    # -- stash / resolve ----------------------------------------------------------------
    def stash(
        self, rows: Rows, tokens: torch.Tensor | Sequence[int] | None, **relay: torch.Tensor
    ) -> None:
        """Write a batch's outputs at its rows: ``tokens`` (flattened, cast to int64,
        one per row) into ``output_tokens`` and each keyword into the relay field of
        that name (shape ``[len(rows), *field.shape]``). ``tokens=None`` writes the
        relay fields alone (a speculative worker completing a prefill whose token the
        sampler stashed). Empty ``rows``: a no-op."""
        idx = self._rows(rows)
        n = idx.numel()
        if n == 0:
            return
        values = None if tokens is None else torch.as_tensor(tokens).reshape(-1)
        if values is not None and values.numel() != n:
            raise ValueError(f"stash: {n} rows but {values.numel()} tokens")
        staged = [(self._field(name), torch.as_tensor(value)) for name, value in relay.items()]
        for spec, value in staged:
            if tuple(value.shape) != (n, *spec.shape):
                raise ValueError(
                    f"stash: relay field {spec.name!r} expects shape {(n, *spec.shape)}, "
                    f"got {tuple(value.shape)}"
                )
        if values is not None:
            self.output_tokens.index_copy_(
                0, idx, values.to(self.device, torch.int64, non_blocking=True)
            )
        for spec, value in staged:
            buf = self._allocate(spec)
            buf.index_copy_(0, idx, value.to(self.device, spec.dtype, non_blocking=True))
            if self.debug:
                self._written[spec.name].index_fill_(0, idx, 1)

    def resolve_tokens(self, rows: Rows) -> torch.Tensor:
        """Gather (consume) the output tokens at ``rows``, in the order given: the
        input ids of a decode batch. Returns an int64 tensor on the device."""
        idx = self._rows(rows)
        if idx.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self._checks is None:
            return self.output_tokens.index_select(0, idx)
        out = self._checks.consume_tokens(self.output_tokens, idx)
        assert out is not None
        return out

    def resolve_relay(self, rows: Rows, *names: str) -> dict[str, torch.Tensor]:
        """Gather (consume) relay fields at ``rows``: the named ones, or all declared
        fields when no name is given. Each value has shape ``[len(rows), *shape]``."""
        idx = self._rows(rows)
        wanted = names or tuple(self._fields)
        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            spec = self._field(name)
            buf = self._relay.get(name)
            if buf is None:
                if self.debug and idx.numel() > 0:
                    raise RuntimeError(
                        f"FutureMap consume-once violated: relay field {name!r} resolved "
                        "before any stash"
                    )
                buf = self._allocate(spec)
            if self._checks is not None and idx.numel() > 0:
                self._checks.consume_flags(self._written[name], idx)
            out[name] = buf.index_select(0, idx)
        return out

    def resolve_mixed(
        self, prefill_tokens: torch.Tensor | Sequence[int], decode_rows: Rows
    ) -> torch.Tensor:
        """The input ids of a mixed batch: the prefill segment's tokens (host data,
        already concatenated over its requests) followed by the decode rows' tokens
        resolved from the FutureMap. No placeholder ids: every entry is a real token."""
        prefill = torch.as_tensor(prefill_tokens, dtype=torch.int64).reshape(-1)
        if self.debug and prefill.device.type == "cpu" and prefill.numel() > 0:
            low = int(prefill.min())
            if low < 0:
                raise ValueError(f"resolve_mixed: prefill token id {low} is negative")
        decode = self.resolve_tokens(decode_rows)
        if prefill.numel() == 0:
            return decode
        prefill = prefill.to(self.device, non_blocking=True)
        return prefill if decode.numel() == 0 else torch.cat([prefill, decode])

    # -- lengths --------------------------------------------------------------------------
    def publish(self, rows: Rows, new_seq_lens: torch.Tensor | Sequence[int]) -> None:
        """Write new sequence lengths at ``rows`` and record ``publish_event``
        on the current stream. Speculative decoding publishes at verify end, before
        draft-extend, so the next step can be sized early."""
        idx = self._rows(rows)
        if idx.numel() > 0:
            lens = torch.as_tensor(new_seq_lens).reshape(-1)
            if lens.numel() != idx.numel():
                raise ValueError(f"publish: {idx.numel()} rows but {lens.numel()} lengths")
            self.new_seq_lens.index_copy_(
                0, idx, lens.to(self.device, torch.int64, non_blocking=True)
            )
        if self._publish_event is None:
            self._publish_event = create_event(self.device)
        self._publish_event.record(current_stream(self.device))

    @property
    def publish_event(self) -> Event | None:
        """The event of the latest ``publish`` (created lazily; ``None`` before)."""
        return self._publish_event

    def resolve_seq_lens(self, rows: Rows) -> torch.Tensor:
        """Gather published lengths at ``rows`` (int64). In debug mode they are
        guarded positive: a length read before its publish, or a zero one, raises.
        Lengths are state, not a token stream, so reading them does not consume them."""
        idx = self._rows(rows)
        if self._checks is None or idx.numel() == 0:
            return self.new_seq_lens.index_select(0, idx)
        out = self._checks.guard_positive(self.new_seq_lens, idx)
        assert out is not None
        return out

    def discard(self, rows: Rows) -> None:
        """Forget the futures of freed rows. In debug mode they read as unwritten
        again, so a row's next owner must stash before it resolves; otherwise a no-op."""
        idx = self._rows(rows)
        if not self.debug or idx.numel() == 0:
            return
        self.output_tokens.index_fill_(0, idx, -1)
        self.new_seq_lens.index_fill_(0, idx, -1)
        for flags in self._written.values():
            flags.index_fill_(0, idx, 0)
        self.output_tokens[0] = 0
        self.new_seq_lens[0] = 1
        for flags in self._written.values():
            flags[0] = 1

    # -- helpers --------------------------------------------------------------------------
    def _rows(self, rows: Rows) -> torch.Tensor:
        if isinstance(rows, torch.Tensor):
            if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
                raise TypeError(f"rows must be an integer tensor, got {rows.dtype}")
            return rows.reshape(-1).to(self.device, torch.int64, non_blocking=True)
        # Pinned on accelerators, so the copy is truly asynchronous.
        host = torch.tensor(list(rows), dtype=torch.int64, pin_memory=self.device.type != "cpu")
        return host.to(self.device, non_blocking=True)

    def _field(self, name: str) -> RelayField:
        spec = self._fields.get(name)
        if spec is None:
            known = ", ".join(sorted(self._fields)) or "none"
            raise KeyError(f"relay field {name!r} is not declared (declared: {known})")
        return spec

    def _allocate(self, spec: RelayField) -> torch.Tensor:
        buf = self._relay.get(spec.name)
        if buf is None:
            # Normal tensors even when the first stash runs under inference mode, so
            # ``discard`` (outside it) may still update them in place.
            with torch.inference_mode(False):
                self._allocate_now(spec)
            buf = self._relay[spec.name]
        return buf

    def _allocate_now(self, spec: RelayField) -> None:
        self._relay[spec.name] = torch.zeros(
            spec.buffer_shape(self.num_rows), dtype=spec.dtype, device=self.device
        )
        if self.debug:
            flags = torch.zeros(self.num_rows + 1, dtype=torch.int8, device=self.device)
            flags[0] = 1
            self._written[spec.name] = flags

    def __repr__(self) -> str:
        fields = ", ".join(self._fields) or "-"
        return (
            f"FutureMap(num_rows={self.num_rows}, device={self.device}, debug={self.debug}, "
            f"relay_fields=[{fields}])"
        )

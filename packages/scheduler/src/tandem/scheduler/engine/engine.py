"""The offline ``Engine``: SGLang's shape where the concept exists.

``Engine(model_path=None, dtype="auto", device=None, **options)`` builds its parts
from an ``EngineConfig`` (``wiring``) and runs the scheduler on a thread of its own
(``engine_loop``). ``generate`` checks every request of a call before any of them is
queued (``intake``), so bad input raises a ``ValueError`` naming the field and never
disturbs other work; results come back through ``streams``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem.scheduler.config import EngineConfig
from tandem.scheduler.disagg.protocol import Bootstrap
from tandem.scheduler.engine.delivery import (
    Chunk,
    ChunkReader,
    Outbox,
    Waiter,
    collect,
    with_logprob_text,
)
from tandem.scheduler.engine.intake import InputIds, Intake, ParamsArg, Prompt
from tandem.scheduler.engine.loop import EngineLoop
from tandem.scheduler.engine.wiring import wire
from tandem.scheduler.parallel.distributed import RankGroup, start_rank_zero
from tandem.scheduler.runner.cpu_step import ForwardThreads
from tandem.scheduler.text.stop import StopLimits


class Engine:
    """Offline inference engine. See the "Offline Engine" guide for examples."""

    def __init__(
        self,
        model_path: str | None = None,
        dtype: str = "auto",
        device: str | None = None,
        **options: Any,
    ) -> None:
        self.config = EngineConfig.from_options(
            {"model_path": model_path, "dtype": dtype, "device": device, **options}
        )
        self._ranks: RankGroup | None = None
        if self.config.tp_size > 1:
            if self.config.node_rank != 0:
                raise ValueError(
                    f"node_rank={self.config.node_rank} runs tensor-parallel ranks only, "
                    "no engine: start it with `tandem serve --node-rank ...`"
                )
            self.config, self._ranks = start_rank_zero(self.config)
        try:
            self._parts = parts = wire(self.config, self._ranks)
        except BaseException:
            if self._ranks is not None:
                self._ranks.close(timeout_s=0)
            raise
        self.model_path = parts.model_path
        self.model_config = parts.model_config
        self.device = parts.device
        self.dtype = parts.dtype
        self.context_length = parts.context_length
        self.forward_threads = parts.forward_threads
        """Intra-op threads of the CPU forward, per step (None on accelerators)."""
        self.tokenizer = parts.tokenizer
        self.eos_ids = parts.eos_ids
        self.attention_backend = parts.attention_backend
        self.scheduler = parts.scheduler
        self._tokenizer_dir = parts.tokenizer_path
        self._closed = False
        self._loop = EngineLoop(
            self.scheduler,
            speculative=self.config.speculative,
            admission_window_s=self.config.admission_window_ms / 1000,
        )
        if self.scheduler.disagg is not None:
            self.scheduler.disagg.inbox.wake = self._loop.wake
        no_grammar = self._no_grammar()
        self._intake = Intake(
            tokenizer=self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            context_length=self.context_length,
            kv_capacity_tokens=parts.kv_pool.capacity_tokens,
            lookahead=self.config.speculative_lookahead,
            spec=parts.spec,
            in_use=self._loop.waiters.__contains__,
            disaggregation_mode=self.config.disaggregation_mode,
            grammars=None if no_grammar else lambda: self._grammar_backend,
            no_grammar=no_grammar,
            stop_limits=StopLimits(
                self.config.max_stop_strings, self.config.max_stop_string_length
            ),
        )

    def _no_grammar(self) -> str:
        """Why constrained output cannot be served, or ``""`` when it can."""
        if self.config.grammar_backend == "none":
            return "constrained output is off on this server (grammar_backend is none)"
        if not (self._tokenizer_dir / "tokenizer.json").exists():
            return "constrained output needs the model's tokenizer (tokenizer.json)"
        if self.config.speculative and self.config.tp_size > 1:
            return (
                "constrained output is not supported with speculative decoding and "
                "tp_size > 1 together yet"
            )
        return ""

    @functools.cached_property
    def _grammar_backend(self) -> Any:
        from tandem.scheduler.sampling.grammar import GrammarBackend  # xgrammar: on first use

        return GrammarBackend(self._tokenizer_dir, self.model_config.vocab_size, self.eos_ids)

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: ParamsArg = None,
        input_ids: InputIds = None,
        stream: bool = False,
        return_logprob: bool | Sequence[bool] = False,
        top_logprobs_num: int | Sequence[int] = 0,
        rid: str | Sequence[str] | None = None,
        return_token_times: bool = False,
        bootstrap: Bootstrap | Sequence[Bootstrap | None] | None = None,
        logprob_start_len: int | Sequence[int] = -1,
        return_text_in_logprobs: bool = False,
    ) -> Any:
        """Generate for one prompt or a batch.

        Returns a dict (one prompt) or a list of dicts (a batch), each with ``text``,
        ``output_ids`` and ``meta_info``; ``n > 1`` in the sampling parameters turns
        each prompt into ``n`` results, in order. ``rid`` names the requests (one
        id per prompt), so another thread can ``abort`` them before any output.
        With ``stream=True`` returns an iterator of incremental chunks (``text`` and
        ``output_ids`` hold only what is new; the last chunk carries
        ``meta_info["finish_reason"]``); streaming takes one prompt.
        ``return_token_times``: ``meta_info["output_token_times"]`` lists when each
        output token reached the engine's host side (``time.perf_counter()`` seconds in
        this process): per-token latencies without a stream to read them from.
        ``bootstrap`` (a ``disagg.Bootstrap``, or one per prompt) pairs a request with
        its other half on a disaggregated pair of engines (``disaggregation_mode``);
        ignored when the mode is ``null``.
        ``logprob_start_len`` (SGLang's; one, or one per prompt): with ``return_logprob``,
        ``meta_info["input_token_logprobs"]`` holds the logprob of each prompt token from
        this position on given the tokens before it (``None`` for the first prompt
        token), and with ``top_logprobs_num`` also ``input_top_logprobs``; -1 (the
        default): no prompt logprobs. ``return_text_in_logprobs``: each logprob tuple's
        third element is its token's text instead of ``None``.
        """
        transform = self._logprob_text(return_text_in_logprobs)
        single, waiters = self._submit(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, rid,
            times=return_token_times, bootstrap=bootstrap, logprob_start_len=logprob_start_len,
        )  # fmt: skip
        if stream:
            return ChunkReader(waiters[0], transform)
        results = self._collect(waiters, transform=transform)
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: ParamsArg = None,
        input_ids: InputIds = None,
        stream: bool = False,
        return_logprob: bool | Sequence[bool] = False,
        top_logprobs_num: int | Sequence[int] = 0,
        rid: str | Sequence[str] | None = None,
        return_token_times: bool = False,
        bootstrap: Bootstrap | Sequence[Bootstrap | None] | None = None,
        logprob_start_len: int | Sequence[int] = -1,
        return_text_in_logprobs: bool = False,
    ) -> Any:
        """The ``generate`` twin for asyncio: awaits the result, or with
        ``stream=True`` returns an async iterator of chunks."""
        transform = self._logprob_text(return_text_in_logprobs)
        loop = asyncio.get_running_loop() if stream else None
        single, waiters = self._submit(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, rid,
            loop, times=return_token_times, bootstrap=bootstrap,
            logprob_start_len=logprob_start_len,
        )  # fmt: skip
        if stream:
            return ChunkReader(waiters[0], transform)
        results = await asyncio.to_thread(self._collect, waiters, False, transform)
        return results[0] if single else results

    def _logprob_text(self, wanted: bool) -> Callable[[Chunk], Chunk] | None:
        """What ``return_text_in_logprobs`` does to a result: its logprob tuples get
        their tokens' text (special tokens spelled out, as SGLang's)."""
        if not wanted:
            return None
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("return_text_in_logprobs needs the model's tokenizer")
        text = functools.lru_cache(maxsize=4096)(
            lambda tok: tokenizer.decode([tok], skip_special_tokens=False)
        )
        return functools.partial(with_logprob_text, text=text)

    def add_requests(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling_params: Sequence[Mapping[str, Any]],
        rids: Sequence[str],
        outbox: Outbox,
        return_logprob: Sequence[bool] | bool = False,
        top_logprobs_num: Sequence[int] | int = 0,
        bootstrap: Sequence[Bootstrap | None] | None = None,
        logprob_start_len: Sequence[int] | int = -1,
    ) -> None:
        """Queue a batch of requests, each named by its caller's id, whose output goes
        to ``outbox`` one step at a time (new ids and new logprobs, never text): the
        server's scheduler process sends each step to the API process as one message.
        Checked like ``generate``; a ``ValueError`` queues none of them."""
        self._check_running()
        _, reqs = self._intake.requests(
            None, list(sampling_params), [list(ids) for ids in input_ids], return_logprob,
            top_logprobs_num, False, list(rids), False, text=False, bootstrap=bootstrap,
            logprob_start_len=logprob_start_len,
        )  # fmt: skip
        if len(reqs) != len(rids):
            raise ValueError("add_requests takes n=1 per request (one rid each)")
        for req in reqs:
            self._loop.add(Waiter(req, outbox=outbox))

    def abort(self, rid: str) -> None:
        """Abort a request (its ``meta_info["id"]``) wherever it is: queued,
        prefilling, decoding or in flight. Its caller receives a final result with
        ``finish_reason`` ``{"type": "abort", ...}``; its row and KV pages come back
        once no launched batch still uses them. Unknown or finished ids are ignored."""
        self._loop.abort(rid)

    def flush_cache(self) -> bool:
        """Empty the radix prefix cache (SGLang's ``flush_cache``), freeing its KV pages.

        Only an idle engine flushes: with a request queued or running this returns
        ``False`` and changes nothing. A batch still in flight for requests that have
        already finished is waited for first. Returns ``True`` once flushed (also
        without a radix cache, where there is nothing to flush)."""
        self._check_running()
        return self._loop.flush_cache()

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes captured in CUDA graphs (empty without graphs)."""
        graphs = self._parts.graphs
        return list(graphs.sizes) if graphs is not None else []

    def get_server_info(self) -> dict[str, Any]:
        """Configuration, model facts, memory and counters, as one dict."""
        s, kv, timeline = self.scheduler, self._parts.kv_pool, self._parts.timeline
        stream = self._parts.weight_stream
        stream_stats = dataclasses.asdict(stream.stats()) if stream is not None else {}
        return {
            **self.config.as_dict(),
            "model_path": str(self.model_path),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "architecture": self.model_config.architecture,
            "quantization": self._parts.quantization,
            "weights_bytes": self._parts.weights_bytes,
            "cpu_weight_stream": stream is not None,
            **{f"cpu_weight_stream_{name}": value for name, value in stream_stats.items()},
            "context_length": self.context_length,
            "attention_backend": self.attention_backend,
            "overlap_schedule": s.overlap,
            **_forward_threads_info(self.forward_threads),
            "max_total_tokens": kv.capacity_tokens,
            "available_kv_tokens": kv.available_tokens,
            "free_rows": self._parts.req_pool.available,
            "num_running_requests": len(s.running) + len(s.prefilling),
            "num_waiting_requests": len(s.waiting),
            "cached_kv_tokens": (s.radix.cached_pages * kv.page_size) if s.radix else 0,
            **vars(s.counters),
            "device_busy_s": timeline.busy_s,
            "device_idle_s": timeline.idle_s,
            "device_idle_fraction": timeline.idle_fraction,
            "avg_spec_accept_length": s.counters.avg_spec_accept_length,
            "spec_gate": s.spec.gate.summary() if s.spec and s.spec.gate else None,
            "disaggregation_bootstrap_port": getattr(s.disagg, "port", None)
            or self.config.disaggregation_bootstrap_port,
        }

    def shutdown(self) -> None:
        """Stop the scheduler thread and the forward stream; pending requests end
        with an error."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop()
        if self.scheduler.disagg is not None:
            self.scheduler.disagg.close()
        relay = self.scheduler.runner.relay
        if relay is not None and self.failure is None:
            with contextlib.suppress(Exception):  # a rank already gone
                relay.stop()
        stream = self._parts.stream
        try:
            stream.synchronize()
        except Exception:
            if self._ranks is None:
                raise  # a sharded forward fails when a rank is gone: already reported
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        if self._parts.weight_stream is not None:
            self._parts.weight_stream.close()
        if self._ranks is not None:
            self._ranks.close()

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer run (its loop died, or a tensor-parallel rank
        exited), or None while it can."""
        if self._ranks is not None and self._ranks.failure is not None:
            return self._ranks.failure
        if self._loop.failure is not None:
            # A rank's exit breaks the forward's collectives before the watch notices it.
            if self._ranks is not None and self._ranks.exited() is not None:
                return self._ranks.exited()
            return f"the scheduler loop died: {self._loop.failure!r}"
        return None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _submit(
        self,
        prompt: Prompt,
        sampling_params: ParamsArg,
        input_ids: InputIds,
        return_logprob: bool | Sequence[bool],
        top_logprobs_num: int | Sequence[int],
        stream: bool,
        rid: str | Sequence[str] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        times: bool = False,
        bootstrap: Bootstrap | Sequence[Bootstrap | None] | None = None,
        logprob_start_len: int | Sequence[int] = -1,
    ) -> tuple[bool, list[Waiter]]:
        """Check every request, then queue them all; nothing is queued when any
        request is invalid."""
        self._check_running()
        single, reqs = self._intake.requests(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, rid,
            times, bootstrap=bootstrap, logprob_start_len=logprob_start_len,
        )  # fmt: skip
        waiters = [Waiter(req, stream=stream, loop=loop) for req in reqs]
        for waiter in waiters:
            self._loop.add(waiter)
        return single, waiters

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was shut down")
        if self._ranks is not None and self._ranks.failure is not None:
            raise RuntimeError(self._ranks.failure)
        if self._loop.failure is not None:
            raise RuntimeError("the scheduler loop died") from self._loop.failure

    def _collect(
        self,
        waiters: list[Waiter],
        progress: bool = True,
        transform: Callable[[Chunk], Chunk] | None = None,
    ) -> list[dict[str, Any]]:
        bar = self._progress(len(waiters)) if progress else None
        results = []
        try:
            for waiter in waiters:
                results.append(collect(waiter, transform))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results

    def _progress(self, total: int) -> Any:
        if total < 2 or self.config.disable_progress_bar or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc="generate", unit="req")


def _forward_threads_info(threads: ForwardThreads | None) -> dict[str, int | None]:
    """``get_server_info``'s view of the CPU forward's threads: a long step's (every
    core by default), a short step's, and the tokens from which a step is long."""
    long, short, from_tokens = (
        (None, None, None)
        if threads is None
        else (threads.long, threads.short, threads.long_from_tokens)
    )
    return {
        "forward_threads": long,
        "forward_threads_short": short,
        "forward_threads_long_from_tokens": from_tokens,
    }

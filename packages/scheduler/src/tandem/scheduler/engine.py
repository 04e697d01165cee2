"""The offline ``Engine``: SGLang's shape where the concept exists.

``Engine(model_path=None, dtype="auto", device=None, **options)`` loads a checkpoint
(or the embedded default model), builds the pools, the attention backend, the sampler
and the FutureMap, and runs the scheduler loop on a thread of its own. ``generate``
validates every request of a call before any of them is queued, so bad input raises a
``ValueError`` naming the field and never disturbs other work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.futuremap import DeviceStream, FutureMap, Stream, create_stream, read_env
from tandem.scheduler.attention import (
    AttentionBackend,
    HeadShape,
    create_attention_backend,
    default_backend,
)
from tandem.scheduler.attention.torch_backend import TorchAttention
from tandem.scheduler.config import EngineConfig
from tandem.scheduler.cuda_graph import DecodeGraphRunner
from tandem.scheduler.decode_trace import DecodeTrace
from tandem.scheduler.default_model import default_model_path
from tandem.scheduler.detokenizer import IncrementalDetokenizer
from tandem.scheduler.memory import KVLayout, PagedKVPool, ReqToTokenPool, total_memory_bytes
from tandem.scheduler.messages import Update
from tandem.scheduler.model_runner import ModelRunner
from tandem.scheduler.models import CausalLM, ModelConfig, load_model, resolve_dtype
from tandem.scheduler.request import Request
from tandem.scheduler.sampling import PenaltyState, Sampler, SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.speculative import TargetHandle, create_speculative_worker
from tandem.scheduler.stop import StopChecker
from tandem.scheduler.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | Sequence[str] | None
InputIds = Sequence[int] | Sequence[Sequence[int]] | None
ParamsArg = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


@dataclass
class _Waiter:
    """Where the scheduler thread delivers a request's chunks.

    A stream gets a chunk per step; any other request only its final result, so a
    batch call adds no per-token work to the scheduler thread, which runs beside the
    forward. An asyncio stream (``loop`` set) is fed through the loop itself rather
    than through a thread hop per chunk."""

    req: Request
    stream: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    chunks: queue.Queue[dict[str, Any] | BaseException] = field(default_factory=queue.Queue)
    achunks: asyncio.Queue[dict[str, Any] | BaseException] | None = None

    def __post_init__(self) -> None:
        if self.loop is not None:
            self.achunks = asyncio.Queue()

    def put(self, item: dict[str, Any] | BaseException) -> None:
        """Hand ``item`` to the consumer (called on the scheduler thread)."""
        if self.loop is None:
            self.chunks.put(item)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read
            self.loop.call_soon_threadsafe(_put_all, [(self, item)])


@dataclass
class _Parsed:
    prompt_ids: list[int]
    params: SamplingParams


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
        cfg = self.config
        self.model_path = Path(cfg.model_path) if cfg.model_path else default_model_path()
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.dtype = resolve_dtype(cfg.dtype, self.model_config)
        max_pos = self.model_config.max_position_embeddings
        if cfg.context_length is not None and cfg.context_length > max_pos:
            raise ValueError(
                f"context_length={cfg.context_length} exceeds the model's "
                f"max_position_embeddings ({max_pos})"
            )
        self.context_length = cfg.context_length or max_pos
        self.forward_threads: int | None = None
        """Intra-op threads of the CPU forward (None on accelerators)."""
        if self.device.type == "cpu":
            self.forward_threads = cfg.cpu_forward_threads or max(1, torch.get_num_threads() - 1)
        tokenizer = _load_tokenizer(Path(cfg.tokenizer_path or self.model_path))
        self.eos_ids = _eos_ids(self.model_path, self.model_config, tokenizer)
        # skip_tokenizer_init keeps the tokenizer's eos ids (the same stops either way).
        self.tokenizer = None if cfg.skip_tokenizer_init else tokenizer
        self.scheduler = self._build_scheduler()
        self._waiters: dict[str, _Waiter] = {}
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tandem-scheduler", daemon=True)
        self._thread.start()

    # -- construction ---------------------------------------------------------------------------
    def _build_scheduler(self) -> Scheduler:
        cfg, mc = self.config, self.model_config
        debug = read_env().debug_futures  # the debug invariants, all or none
        model = load_model(
            None if cfg.load_format == "dummy" else self.model_path,
            mc,
            dtype=self.dtype,
            device=self.device,
            load_format=cfg.load_format,
            seed=cfg.random_seed,
        )
        layout = KVLayout(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, self.dtype)
        kv_pool = PagedKVPool(self._num_pages(layout), cfg.page_size, layout, self.device)
        rows = cfg.max_running_requests
        # A speculative step may map and write up to two lookaheads past the context.
        req_pool = ReqToTokenPool(
            rows, self.context_length + 2 * cfg.speculative_lookahead, self.device
        )
        heads = HeadShape(
            mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
            mc.head_dim**-0.5, self.dtype,
        )  # fmt: skip
        backend = cfg.attention_backend or default_backend(self.device)
        attention = create_attention_backend(
            backend, kv_pool, req_pool.req_to_token, self.device, heads, debug=debug
        )
        sampler = Sampler(seed=cfg.random_seed)
        future_map = FutureMap(rows, self.device)
        spec = None
        if cfg.speculative:
            target = TargetHandle(
                model, mc, attention, req_pool, kv_pool, future_map, sampler,
                self.device, self.dtype,
            )  # fmt: skip
            spec = create_speculative_worker(cfg, target)
            future_map.declare(*spec.relay_fields)
        graphs = self._decode_graphs(model, attention)
        runner = ModelRunner(
            model=model,
            req_pool=req_pool,
            kv_pool=kv_pool,
            attention=attention,
            sampler=sampler,
            penalties=PenaltyState(rows, mc.vocab_size, self.device),
            future_map=future_map,
            stream=self._forward_stream(),
            spec=spec,
            copy_stream=None if self.device.type == "cpu" else DeviceStream(self.device),
            graphs=graphs,
            decode_trace=self._decode_trace(model, attention),
        )
        self.attention_backend = backend
        return Scheduler(
            cfg,
            runner,
            eos_ids=self.eos_ids,
            context_length=self.context_length,
            strict_accounting=debug,
        )

    def _decode_graphs(
        self, model: CausalLM, attention: AttentionBackend
    ) -> DecodeGraphRunner | None:
        """Capture the decode forward in CUDA graphs, unless disabled or impossible
        (not CUDA, a backend that cannot be captured, speculative decoding)."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.disable_cuda_graph or cfg.speculative:
            return None
        if not attention.supports_cuda_graph:
            log.info(
                "no CUDA graphs: the %s attention backend cannot be captured",
                type(attention).__name__,
            )
            return None
        max_bs = min(cfg.cuda_graph_max_bs or 256, cfg.max_running_requests)
        graphs = DecodeGraphRunner(model, attention, self.device, max_bs)
        graphs.capture()
        return graphs

    def _forward_stream(self) -> Stream:
        """The forward stream. On the CPU its worker thread runs the forward with
        ``forward_threads`` intra-op threads (a per-thread setting: the caller's
        threads keep theirs)."""
        stream = create_stream(self.device, name="tandem-forward")
        if self.forward_threads is not None:
            stream.submit(torch.set_num_threads, self.forward_threads).result()
        return stream

    def _decode_trace(self, model: CausalLM, attention: AttentionBackend) -> DecodeTrace | None:
        """The CPU decode trace, unless disabled or of no use: it replays the steps
        that continue a ``torch`` backend's decode stage, which exist on the CPU only,
        and not the speculative steps."""
        cfg = self.config
        if cfg.disable_decode_trace or cfg.speculative or self.device.type != "cpu":
            return None
        if not isinstance(attention, TorchAttention) or not attention.decode_stage:
            return None
        return DecodeTrace(model, attention)

    def _num_pages(self, layout: KVLayout) -> int:
        cfg = self.config
        tokens = cfg.max_total_tokens
        if tokens is None:
            frac = cfg.mem_fraction_static or (0.05 if self.device.type == "cpu" else 0.85)
            budget = int(total_memory_bytes(self.device) * frac) // layout.bytes_per_token
            tokens = min(budget, cfg.max_running_requests * self.context_length)
        pages = tokens // cfg.page_size + 1  # + the padding page
        if pages < 2:
            raise ValueError(f"max_total_tokens={tokens} leaves no room for a single KV page")
        return pages

    # -- public API -------------------------------------------------------------------------------
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
        """
        single, waiters = self._submit(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, rid,
            times=return_token_times,
        )  # fmt: skip
        if stream:
            return self._stream(waiters[0])
        results = self._collect(waiters)
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
    ) -> Any:
        """The ``generate`` twin for asyncio: awaits the result, or with
        ``stream=True`` returns an async iterator of chunks."""
        loop = asyncio.get_running_loop() if stream else None
        single, waiters = self._submit(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, rid,
            loop, times=return_token_times,
        )  # fmt: skip
        if stream:
            return self._astream(waiters[0])
        results = await asyncio.to_thread(self._collect, waiters, False)
        return results[0] if single else results

    def abort(self, request_id: str) -> None:
        """Abort a request (its ``meta_info["id"]``) wherever it is: queued,
        prefilling, decoding or in flight. Its caller receives a final result with
        ``finish_reason`` ``{"type": "abort", ...}``; its row and KV pages come back
        once no launched batch still uses them. Unknown or finished ids are ignored."""
        self._inbox.put(("abort", request_id))

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes captured in CUDA graphs (empty without graphs)."""
        graphs = self.scheduler.runner.graphs
        return list(graphs.sizes) if graphs is not None else []

    def get_server_info(self) -> dict[str, Any]:
        """Configuration, model facts, memory and counters, as one dict."""
        s = self.scheduler
        kv, rows = s.kv_pool, s.req_pool
        timeline = s.runner.timeline
        return {
            **self.config.as_dict(),
            "model_path": str(self.model_path),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "architecture": self.model_config.architecture,
            "context_length": self.context_length,
            "attention_backend": self.attention_backend,
            "overlap_schedule": s.overlap,
            "forward_threads": self.forward_threads,
            "max_total_tokens": kv.capacity_tokens,
            "available_kv_tokens": kv.available_tokens,
            "free_rows": rows.available,
            "num_running_requests": len(s.running) + len(s.prefilling),
            "num_waiting_requests": len(s.waiting),
            "cached_kv_tokens": (s.radix.cached_pages * kv.page_size) if s.radix else 0,
            **vars(s.counters),
            "device_busy_s": timeline.busy_s,
            "device_idle_s": timeline.idle_s,
            "device_idle_fraction": timeline.idle_fraction,
            "avg_spec_accept_length": s.counters.avg_spec_accept_length,
        }

    def shutdown(self) -> None:
        """Stop the scheduler thread and the forward stream; pending requests end
        with an error."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(("stop", None))
        self._thread.join()
        self.scheduler.runner.stream.synchronize()
        close = getattr(self.scheduler.runner.stream, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- request intake ---------------------------------------------------------------------------
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
    ) -> tuple[bool, list[_Waiter]]:
        """Validate every request, then queue them all; nothing is queued when any
        request is invalid."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        if self._failure is not None:
            raise RuntimeError("the scheduler loop died") from self._failure
        single, prompts = self._prompt_ids(prompt, input_ids)
        if stream and not single:
            raise ValueError("stream=True takes a single prompt (or input_ids list)")
        n = len(prompts)
        params = _per_request(sampling_params, n, "sampling_params")
        logprob = _per_request(return_logprob, n, "return_logprob")
        top_n = _per_request(top_logprobs_num, n, "top_logprobs_num")
        parsed = [
            self._parse(i, ids, p) for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        vocab = self.model_config.vocab_size
        for top in top_n:
            if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= vocab:
                raise ValueError(f"top_logprobs_num must be an int in [0, {vocab}], got {top!r}")
        if stream and parsed[0].params.n > 1:
            raise ValueError("stream=True takes n=1")
        rids = self._request_ids(rid, parsed)
        self._check_speculative(parsed, logprob, top_n)
        waiters = []
        for item, want_lp, top, ids in zip(parsed, logprob, top_n, rids, strict=True):
            for copy, request_id in zip(_copies(item), ids, strict=True):
                req = self._request(
                    copy,
                    bool(want_lp or item.params.return_logprob),
                    max(top, item.params.top_logprobs_num),
                    request_id,
                )
                if times:
                    req.token_times = []
                waiter = _Waiter(req, stream=stream, loop=loop)
                self._waiters[req.rid] = waiter
                waiters.append(waiter)
                self._inbox.put(("add", req))
        return single and len(waiters) == 1, waiters

    def _check_speculative(
        self, parsed: list[_Parsed], logprob: list[Any], top_n: list[int]
    ) -> None:
        """Refuse what the speculative worker cannot serve, before anything is queued."""
        spec = self.scheduler.runner.spec
        if spec is None:
            return
        for i, (item, want_lp, top) in enumerate(zip(parsed, logprob, top_n, strict=True)):
            try:
                spec.check_request(item.params, bool(want_lp or item.params.return_logprob or top))
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None

    def _prompt_ids(self, prompt: Prompt, input_ids: InputIds) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass input_ids instead of prompt")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(f"prompt {i} is not a string")
                if not text:
                    raise ValueError(f"prompt {i} is empty")
            return single, [self.tokenizer.encode(t) for t in texts]
        assert input_ids is not None
        single = len(input_ids) == 0 or not isinstance(input_ids[0], Sequence)
        batch = [list(input_ids)] if single else [list(ids) for ids in input_ids]  # type: ignore[arg-type]
        return single, batch

    def _parse(self, index: int, ids: list[int], raw: Mapping[str, Any] | None) -> _Parsed:
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError(f"request {index}: input_ids is empty")
        for tok in ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab:
                raise ValueError(
                    f"request {index}: input_ids holds {tok!r}, outside the vocabulary [0, {vocab})"
                )
        try:
            params = SamplingParams.from_dict(raw)
            params.validate(vocab, context_len=self.context_length, prompt_len=len(ids))
        except ValueError as exc:
            raise ValueError(f"request {index}: {exc}") from None
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(
                f"request {index}: stop strings need a tokenizer, and this engine has none "
                "(skip_tokenizer_init, or a checkpoint without tokenizer.json); use "
                "stop_token_ids"
            )
        need = len(ids) + params.max_new_tokens + 2 * self.config.speculative_lookahead
        if need > self.scheduler.kv_pool.capacity_tokens:
            raise ValueError(
                f"request {index}: prompt + max_new_tokens = {need} tokens exceeds the KV "
                f"pool ({self.scheduler.kv_pool.capacity_tokens} tokens, max_total_tokens)"
            )
        return _Parsed(ids, params)

    def _request_ids(
        self, rid: str | Sequence[str] | None, parsed: list[_Parsed]
    ) -> list[list[str]]:
        """One id per request: the caller's (SGLang's ``rid``; with ``n > 1`` the
        copies get ``-1``, ``-2``... suffixes) or a fresh one. Ids in use are refused."""
        if rid is None:
            return [[uuid.uuid4().hex for _ in range(p.params.n)] for p in parsed]
        given = [rid] if isinstance(rid, str) else list(rid)
        if len(given) != len(parsed) or not all(isinstance(r, str) and r for r in given):
            raise ValueError(f"rid needs one non-empty string per prompt ({len(parsed)})")
        out = [
            [r] if p.params.n == 1 else [f"{r}-{i}" for i in range(p.params.n)]
            for r, p in zip(given, parsed, strict=True)
        ]
        flat = [r for ids in out for r in ids]
        clash = sorted({r for r in flat if r in self._waiters or flat.count(r) > 1})
        if clash:
            raise ValueError(f"rid {clash[0]!r} is already in use")
        return out

    def _request(self, item: _Parsed, return_logprob: bool, top_n: int, rid: str) -> Request:
        detok = (
            IncrementalDetokenizer(
                self.tokenizer, item.prompt_ids, skip_special_tokens=item.params.skip_special_tokens
            )
            if self.tokenizer is not None
            else None
        )
        stop = StopChecker(item.params.stop_strings, detok)
        return Request(
            rid=rid,
            prompt_ids=item.prompt_ids,
            params=item.params,
            stop=stop,
            return_logprob=return_logprob,
            top_logprobs_num=top_n,
        )

    # -- the scheduler thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                block = not self.scheduler.has_work()
                if not self._drain_inbox(block):
                    break
                self._deliver(self.scheduler.iterate())
        except BaseException as exc:
            log.exception("scheduler loop failed")
            self._failure = exc
            for waiter in list(self._waiters.values()):
                waiter.put(exc)
        finally:
            for waiter in list(self._waiters.values()):
                waiter.put(RuntimeError("the engine shut down before the request finished"))
            self._waiters.clear()

    def _drain_inbox(self, block: bool) -> bool:
        """Move new requests into the scheduler; ``False`` when asked to stop."""
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self.scheduler.add(item)
            elif kind == "abort":
                self.scheduler.abort(item)

    def _deliver(self, updates: list[Update]) -> None:
        """Hand a step's chunks to their consumers: straight into thread queues, and
        to each asyncio loop in one call, so a step wakes a loop once rather than once
        per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Waiter, dict[str, Any]]]] = {}
        for update in updates:
            found = self._chunk(update)
            if found is None:
                continue
            waiter, chunk = found
            if waiter.loop is None:
                waiter.chunks.put(chunk)
            else:
                by_loop.setdefault(waiter.loop, []).append((waiter, chunk))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                # The consumers' event loop is closed: nobody is left to read these
                # streams, so stop their requests as a disconnect would.
                for waiter, _ in items:
                    self._waiters.pop(waiter.req.rid, None)
                    self.scheduler.abort(waiter.req.rid)

    def _chunk(self, update: Update) -> tuple[_Waiter, dict[str, Any]] | None:
        req = update.req
        waiter = self._waiters.get(req.rid)
        if waiter is None or not (waiter.stream or update.finished):
            return None
        chunk = {
            "text": req.stop.take_new_text(final=update.finished),
            # A stream's chunk holds the step's ids; a final result all of them.
            "output_ids": list(update.new_ids if waiter.stream else req.output_ids),
            "meta_info": self._meta(req),
        }
        if update.finished:
            del self._waiters[req.rid]
        return waiter, chunk

    def _meta(self, req: Request) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish.as_dict() if req.finish else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
        }
        if req.token_times is not None:
            meta["output_token_times"] = list(req.token_times)
        if self.config.speculative:
            meta["spec_verify_ct"] = req.spec_verify_ct
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                (lp, tok, None)
                for lp, tok in zip(req.output_logprobs, req.output_ids, strict=False)
            ]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [(lp, tok, None) for lp, tok in step] for step in req.output_top_logprobs
                ]
        return meta

    # -- results -----------------------------------------------------------------------------------
    def _stream(self, waiter: _Waiter) -> Iterator[dict[str, Any]]:
        while True:
            chunk = waiter.chunks.get()
            if isinstance(chunk, BaseException):
                raise RuntimeError("generation failed") from chunk
            yield chunk
            if chunk["meta_info"]["finish_reason"] is not None:
                return

    async def _astream(self, waiter: _Waiter) -> AsyncIterator[dict[str, Any]]:
        while True:
            assert waiter.achunks is not None
            chunk = await waiter.achunks.get()
            if isinstance(chunk, BaseException):
                raise RuntimeError("generation failed") from chunk
            yield chunk
            if chunk["meta_info"]["finish_reason"] is not None:
                return

    def _collect(self, waiters: list[_Waiter], progress: bool = True) -> list[dict[str, Any]]:
        bar = self._progress(len(waiters)) if progress else None
        results = []
        try:
            for waiter in waiters:
                text, ids, meta = "", [], None
                for chunk in self._stream(waiter):
                    text += chunk["text"]
                    ids.extend(chunk["output_ids"])
                    meta = chunk["meta_info"]
                results.append({"text": text, "output_ids": ids, "meta_info": meta})
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


def _put_all(items: Sequence[tuple[_Waiter, dict[str, Any] | BaseException]]) -> None:
    """On an asyncio loop: queue chunks (a step's, or an error) for their streams."""
    for waiter, item in items:
        assert waiter.achunks is not None
        waiter.achunks.put_nowait(item)


def _copies(item: _Parsed) -> list[_Parsed]:
    """``n`` independent samples of one prompt, as ``n`` requests (in order). Seeded
    copies get consecutive seeds, so they differ from each other yet reproduce."""
    n = item.params.n
    if n == 1:
        return [item]
    out = []
    for i in range(n):
        seed = None if item.params.seed is None else item.params.seed + i
        params = dataclasses.replace(item.params, n=1, seed=seed)
        out.append(_Parsed(item.prompt_ids, params))
    return out


def _per_request(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | Mapping):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _load_tokenizer(path: Path) -> Tokenizer | None:
    # Checkpoints without tokenizer.json (random test models, say) run on ids alone.
    if not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_pretrained(path)


def _eos_ids(path: Path, config: ModelConfig, tokenizer: Tokenizer | None) -> frozenset[int]:
    """Every id that ends a sequence: config.json, generation_config.json, tokenizer."""
    ids = set(config.eos_token_id or ())
    gen = path / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        ids |= {value} if isinstance(value, int) else set(value or ())
    if tokenizer is not None:
        ids |= set(tokenizer.eos_token_ids)
    return frozenset(ids)

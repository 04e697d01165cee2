"""Wiring: everything an ``Engine`` runs on, built from its ``EngineConfig``.

``wire`` resolves the model facts (checkpoint, device, dtype, context length,
tokenizer, eos ids), then builds the model, the pools, the attention backend, the
sampler, the FutureMap, the speculative worker, the CUDA graphs or the CPU decode
trace, the forward stream, the ``ModelRunner`` and the ``Scheduler``. The debug
switches come from the config alone, never from the environment.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from tandem.futuremap import DeviceStream, FutureMap, Stream, create_stream, read_env
from tandem.futuremap.env import CompileChecks
from tandem.scheduler.attention import (
    AttentionBackend,
    HeadShape,
    create_attention_backend,
    default_backend,
)
from tandem.scheduler.attention.torch_backend import TorchAttention
from tandem.scheduler.config import EngineConfig
from tandem.scheduler.engine.cpu_malloc import keep_freed_memory, release_freed_memory
from tandem.scheduler.kernels.cpu_build import load_cpu_kernels
from tandem.scheduler.kv.pools import KVLayout, PagedKVPool, ReqToTokenPool, total_memory_bytes
from tandem.scheduler.models import (
    CausalLM,
    ModelConfig,
    is_gguf_folder,
    load_model,
    resolve_dtype,
)
from tandem.scheduler.models.quantized import quant_kernel
from tandem.scheduler.models.source import resolve_model, resolve_tokenizer
from tandem.scheduler.models.tensor_parallel import SINGLE, TensorParallel
from tandem.scheduler.models.tiny import cache_root
from tandem.scheduler.models.weight_stream import WeightStream
from tandem.scheduler.models.weight_stream import available as weight_stream_available
from tandem.scheduler.parallel.distributed import RankGroup, StepRelay, per_node, rank_device
from tandem.scheduler.runner.cpu_step import ForwardThreads
from tandem.scheduler.runner.cuda_graph import DecodeGraphRunner
from tandem.scheduler.runner.decode_trace import DecodeTrace
from tandem.scheduler.runner.model_runner import ModelRunner
from tandem.scheduler.runner.timeline import Timeline
from tandem.scheduler.sampling import PenaltyState, Sampler
from tandem.scheduler.schedule.scheduler import Scheduler
from tandem.scheduler.speculative.interface import (
    SpeculativeWorker,
    TargetHandle,
    create_speculative_worker,
)
from tandem.scheduler.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    """What ``wire`` built, as the ``Engine`` uses it."""

    model_path: Path
    """The local model folder ``cfg.model_path`` resolved to (``models.source``)."""
    tokenizer_path: Path
    """The tokenizer's folder: ``cfg.tokenizer_path`` resolved, else ``model_path``."""
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    context_length: int
    forward_threads: ForwardThreads | None
    """Intra-op threads of the CPU forward, per step (None on accelerators)."""
    tokenizer: Tokenizer | None
    """None without tokenizer.json or under ``skip_tokenizer_init``."""
    eos_ids: frozenset[int]
    kv_pool: PagedKVPool
    req_pool: ReqToTokenPool
    attention_backend: str
    stream: Stream
    """The forward stream."""
    spec: SpeculativeWorker | None
    graphs: DecodeGraphRunner | None
    timeline: Timeline
    scheduler: Scheduler
    quantization: str
    """How the weights are held (``EngineConfig.quantization`` resolved)."""
    weights_bytes: int
    """Memory the model's weights take, every copy the forward reads counted once."""
    weight_stream: WeightStream | None = None
    """The thread reading a short step's quantized weights ahead of its products
    (``models.weight_stream``), or None; the engine closes it at shutdown."""


def wire(cfg: EngineConfig, ranks: RankGroup | None = None) -> EngineParts:
    """Resolve the model facts, then build the parts (loading the weights). With
    ``ranks`` (tensor parallelism), this rank's parts: its shard of the model and of
    the KV heads, pools the same size on every rank, and on rank 0 the relay that sends
    each launched step to the others. On the CPU the parts are built on a thread of
    their own (``_on_loader_thread``); the caller's intra-op threads size the forward's;
    and the process's allocator keeps freed memory (``cpu_malloc``) unless
    ``disable_cpu_malloc_tuning``."""
    if ranks is not None:
        device = torch.device(rank_device(cfg, ranks.local_rank) or "cpu")
    else:
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cores = torch.get_num_threads()
    if device.type != "cpu":
        return _wire(cfg, ranks, device, cores)
    if not cfg.disable_cpu_malloc_tuning and not keep_freed_memory():
        log.info("the C library is not glibc: its allocator keeps its own settings")
    return _on_loader_thread(lambda: _wire(cfg, ranks, device, cores))


def _on_loader_thread(build: Callable[[], EngineParts]) -> EngineParts:
    """``build()`` on a new thread of one intra-op thread, which makes no OpenMP pool.

    OpenMP keeps a pool of worker threads for each thread that runs a parallel op. A
    second pool beside the forward stream's (the caller's, made by loading the weights)
    makes libgomp count more threads than cores, so idle workers go to sleep at once and
    every short op of the forward pays their wake-up: with one pool, short ops and whole
    decode steps are faster. Loading on one thread costs start time. (measurements:
    docs/benchmarks.md, Measurements behind the code)"""
    box: dict[str, Any] = {}

    def run() -> None:
        torch.set_num_threads(1)
        try:
            box["parts"] = build()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="tandem-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    parts: EngineParts = box["parts"]
    return parts


def _wire(
    cfg: EngineConfig, ranks: RankGroup | None, device: torch.device, cores: int
) -> EngineParts:
    model_path = resolve_model(cfg.model_path)
    tokenizer_path = resolve_tokenizer(cfg.tokenizer_path, model_path)
    tp = ranks.tp if ranks is not None else SINGLE
    mc = ModelConfig.from_pretrained(model_path)
    dtype = resolve_dtype(cfg.dtype, mc)
    max_pos = mc.max_position_embeddings
    if cfg.context_length is not None and cfg.context_length > max_pos:
        raise ValueError(
            f"context_length={cfg.context_length} exceeds the model's "
            f"max_position_embeddings ({max_pos})"
        )
    context_length = cfg.context_length or max_pos
    local = tp.local_config(mc)
    quantization = _quantization(cfg, model_path, device, tp)
    # Quantized weights need linear_quant; without it they are dequantized at load.
    quant_kernels = quantization != "none" and load_cpu_kernels(cache_root() / "kernels")
    forward_threads = None
    if device.type == "cpu":
        # The ranks of one machine share its cores.
        cores = max(1, cores // per_node(cfg))
        forward_threads = (
            ForwardThreads.fixed(cfg.cpu_forward_threads)
            if cfg.cpu_forward_threads
            else default_forward_threads(local, cores, quant_kernels and quant_kernel())
        )
    tokenizer = _load_tokenizer(tokenizer_path)
    eos_ids = _eos_ids(model_path, mc, tokenizer)

    debug = cfg.debug_futures
    model = load_model(
        None if cfg.load_format == "dummy" else model_path,
        mc,
        dtype=dtype,
        device=device,
        load_format=cfg.load_format,
        seed=cfg.random_seed,
        tp=tp,
        forward_threads=None if forward_threads is None else forward_threads.for_tokens(1),
        quantization=quantization,
        int8_activations=cfg.cpu_int8_activations,
    )
    if device.type == "cpu":
        release_freed_memory()  # the load's temporary buffers, kept by cpu_malloc's settings
    weight_stream = _weight_stream(cfg, model, forward_threads)
    layout = KVLayout(local.num_hidden_layers, local.num_key_value_heads, local.head_dim, dtype)
    pages = _num_pages(cfg, layout, device, context_length)
    if ranks is not None:
        pages = ranks.agree_min(pages)  # rank 0 schedules pages every rank must have
    kv_pool = PagedKVPool(pages, cfg.page_size, layout, device)
    rows = cfg.max_running_requests
    # A speculative step may map and write up to two lookaheads past the context.
    req_pool = ReqToTokenPool(rows, context_length + 2 * cfg.speculative_lookahead, device)
    heads = HeadShape(
        local.num_attention_heads, local.num_key_value_heads, mc.head_dim, mc.head_dim**-0.5, dtype
    )
    backend = cfg.attention_backend or default_backend(device)
    decode_kernel, fused_ops = _cpu_kernels(cfg, backend, device, heads)
    if fused_ops:
        model.use_fused_cpu_ops()
    attention = create_attention_backend(
        backend, kv_pool, req_pool.req_to_token, device, heads,
        debug=debug, triton_interpret=read_env().triton_interpret,
        decode_kernel=decode_kernel,
    )  # fmt: skip
    sampler = Sampler(seed=cfg.random_seed)
    future_map = FutureMap(
        rows, device, debug=debug, compile_checks=cast(CompileChecks, cfg.compile_checks)
    )
    spec = None
    if cfg.speculative:
        target = TargetHandle(
            model, mc, attention, req_pool, kv_pool, future_map, sampler, device, dtype
        )
        spec = create_speculative_worker(cfg, target)
        future_map.declare(*spec.relay_fields)
    graphs = _decode_graphs(cfg, model, attention, device)
    stream = _forward_stream(cfg, device)
    runner = ModelRunner(
        model=model,
        req_pool=req_pool,
        kv_pool=kv_pool,
        attention=attention,
        sampler=sampler,
        penalties=PenaltyState(rows, mc.vocab_size, device),
        future_map=future_map,
        stream=stream,
        spec=spec,
        copy_stream=None if device.type == "cpu" else DeviceStream(device),
        graphs=graphs,
        decode_trace=_decode_trace(cfg, model, attention, device),
        relay=StepRelay(ranks) if ranks is not None and ranks.rank == 0 else None,
        forward_threads=forward_threads,
    )
    scheduler = Scheduler(
        cfg, runner, eos_ids=eos_ids, context_length=context_length, strict_accounting=debug,
        spec_batch_limit=cfg.speculative_batch_limit(device.type),
        spec_gate=not cfg.speculative_disable_adaptive,
    )  # fmt: skip
    if cfg.disaggregation_mode != "null":
        from tandem.scheduler.disagg.side import disaggregate

        disaggregate(cfg, scheduler)
    return EngineParts(
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        model_config=mc,
        device=device,
        dtype=dtype,
        context_length=context_length,
        forward_threads=forward_threads,
        tokenizer=None if cfg.skip_tokenizer_init else tokenizer,
        eos_ids=eos_ids,
        kv_pool=kv_pool,
        req_pool=req_pool,
        attention_backend=backend,
        stream=stream,
        spec=spec,
        graphs=graphs,
        timeline=runner.timeline,
        scheduler=scheduler,
        quantization=quantization,
        weights_bytes=model.weights_bytes(),
        weight_stream=weight_stream,
    )


def _weight_stream(
    cfg: EngineConfig, model: CausalLM, threads: ForwardThreads | None
) -> WeightStream | None:
    """A weight stream over the model's quantized products when a short step leaves a
    core free for it (not under ``disable_cpu_weight_stream``): the steps of fewer
    tokens than a long one tell it where they are. (measurements: docs/benchmarks.md,
    Measurements behind the code)"""
    if threads is None or cfg.disable_cpu_weight_stream or threads.short >= threads.long:
        return None
    products = model.quant_products()
    if not products or not weight_stream_available():
        return None
    return WeightStream(products, rows_below=threads.long_from_tokens)


def _num_pages(
    cfg: EngineConfig, layout: KVLayout, device: torch.device, context_length: int
) -> int:
    tokens = cfg.max_total_tokens
    if tokens is None:
        frac = cfg.mem_fraction_static or (0.05 if device.type == "cpu" else 0.85)
        budget = int(total_memory_bytes(device) * frac) // layout.bytes_per_token
        tokens = min(budget, cfg.max_running_requests * context_length)
    pages = tokens // cfg.page_size + 1  # + the padding page
    if pages < 2:
        raise ValueError(f"max_total_tokens={tokens} leaves no room for a single KV page")
    return pages


def _decode_graphs(
    cfg: EngineConfig, model: CausalLM, attention: AttentionBackend, device: torch.device
) -> DecodeGraphRunner | None:
    """Capture the decode forward in CUDA graphs, unless disabled or impossible
    (not CUDA, a backend that cannot be captured, speculative decoding)."""
    if device.type != "cuda" or cfg.disable_cuda_graph or cfg.speculative or cfg.tp_size > 1:
        return None
    if not attention.supports_cuda_graph:
        log.info(
            "no CUDA graphs: the %s attention backend cannot be captured",
            type(attention).__name__,
        )
        return None
    max_bs = min(cfg.cuda_graph_max_bs or 256, cfg.max_running_requests)
    graphs = DecodeGraphRunner(model, attention, device, max_bs)
    graphs.capture()
    return graphs


LONG_TOKEN_WEIGHTS = 16_000_000
"""Weights per token from which every CPU step is long: its forward runs on every core
(see ``default_forward_threads``)."""
LONG_STEP_WEIGHTS = 1_000_000_000
"""Below ``LONG_TOKEN_WEIGHTS``, the weights a step multiplies by (its tokens times the
weights per token) from which it is long all the same: a prefill's, not a decode's."""
INT8_LONG_FROM_TOKENS = 4
"""With the weights kept quantized and multiplied by int8 dot products, a step of fewer
tokens is short whatever the model's size, a step of this many long (at the latest)."""


def default_forward_threads(
    mc: ModelConfig, cores: int, int8_products: bool = False
) -> ForwardThreads:
    """Intra-op threads of the CPU forward when ``cpu_forward_threads`` is not given:
    every core for a long step, one fewer (at least 1) for a short one.

    A short step's forward is a chain of short calls, as long as the host's work per
    step: it runs on one core fewer, leaving the scheduler thread a core of its own to
    overlap with. A long step's forward is long matrix products beside which the host's
    work is a small share, and it takes every core: the scheduler thread preempts it
    only for that share. The host's work grows with the step's requests (and, served,
    so does the work of the HTTP process and the clients on the same cores), the
    forward's with its tokens times the model's weights per token: a model of at least
    ``LONG_TOKEN_WEIGHTS`` per token has only long steps, a smaller one long prefills
    (``LONG_STEP_WEIGHTS``). A small model's decode step is faster on every core in
    process, but served, beside the HTTP process and the clients, it is faster on one
    core fewer.

    ``int8_products``: the weights stay quantized and are multiplied by int8 dot products
    (``kernels/cpu_quant.cpp``). A decode step of a request or two is then short at any
    model size (``INT8_LONG_FROM_TOKENS``): each product reads a few bits a weight and is
    bound by that and by its call, which a second thread barely shortens, while from a
    few tokens on the int8 arithmetic grows with the tokens and every core shares it.
    (measurements: docs/benchmarks.md, Measurements behind the code)"""
    weights = max(1, mc.matmul_weights_per_token)
    tokens = 1 if weights >= LONG_TOKEN_WEIGHTS else -(-LONG_STEP_WEIGHTS // weights)
    if int8_products:
        tokens = max(tokens, INT8_LONG_FROM_TOKENS)
    return ForwardThreads(short=max(1, cores - 1), long=cores, long_from_tokens=tokens)


def _forward_stream(cfg: EngineConfig, device: torch.device) -> Stream:
    """The forward stream. On the CPU, ``CpuStep`` sets its worker thread's intra-op
    threads (a per-thread setting: the caller's threads keep theirs)."""
    return create_stream(
        device,
        name="tandem-forward",
        max_delay_s=cfg.host_stream_max_delay_ms / 1000.0,
        seed=cfg.host_stream_seed,
    )


def _quantization(
    cfg: EngineConfig, model_path: Path | str, device: torch.device, tp: TensorParallel
) -> str:
    """``cfg.quantization``, or by default ``gguf`` for a GGUF file served on one CPU
    rank (its blocks stay quantized), else ``none``."""
    if cfg.quantization is not None:
        return cfg.quantization
    gguf = cfg.load_format in ("auto", "gguf") and is_gguf_folder(Path(model_path))
    return "gguf" if gguf and device.type == "cpu" and tp.size == 1 else "none"


def _cpu_kernels(
    cfg: EngineConfig, backend: str, device: torch.device, heads: HeadShape
) -> tuple[bool, bool]:
    """Which of tandem's C++ CPU kernels (``kernels.cpu_build``, built on the first
    start on a machine) the forward uses: the decode attention (the ``torch`` backend;
    float32; bfloat16 with AVX512-BF16 for heads its bfloat16 path takes, and otherwise
    the float32 kernel over widened operands) unless
    ``disable_cpu_decode_kernel``, and the model's fused element-wise ops (float32 or
    bfloat16; with them, float32 products for one or two tokens) unless
    ``disable_cpu_fused_ops``. Neither off the CPU, nor where the
    kernels cannot be built."""
    if device.type != "cpu":
        return False, False
    dtype = heads.dtype
    decode = not cfg.disable_cpu_decode_kernel and backend == "torch"
    decode = decode and dtype in (torch.float32, torch.bfloat16)
    fused = not cfg.disable_cpu_fused_ops and dtype in (torch.float32, torch.bfloat16)
    if not (decode or fused) or not load_cpu_kernels(cache_root() / "kernels"):
        return False, False
    return decode, fused


def _decode_trace(
    cfg: EngineConfig, model: CausalLM, attention: AttentionBackend, device: torch.device
) -> DecodeTrace | None:
    """The CPU decode trace, unless disabled or of no use: it replays the plain decode
    steps that continue a ``torch`` backend's decode stage, which exist on the CPU only
    (a speculative engine's too, once speculation turns off), not speculative steps;
    nor a sharded model's (the trace cannot record its collectives)."""
    if cfg.disable_decode_trace or device.type != "cpu" or cfg.tp_size > 1:
        return None
    if not isinstance(attention, TorchAttention) or not attention.decode_stage:
        return None
    return DecodeTrace(model, attention)


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

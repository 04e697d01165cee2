"""Prefill/decode disaggregation behind the SGLang Model Gateway, benchmarked against one
plain ``tandem serve`` on the same machine.

Starts a prefill server (``tandem serve --device cpu --disaggregation-mode prefill
--disaggregation-bootstrap-port B``; the tiny test model unless ``--worker-args`` names
another with ``--model-path``) and a decode server (``--disaggregation-mode
decode``), both with ``--transfer-backend`` (``mooncake`` by default, or ``torch``), on
free loopback ports, then ``smg launch --pd-disaggregation --prefill URL B --decode
URL`` in front of them; waits until both answer ``/health`` and the gateway counts them
healthy (``--timeout`` bounds each wait); runs ``tandem bench serve`` through the
gateway; stops them; then runs the same workload against one plain server and prints
both reports, and TTFT, TPOT and throughput side by side. Every process it started is
stopped, also on Ctrl+C, SIGTERM and failures. Needs ``smg`` and, for ``mooncake``,
``mooncake-transfer-engine-non-cuda``; ``nox -s pd`` installs both and runs this.
Arguments after ``--`` go to ``tandem bench serve`` (default: ``--num-prompts 64
--random-input-len 128 --random-output-len 32``), with ``--endpoint chat`` unless they
name an endpoint: in PD mode ``smg`` parses ``/v1/completions`` bodies and refuses
token-id prompts, which ``tandem bench serve`` sends there::

    python tools/pd_bench.py
    python tools/pd_bench.py --transfer-backend torch -- --num-prompts 128

On one machine the two halves share its cores (each gets half of them unless
``--worker-args`` sets ``--cpu-forward-threads``) while the plain server has them all:
the comparison shows what the hand-over costs, not what a second machine would bring.
docs/guides/disaggregation.md explains the setup; ``pd_fleet`` is also what
packages/server/tests/test_disaggregation_gateway.py runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The sibling script, importable from this folder when this one is loaded by its path.
from gateway_bench import (
    DEFAULT_BENCH,
    Started,
    _start,
    free_port,
    launched,
    serve_command,
    start_gateway,
    wait_healthy,
)

TRANSFER_BACKENDS = ("mooncake", "torch")  # tandem.scheduler.config.TRANSFER_BACKENDS


@dataclass
class PDFleet:
    """The gateway, the prefill server and the decode server behind it."""

    url: str
    """The gateway's base URL."""
    prefill_url: str
    decode_url: str
    bootstrap_port: int
    processes: list[Started] = field(default_factory=list)

    @property
    def worker_urls(self) -> list[str]:
        return [self.prefill_url, self.decode_url]


@contextlib.contextmanager
def pd_fleet(
    transfer_backend: str = "mooncake",
    worker_args: Sequence[str] = (),
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    smg_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    logs: Path | None = None,
) -> Iterator[PDFleet]:
    """A prefill and a decode CPU ``tandem serve`` behind ``smg launch
    --pd-disaggregation``, all on loopback, ready to route; every one of them stopped on
    the way out (the gateway first).

    ``worker_args`` go to both servers, ``prefill_args`` and ``decode_args`` to one;
    ``env`` is their environment (default: this process's); ``logs`` the folder of each
    process's output (default: a temporary one, removed afterwards).
    """
    env = dict(os.environ if env is None else env)
    with launched("smg-pd-", logs) as (folder, processes):
        bootstrap = free_port()
        prefill_port, decode_port = free_port(), free_port()
        common = ("--disaggregation-transfer-backend", transfer_backend, *worker_args)
        prefill = serve_command(
            prefill_port, "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(bootstrap), *common, *prefill_args,
        )  # fmt: skip
        decode_mode = ("--disaggregation-mode", "decode")
        decode = serve_command(decode_port, *decode_mode, *common, *decode_args)
        processes.append(_start("prefill", prefill, folder, env))
        processes.append(_start("decode", decode, folder, env))
        urls = [f"http://127.0.0.1:{port}" for port in (prefill_port, decode_port)]
        wait_healthy(urls, processes, timeout_s)
        routing = ["--pd-disaggregation", "--prefill", urls[0], str(bootstrap)]
        routing += ["--decode", urls[1]]
        url = start_gateway(routing, 2, smg_args, processes, folder, env, timeout_s)
        yield PDFleet(url, urls[0], urls[1], bootstrap, processes)


@contextlib.contextmanager
def plain_server(
    worker_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    logs: Path | None = None,
) -> Iterator[str]:
    """One CPU ``tandem serve`` (no disaggregation) on loopback: its base URL."""
    env = dict(os.environ if env is None else env)
    with launched("plain-", logs) as (folder, processes):
        port = free_port()
        processes.append(_start("plain", serve_command(port, *worker_args), folder, env))
        url = f"http://127.0.0.1:{port}"
        wait_healthy([url], processes, timeout_s)
        yield url


# -- the comparison ------------------------------------------------------------------------------
_COMPARED = (
    ("completed", "Successful requests", "{:.0f}"),
    ("failed", "Failed requests", "{:.0f}"),
    ("duration_s", "Benchmark duration (s)", "{:.2f}"),
    ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
    ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
    ("total_throughput", "Total token throughput (tok/s)", "{:.2f}"),
    ("mean_ttft_ms", "Mean TTFT (ms)", "{:.2f}"),
    ("median_ttft_ms", "Median TTFT (ms)", "{:.2f}"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "{:.2f}"),
    ("mean_tpot_ms", "Mean TPOT (ms)", "{:.2f}"),
    ("median_tpot_ms", "Median TPOT (ms)", "{:.2f}"),
    ("p99_tpot_ms", "P99 TPOT (ms)", "{:.2f}"),
    ("mean_itl_ms", "Mean ITL (ms)", "{:.2f}"),
    ("mean_e2e_latency_ms", "Mean E2E latency (ms)", "{:.2f}"),
)


def side_by_side(pd: Mapping[str, Any], plain: Mapping[str, Any]) -> str:
    """The two runs' figures in columns, with their ratio."""
    lines = [f"{'':<36s}{'PD via smg':>14s}{'plain':>14s}{'PD / plain':>12s}"]
    for key, label, fmt in _COMPARED:
        a, b = pd.get(key), plain.get(key)
        shown = ["-" if v is None else fmt.format(v) for v in (a, b)]
        ratio = (
            f"{a / b:.2f}"
            if isinstance(a, int | float) and isinstance(b, int | float) and b
            else "-"
        )
        lines.append(f"{label:<36s}{shown[0]:>14s}{shown[1]:>14s}{ratio:>12s}")
    return "\n".join(lines)


def _bench(
    url: str, bench_args: Sequence[str], tokenizer: str, out: Path
) -> tuple[int, dict[str, Any]]:
    """``tandem bench serve`` against ``url``: its exit code and figures."""
    from tandem.server.bench import serve as bench_serve

    args = ["--base-url", url, *bench_args, "--output-json", str(out)]
    if _flag_value(bench_args, "--endpoint") is None:
        args += ["--endpoint", "chat"]
    if "--tokenizer-path" not in bench_args:
        # Both runs build the same workload: through the gateway the model list does not
        # say it is tandem's, which would leave the bench without a tokenizer.
        args += ["--tokenizer-path", tokenizer]
    code = bench_serve.main(args)
    figures = json.loads(out.read_text()) if out.exists() else {}
    return code, figures


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, bench_args = argv[:cut], argv[cut + 1 :] or list(DEFAULT_BENCH)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--transfer-backend", choices=TRANSFER_BACKENDS, default="mooncake",
        help="what moves the KV between the two servers (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-args", default="",
        help='more `tandem serve` flags for all three servers, one string ("--page-size 16")',
    )  # fmt: skip
    parser.add_argument("--prefill-args", default="", help="more flags of the prefill server")
    parser.add_argument("--decode-args", default="", help="more flags of the decode server")
    parser.add_argument("--smg-args", default="", help="more `smg launch` flags, one string")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds each startup wait may take (300)"
    )
    args = parser.parse_args(ours)
    worker_args = shlex.split(args.worker_args)
    model = _flag_value(worker_args, "--model-path")
    if model is None:
        from tandem.scheduler.models.tiny import tiny_model_path

        # The tiny test model, built here once before three servers would build it.
        model = str(tiny_model_path())
        worker_args += ["--model-path", "tandem-tiny"]
    pd_args = list(worker_args)
    if _flag_value(worker_args, "--cpu-forward-threads") is None:
        pd_args += ["--cpu-forward-threads", str(max(1, (os.cpu_count() or 1) // 2))]
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        with pd_fleet(
            args.transfer_backend, pd_args, shlex.split(args.prefill_args),
            shlex.split(args.decode_args), shlex.split(args.smg_args), timeout_s=args.timeout,
        ) as fleet:  # fmt: skip
            print(
                f"smg --pd-disaggregation at {fleet.url} -> prefill {fleet.prefill_url} "
                f"(bootstrap port {fleet.bootstrap_port}), decode {fleet.decode_url}, "
                f"KV over {args.transfer_backend}",
                flush=True,
            )
            pd_code, pd = _bench(fleet.url, bench_args, model, Path(tmp) / "pd.json")
        with plain_server(worker_args, timeout_s=args.timeout) as url:
            print(f"plain tandem serve at {url}", flush=True)
            plain_code, plain = _bench(url, bench_args, model, Path(tmp) / "plain.json")
    print()
    print(side_by_side(pd, plain))
    return pd_code or plain_code


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl+C, so the processes started here are stopped either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())

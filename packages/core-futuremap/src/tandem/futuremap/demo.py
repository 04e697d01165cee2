"""A runnable demonstration of the FutureMap protocol on the CPU host stream.

A toy "model" (a few real matrix products, so torch releases the GIL, then a
deterministic next-token rule) decodes a handful of requests twice: with the normal
loop (launch, wait, process) and with the overlap loop (launch N+1, then process N).
The demo checks that both produce the same tokens and prints how long each took.
Decode inputs come from the FutureMap on the forward stream; the host never reads it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.futuremap.future_map import FutureMap
from tandem.futuremap.runtime import Event, Stream, Work, create_stream


@dataclass
class DemoRequest:
    """One request of the demo: its row, prompt token and length budget."""

    row: int
    prompt_token: int
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    scheduled: int = 0  # decode steps launched (the host's view, one step ahead)

    def wants_step(self) -> bool:
        return self.scheduled < self.max_new_tokens


@dataclass
class ToyModel:
    """Burns ``work`` matrix products per forward and maps each token to the next."""

    vocab: int = 1000
    work: int = 4
    dim: int = 256
    weight: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.randn(self.dim, self.dim, generator=gen) / self.dim**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = torch.ones(input_ids.numel(), self.dim)
        for _ in range(self.work):
            x = torch.tanh(x @ self.weight)
        return (input_ids * 31 + 7 + (x[:, 0] > 2).long()) % self.vocab


@dataclass
class Launched:
    """A batch in flight: its requests, the work that yields the host copy of its
    tokens, and the copy-done event the host waits on before reading that copy."""

    requests: list[DemoRequest]
    work: Work[torch.Tensor]
    copy_done: Event


def _forward_step(
    model: ToyModel, fmap: FutureMap, rows: torch.Tensor, prefill: torch.Tensor | None
) -> torch.Tensor:
    # Runs on the forward stream: resolve, forward, stash, copy to host.
    input_ids = prefill if prefill is not None else fmap.resolve_tokens(rows)
    tokens = model.forward(input_ids)
    fmap.stash(rows, tokens)
    return tokens.to("cpu", non_blocking=True)


def _launch(
    stream: Stream, model: ToyModel, fmap: FutureMap, batch: list[DemoRequest], first: bool
) -> Launched:
    rows = torch.tensor([r.row for r in batch], dtype=torch.int64)
    prefill = torch.tensor([r.prompt_token for r in batch]) if first else None
    for req in batch:
        req.scheduled += 1
    work = stream.submit(_forward_step, model, fmap, rows, prefill)
    return Launched(batch, work, stream.record_event())


def _process(launched: Launched) -> None:
    launched.copy_done.synchronize()
    tokens = launched.work.result().tolist()
    for req, token in zip(launched.requests, tokens, strict=True):
        req.output.append(int(token))


def run_loop(
    requests: Sequence[DemoRequest], model: ToyModel, stream: Stream, *, overlap: bool
) -> float:
    """Decode every request to its budget; return the wall time in seconds."""
    fmap = FutureMap(num_rows=len(requests), device="cpu")
    start = time.perf_counter()
    previous: Launched | None = None
    first = True
    while True:
        batch = [r for r in requests if r.wants_step()]
        launched = _launch(stream, model, fmap, batch, first) if batch else None
        first = False
        if not overlap and launched is not None:
            _process(launched)
            launched = None
        if previous is not None:
            _process(previous)
        previous = launched
        if launched is None and not batch:
            break
    stream.synchronize()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m tandem.futuremap``."""
    parser = argparse.ArgumentParser(prog="python -m tandem.futuremap", description=__doc__)
    parser.add_argument("--requests", type=int, default=8, help="number of requests")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--work", type=int, default=8, help="matrix products per forward")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_new_tokens < 1 or args.work < 0:
        parser.error("--requests and --max-new-tokens must be >= 1, --work >= 0")

    def fresh() -> list[DemoRequest]:
        return [
            DemoRequest(row=i + 1, prompt_token=i, max_new_tokens=args.max_new_tokens - i % 3)
            for i in range(args.requests)
        ]

    model = ToyModel(work=args.work)
    stream = create_stream("cpu", name="tandem-demo-forward")
    normal, overlap = fresh(), fresh()
    t_normal = run_loop(normal, model, stream, overlap=False)
    t_overlap = run_loop(overlap, model, stream, overlap=True)
    same = [r.output for r in normal] == [r.output for r in overlap]
    print(f"requests: {args.requests}, tokens: {sum(len(r.output) for r in overlap)}")
    print(f"normal loop:  {t_normal * 1000:8.1f} ms")
    print(f"overlap loop: {t_overlap * 1000:8.1f} ms")
    print(f"identical tokens: {same}")
    print(f"first request: {overlap[0].output[:8]} ...")
    return 0 if same else 1

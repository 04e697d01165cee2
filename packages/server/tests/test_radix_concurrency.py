"""Repeated prompts through the live server (radix cache on) get their first answers.

A repeated prompt matches all but its last token from the radix cache, so its prefill
is a one-token extend. Such a step once "continued" the CPU decode stage of the request
that had just left the same request-pool row, when that request's last decode step was
one token short of the prompt (prompt lengths differing by exactly ``max_new_tokens``),
and attended over the other request's K/V: wrong tokens from then on.

Each test starts a server and sends distinct prompts one at a time (their first answers,
checked against transformers' greedy tokens); then, for every pair of prompt lengths
``MAX_NEW`` apart, the longer prompt, the shorter one and the longer one again (the
reported sequence); then bursts of concurrent repeats of random subsets. Greedy, every
repeat must give its first answer. Both loops; a roomy KV pool (with two request rows, so
that bursts queue, or with 64) and a pool small enough that the bursts evict the cache and
retract requests; the tiny test model (tandem-tiny) and a tiny Qwen3 checkpoint.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server, metric, metric_at_least

from tandem.scheduler.models.tiny import default_model_path

MAX_NEW = 16
TIE = 1e-4  # a token within this of the best reference logit is an honest greedy pick
# Chains of lengths MAX_NEW apart (33 -> 49 is the reported case), one of them nested
# prefixes of a single sequence (partial radix hits, node splits), and loose lengths.
CHAINS = ((5, 21, 37, 53, 69, 85), (9, 25, 41, 57, 73, 89), (17, 33, 49, 65, 81, 97))
NESTED = (12, 28, 44, 60)
LOOSE = (1, 2, 30, 46, 62, 100)
ROUNDS = 5
ROOMY = 4096  # KV tokens: room for every prompt and answer at once
SMALL = 320  # KV tokens: a burst fills the pool, evicting the cache and retracting requests


def _make_prompts() -> list[list[int]]:
    rng = random.Random(20240917)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(n)]  # no bos/eos/pad ids

    prompts = [draw(n) for chain in CHAINS for n in chain]
    base = draw(max(NESTED))
    prompts += [base[:n] for n in NESTED]
    prompts += [draw(n) for n in LOOSE]
    assert len({len(p) for p in prompts}) == len(prompts)  # distinct prompts, distinct lengths
    return prompts


PROMPTS = _make_prompts()
# (shorter, longer) prompts whose lengths differ by exactly MAX_NEW
PAIRS = [
    (short, long)
    for long in range(len(PROMPTS))
    for short in range(len(PROMPTS))
    if len(PROMPTS[long]) - len(PROMPTS[short]) == MAX_NEW
]


def _import_reference_models() -> ModuleType:
    """The scheduler tests' tiny checkpoints, imported by location (importlib mode)."""
    path = Path(__file__).parents[2] / "scheduler" / "tests" / "reference_models.py"
    spec = importlib.util.spec_from_file_location("tandem_server_tests_reference_models", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Reference:
    """A servable checkpoint, transformers' float32 model of it and its greedy answers."""

    path: Path
    model: torch.nn.Module
    greedy: list[list[int]]

    def mismatch(self, i: int, expected: list[int], got: list[int]) -> tuple[int, list[float]]:
        """Where ``got`` leaves ``expected`` and the reference margins of ``got`` (how far
        each token is below the best logit, teacher-forced on ``got`` itself); step -1
        when ``got`` is acceptable: equal, or split at an honest near-tie and greedy on."""
        if got == expected:
            return -1, []
        j = next(k for k, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
        ids = torch.tensor([PROMPTS[i] + got[:-1]])
        with _one_thread(), torch.no_grad():
            logits = self.model(ids).logits[0, len(PROMPTS[i]) - 1 :].float()
        picked = logits.gather(1, torch.tensor(got).unsqueeze(1)).squeeze(1)
        margins = (logits.max(dim=1).values - picked).tolist()
        return (-1 if max(margins[j:]) <= TIE else j), margins


@contextmanager
def _one_thread() -> Iterator[None]:
    """The tiny reference model's many small ops on one thread: several times faster
    than on two when the machine is busy (beside the server, or under xdist)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(  # type: ignore[operator]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
        min_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    """Filled lazily, a family at a time, for the module's tests on this worker."""
    return {}


def _reference(family: str, references: dict[str, Reference], cache_dir: Path) -> Reference:
    if family not in references:
        models = _import_reference_models()
        if family == "tiny":
            path = default_model_path(cache_dir)  # the server's, with TANDEM_CACHE_DIR
        else:
            path = models.make_family(family, cache_dir / family, seed=7, kv_ratio=2)
        model = models.load_reference(path)
        with _one_thread():
            greedy = [_hf_greedy(model, p) for p in PROMPTS]
        references[family] = Reference(path, model, greedy)
    return references[family]


def _body(ids: list[int]) -> dict[str, Any]:
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": params}


def _answer(response: httpx.Response, i: int) -> tuple[list[int], int]:
    """The output ids and cached prompt tokens of a finished request for prompt ``i``."""
    assert response.status_code == 200, f"{_describe(i)}: {response.text}"
    out = response.json()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}, meta
    assert meta["prompt_tokens"] == len(PROMPTS[i]), meta
    assert len(out["output_ids"]) == MAX_NEW, out
    return list(out["output_ids"]), int(meta["cached_tokens"])


def _generate(server: LiveServer, i: int) -> tuple[list[int], int]:
    return _answer(httpx.post(f"{server.url}/generate", json=_body(PROMPTS[i]), timeout=60), i)


def _burst(server: LiveServer, picks: list[int]) -> list[tuple[list[int], int]]:
    """Every prompt of ``picks`` at once, each on its own connection."""

    async def main() -> list[tuple[list[int], int]]:
        limits = httpx.Limits(max_connections=len(picks), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

            async def one(i: int) -> tuple[list[int], int]:
                return _answer(await client.post("/generate", json=_body(PROMPTS[i])), i)

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in picks)), 120)

    return asyncio.run(main())


def _describe(i: int) -> str:
    return f"prompt #{i} (len {len(PROMPTS[i])}, starts {PROMPTS[i][:4]})"


def _compare(
    ref: Reference, i: int, expected: list[int], got: list[int], what: tuple[str, str, str]
) -> str:
    """'' when ``got`` is an acceptable ``expected``, else the failure's description;
    ``what``: where it happened, and the names of the expected and of the got tokens."""
    step, margins = ref.mismatch(i, expected, got)
    if step < 0:
        return ""
    where, expected_name, got_name = what
    width = max(len(expected_name), len(got_name)) + 1
    return (
        f"{_describe(i)}, {where}: differs at step {step}\n"
        f"  {expected_name + ':':{width}} {expected}\n  {got_name + ':':{width}} {got}\n"
        f"  transformers' margins of the {got_name} tokens: {[round(m, 4) for m in margins]}"
    )


def _assert_none(failures: list[str], title: str) -> None:
    failures = [f for f in failures if f]
    assert not failures, f"{title}:\n" + "\n".join(failures)


def _healthy(server: LiveServer, where: str) -> None:
    assert server.proc.poll() is None, f"the server exited ({server.proc.returncode}) {where}"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, where


def _wait_idle(server: LiveServer, rows: int, timeout_s: float = 20.0) -> None:
    """Every row, KV token and API slot back (the engine's figures reach /metrics a few
    times a second, so this polls)."""
    want = {
        "tandem_num_running_requests": 0.0,
        "tandem_num_queued_requests": 0.0,
        "tandem_kv_used_tokens": 0.0,
        "tandem_inflight_requests": 0.0,
        "tandem_free_request_rows": float(rows),
    }
    deadline = time.monotonic() + timeout_s
    while (seen := {name: metric(server.url, name) for name in want}) != want:
        assert time.monotonic() < deadline, f"resources did not come back: {seen}"
        time.sleep(0.1)


# Each loop with each pool, each family with each loop and each pool. Request rows: with
# two, a burst queues and is admitted a request or two at a time, each onto a row another
# just left (as in the reported failure); with 64 the whole burst runs as one batch.
CONFIGS = [
    pytest.param("tiny", False, ROOMY, 2, id="tiny-normal-2-rows"),
    pytest.param("tiny", True, SMALL, 16, id="tiny-overlap-small-pool"),
    pytest.param("qwen3", True, ROOMY, 64, id="qwen3-overlap-64-rows"),
    pytest.param("qwen3", False, SMALL, 16, id="qwen3-normal-small-pool"),
]


@pytest.mark.parametrize(("family", "overlap", "tokens", "rows"), CONFIGS)
def test_repeated_prompts_get_their_first_answers(
    references: dict[str, Reference],
    cache_dir: Path,
    family: str,
    overlap: bool,
    tokens: int,
    rows: int,
) -> None:
    ref = _reference(family, references, cache_dir)
    args = ["--dtype", "float32", "--max-total-tokens", str(tokens)]
    args += ["--max-running-requests", str(rows)]
    if family != "tiny":
        args += ["--model-path", str(ref.path)]
    if not overlap:
        args.append("--disable-overlap-schedule")
    small_pool = tokens == SMALL
    rng = random.Random(f"{family}-{overlap}-{tokens}-{rows}")
    with live_server(cache_dir, *args) as server:
        # Every prompt once, one at a time: the first answers.
        order = rng.sample(range(len(PROMPTS)), len(PROMPTS))
        first = {i: _generate(server, i)[0] for i in order}
        names = ("first answer", "transformers", "tandem")
        checks = [_compare(ref, i, ref.greedy[i], first[i], names) for i in order]
        _assert_none(checks, "first answers that are not transformers' greedy tokens")

        # The reported sequence for every pair of lengths MAX_NEW apart: the longer
        # prompt (so that it is cached, even in the small pool), the shorter one, whose
        # last decode step is one token short of the longer one, then the longer one
        # again, admitted on the row the shorter one just left.
        checks, previous = [], order[-1]
        for i in (i for pair in PAIRS for i in (pair[1], pair[0], pair[1])):
            again, _ = _generate(server, i)
            where = f"sequential repeat right after #{previous} (len {len(PROMPTS[previous])})"
            checks.append(_compare(ref, i, first[i], again, (where, "first", "repeated")))
            previous = i
        _assert_none(checks, "repeats that differ from the first answers")
        _healthy(server, "after the sequential repeats")

        # Bursts: a random subset at once, a couple of prompts twice.
        hits = short = 0  # repeats with a cached prefix / with less than all but one token
        for round_ in range(ROUNDS):
            picks = rng.sample(range(len(PROMPTS)), rng.randint(8, len(PROMPTS)))
            picks += rng.sample(picks, 2)
            where = f"burst round {round_} ({len(picks)} requests at once)"
            answers = list(zip(picks, _burst(server, picks), strict=True))
            checks = [
                _compare(ref, i, first[i], again, (where, "first", "repeated"))
                for i, (again, _) in answers
            ]
            _assert_none(checks, "repeats that differ from the first answers")
            for i, (_, cached) in answers:
                if not small_pool:  # nothing evicted: all but the last token are cached
                    assert cached == len(PROMPTS[i]) - 1, f"{_describe(i)}, {where}: {cached=}"
                hits += cached > 0
                short += cached < len(PROMPTS[i]) - 1
            _healthy(server, f"after {where}")
        assert hits > 0, "no repeat was served from the radix cache"

        _wait_idle(server, rows)
        retracted_name = "tandem_retracted_requests_total"
        if small_pool:
            assert metric_at_least(server.url, retracted_name, 1) >= 1, "nothing was retracted"
            assert short > 0, "the small KV pool never evicted a repeated prompt's prefix"
        else:
            assert metric(server.url, retracted_name) == 0

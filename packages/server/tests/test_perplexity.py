"""``tandem bench perplexity``: the sliding-window scoring (``tandem.server.bench.perplexity``)
against a direct computation of Hugging Face's method, and the command end to end on
the tiny model against transformers' own logits."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tandem.scheduler.models.tiny import default_model_path
from tandem.server.bench import perplexity
from tandem.server.bench.perplexity import Window, sliding_window_nll, windows

TEXT = (
    "Once upon a time there was a little house in the middle of a green forest, and in the "
    "house there lived an old man with his cat and his dog. Every morning the old man went "
    "out to the river to get water, and every evening he sat by the fire and told stories "
    "to the cat and the dog, who listened to every word he said. "
)


def _toy_logprob(context: Sequence[int], token: int) -> float:
    """A made-up model whose logprob depends on the token and on how much context it
    sees, so that a window scoring a token with the wrong context is caught."""
    return -(1.0 + 0.1 * token + 0.01 * len(context) + 0.001 * sum(context[-2:]))


def _toy_scorer(chunks: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
    return [
        [_toy_logprob(chunk[:i], chunk[i]) for i in range(start, len(chunk))]
        for chunk, start in zip(chunks, starts, strict=True)
    ]


def _direct(ids: Sequence[int], window: int, stride: int) -> tuple[float, int]:
    """Hugging Face's loop, literally: per window, labels masked (None) but for the last
    ``end - previous_end``, each position predicting the next label; the loss summed
    over exactly the labels scored."""
    nll, count, previous_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target = end - previous_end
        span = list(ids[begin:end])
        labels = [None] * (len(span) - target) + span[len(span) - target :]
        for i in range(len(span) - 1):
            label = labels[i + 1]
            if label is not None:
                nll -= _toy_logprob(span[: i + 1], label)
                count += 1
        previous_end = end
        if end == len(ids):
            break
    return nll, count


@pytest.mark.parametrize(
    ("length", "window", "stride"),
    [(50, 16, 8), (50, 16, 16), (50, 16, 5), (17, 16, 8), (16, 16, 8), (10, 32, 16), (2, 2, 1),
     (101, 7, 3)],
)  # fmt: skip
def test_sliding_window_matches_the_direct_computation(
    length: int, window: int, stride: int
) -> None:
    ids = [(7 * i + 3) % 50 for i in range(length)]
    result = sliding_window_nll(ids, window, stride, _toy_scorer)
    nll, count = _direct(ids, window, stride)
    assert result.tokens == count
    assert result.nll == pytest.approx(nll, rel=1e-12)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-12)
    spans = windows(length, window, stride)
    assert result.windows == len(spans)
    # Every token after the first scored once (and a window's first only with context).
    scored = [p for w in spans for p in range(w.first_scored, w.end)]
    if stride < window:
        assert scored == list(range(1, length))
    else:
        assert len(set(scored)) == len(scored)
        assert all(w.first_scored > w.begin for w in spans)


def test_windows_layout() -> None:
    assert windows(10, 4, 2) == [
        Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)
    ]  # fmt: skip
    assert windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    assert windows(3, 8, 4) == [Window(0, 3, 1)]


@pytest.mark.parametrize(
    ("args", "match"),
    [((1, 4, 2), "at least 2 tokens"), ((10, 1, 1), "window must be at least 2"),
     ((10, 4, 5), "stride must be in"), ((10, 4, 0), "stride must be in")],
)  # fmt: skip
def test_bad_windows_are_refused(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        windows(*args)


def test_a_scorer_returning_the_wrong_count_is_caught() -> None:
    with pytest.raises(ValueError, match="returned 1 logprobs for 3 tokens"):
        sliding_window_nll([1, 2, 3, 4], 4, 2, lambda chunks, starts: [[0.0]])


def _transformers_nll(
    path: Path, ids: list[int], window: int, stride: int, **load: str
) -> tuple[float, int]:
    """The same windows through transformers' own float32 model: each window's logits,
    log-softmax, summed over the tokens that window scores. ``load``: more arguments of
    ``from_pretrained`` (``gguf_file``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **load
    ).eval()
    nll, count = 0.0, 0
    for w in windows(len(ids), window, stride):
        span = torch.tensor([ids[w.begin : w.end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(span).logits[0].float(), dim=-1)
        for p in range(w.first_scored, w.end):
            nll -= logprobs[p - w.begin - 1, ids[p]].item()
            count += 1
    return nll, count


def test_the_command_equals_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tandem bench perplexity --json`` on the tiny model, against transformers."""
    from tandem.scheduler.text.tokenizer import Tokenizer

    path = default_model_path(tmp_path)
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT * 2, encoding="utf-8")
    argv = [
        "--text-file", str(text_file), "--model-path", str(path), "--device", "cpu",
        "--dtype", "float32", "--window", "48", "--stride", "20", "--json",
    ]  # fmt: skip
    assert perplexity.main(argv) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = Tokenizer.from_pretrained(path).encode(TEXT * 2)
    assert len(ids) > 150
    nll, count = _transformers_nll(path, ids, 48, 20)
    assert figures["tokens"] == count == len(ids) - 1
    assert figures["text_tokens"] == len(ids)
    assert figures["windows"] == len(windows(len(ids), 48, 20))
    assert (figures["window"], figures["stride"]) == (48, 20)
    assert figures["mean_nll"] == pytest.approx(nll / count, abs=1e-5)
    assert figures["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_the_command_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through ``tandem``'s own entry point, which hands ``bench perplexity`` over."""
    from tandem.server import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "perplexity", "--text-file", str(tmp_path / "missing.txt")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "tandem bench perplexity" in err
    assert "argument --text-file: cannot read" in err


def test_the_real_models_perplexity_equals_transformers_reading_the_same_gguf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default model (SmolLM2-135M-Instruct's Q4_1 GGUF), the command against
    transformers dequantizing the same file: within 1e-3 relative."""
    from tandem.scheduler.models.fetch import default_model_file
    from tandem.scheduler.models.source import resolve_model
    from tandem.scheduler.text.tokenizer import Tokenizer

    gguf = default_model_file()
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT * 3, encoding="utf-8")
    argv = [
        "--text-file", str(text_file), "--model-path", str(gguf), "--device", "cpu",
        "--dtype", "float32", "--window", "96", "--stride", "48", "--json",
    ]  # fmt: skip
    assert perplexity.main(argv) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = Tokenizer.from_pretrained(resolve_model(str(gguf))).encode(TEXT * 3)
    assert len(ids) > 150
    nll, count = _transformers_nll(gguf.parent, ids, 96, 48, gguf_file=gguf.name)
    assert figures["tokens"] == count == len(ids) - 1
    assert figures["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-3)


def test_both_bench_commands_take_the_weights_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--quantization`` and ``--cpu-int8-activations`` reach the engine, as `tandem
    serve` takes them: a quantization it does not know is refused naming it."""
    from tandem.server.bench import offline

    given = ["--quantization", "int8", "--cpu-int8-activations"]
    parsed = (
        offline.build_parser().parse_args(given),
        perplexity.build_parser().parse_args([*given, "--text-file", "t"]),
    )
    for args in parsed:
        assert offline.weights_options(args) == {
            "quantization": "int8",
            "cpu_int8_activations": True,
        }
    plain = offline.weights_options(offline.build_parser().parse_args([]))
    assert plain == {"cpu_int8_activations": False}  # the engine's own quantization default
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        perplexity.main([
            "--text-file", str(text_file), "--model-path", str(default_model_path(tmp_path)),
            "--device", "cpu", "--quantization", "q3_bogus",
        ])  # fmt: skip
    assert exit_info.value.code == 2
    assert "q3_bogus" in capsys.readouterr().err

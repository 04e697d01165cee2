"""``sglang.launch_server`` lines from SGLang's documentation, through ``tandem serve``'s
parser: each either parses into tandem's options or is refused naming the option."""

from __future__ import annotations

import shlex

import pytest

from tandem.scheduler.config import EngineConfig
from tandem.server.cli import build_parser, engine_kwargs, server_config
from tandem.server.sglang_flags import FOREIGN

# Taken from SGLang's documentation (server arguments, speculative decoding, structured
# outputs, tool parser, multi-node and PD disaggregation pages), the command dropped.
LINES = {
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --tp 2": {"tp_size": 2},
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --dp 2 --tp 2": {"tp_size": 2, "dp_size": 2},
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --mem-fraction-static 0.7": {
        "mem_fraction_static": 0.7
    },
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --chunked-prefill-size 4096": {
        "chunked_prefill_size": 4096
    },
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --enable-torch-compile": {},
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --host 0.0.0.0 --port 30000": {
        "host": "0.0.0.0",
        "port": 30000,
    },
    "--model-path Qwen/Qwen2.5-7B-Instruct --host 0.0.0.0 --log-level warning": {"host": "0.0.0.0"},
    "--model-path meta-llama/Meta-Llama-3.1-8B-Instruct --grammar-backend xgrammar": {
        "grammar_backend": "xgrammar"
    },
    "--model-path meta-llama/Meta-Llama-3.1-8B-Instruct --tool-call-parser llama3": {
        "tool_call_parser": "llama3"
    },
    (
        "--model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE "
        "--speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B "
        "--speculative-num-steps 3 --speculative-eagle-topk 4 "
        "--speculative-num-draft-tokens 16 --mem-fraction-static 0.7 --cuda-graph-max-bs 8"
    ): {
        "model_path": "meta-llama/Llama-2-7b-chat-hf",
        "speculative_algorithm": "EAGLE",
        "speculative_num_draft_tokens": 16,
        "cuda_graph_max_bs": 8,
    },
    (
        "--model-path meta-llama/Meta-Llama-3.1-405B-Instruct --tp 16 "
        "--dist-init-addr sgl-dev-0:50000 --nnodes 2 --node-rank 0"
    ): {"tp_size": 16, "nnodes": 2, "dist_init_addr": "sgl-dev-0:50000"},
    (
        "--model-path meta-llama/Llama-3.1-8B-Instruct --disaggregation-mode prefill "
        "--disaggregation-transfer-backend mooncake --port 30000"
    ): {"disaggregation_mode": "prefill"},
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --trust-remote-code --enable-metrics": {},
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --kv-cache-dtype auto": {},
    "--model-path unsloth/SmolLM2-135M-Instruct-GGUF --quantization gguf": {"quantization": "gguf"},
    "--model-path meta-llama/Llama-3.2-1B-Instruct --quantization int8": {"quantization": "int8"},
}

REFUSED = {
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --kv-cache-dtype fp8_e5m2": (
        "--kv-cache-dtype"
    ),
    "--model-path meta-llama/Meta-Llama-3-8B-Instruct --lora-paths lora0=algoprog/fact": (
        "--lora-paths"
    ),
    "--model-path Alibaba-NLP/gte-Qwen2-1.5B-instruct --is-embedding": "--is-embedding",
    "--model-path deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --reasoning-parser deepseek-r1": (
        "--reasoning-parser"
    ),
}


@pytest.mark.parametrize("line", list(LINES))
def test_sglangs_launch_lines_parse_into_tandems_options(line: str) -> None:
    args = build_parser().parse_args(["serve", *shlex.split(line)])
    kwargs = engine_kwargs(args)
    EngineConfig.from_options(kwargs)  # every value is valid
    server = vars(server_config(args))
    for name, value in LINES[line].items():
        assert (server[name] if name in server else kwargs[name]) == value, name


def test_accepted_options_are_named_once_at_start() -> None:
    args = build_parser().parse_args(["serve", "--trust-remote-code", "--enable-metrics"])
    assert [n.split(" ")[0] for n in args.sglang_notes] == [
        "--trust-remote-code",
        "--enable-metrics",
    ]
    assert build_parser().parse_args(["serve"]).sglang_notes == []


@pytest.mark.parametrize("line", list(REFUSED))
def test_options_tandem_lacks_are_refused_by_name(
    line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *shlex.split(line)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {REFUSED[line]}: SGLang's {REFUSED[line]}" in err
    assert "is not implemented by tandem" in err
    assert "unrecognized arguments" not in err


def test_a_quantization_tandem_lacks_is_refused_naming_the_ones_it_has(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = "--model-path meta-llama/Meta-Llama-3.1-8B-Instruct --quantization fp8"
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *shlex.split(line)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --quantization: invalid choice: 'fp8'" in err
    assert "'gguf', 'int8', 'none'" in err


def test_every_foreign_option_is_in_the_serving_guide() -> None:
    from pathlib import Path

    guide = (Path(__file__).parents[3] / "docs" / "guides" / "serving.md").read_text()
    for f in FOREIGN:
        assert f"`{f.flag}" in guide, f.flag


def test_grammar_backend_none_turns_constrained_output_off() -> None:
    from tandem.scheduler import Engine

    engine = Engine(model_path="tandem-tiny", grammar_backend="none")
    with engine, pytest.raises(ValueError, match="grammar_backend is none"):
        engine.generate("x", {"max_new_tokens": 2, "json_schema": '{"type": "object"}'})
    with pytest.raises(ValueError, match="grammar_backend='outlines' is not one of"):
        EngineConfig.from_options({"grammar_backend": "outlines"})

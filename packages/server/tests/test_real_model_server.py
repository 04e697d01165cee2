"""The real default model, SmolLM2-135M-Instruct, served end to end and asked real
questions with the official ``openai`` client: the chat template, the special tokens,
detokenization, the stop on ``<|im_end|>``, structured output and a forced tool call,
one at a time and many at once."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import LiveServer, live_server

from tandem.scheduler.models.fetch import default_model_file

# Questions the model answers right, greedily, and a word each answer must hold.
KNOWN_ANSWERS = (
    ("What is the capital of France?", "Paris"),
    ("What is 2 + 2?", "4"),
    ("What is 10 times 3?", "30"),
    ("How many days are in a week?", "7"),
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # The file from tandem's own cache (fetched once with pip); the server builds the
    # file's folder in this test's cache.
    gguf = default_model_file()
    with live_server(tmp_path_factory.mktemp("cache"), "--model-path", str(gguf)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _ask(
    client: openai.OpenAI, question: str, max_tokens: int = 48, **extra: object
) -> openai.types.chat.ChatCompletion:
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=max_tokens,
        **extra,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("question", "answer"), KNOWN_ANSWERS)
def test_known_answers(client: openai.OpenAI, question: str, answer: str) -> None:
    reply = _ask(client, question)
    choice = reply.choices[0]
    text = choice.message.content or ""
    assert answer in text, text
    # The turn ends with <|im_end|>: a stop, not the length limit, and never shown.
    assert choice.finish_reason == "stop"
    assert "<|im_end|>" not in text
    assert "<|im_start|>" not in text
    assert reply.usage is not None
    assert reply.usage.completion_tokens < 48


def test_many_clients_at_once_get_the_same_answers(client: openai.OpenAI) -> None:
    questions = [q for q, _ in KNOWN_ANSWERS] * 4
    with ThreadPoolExecutor(len(questions)) as pool:
        replies = list(pool.map(lambda q: _ask(client, q), questions))
    for (_, answer), reply in zip(KNOWN_ANSWERS * 4, replies, strict=True):
        assert answer in (reply.choices[0].message.content or "")


def test_completions_with_the_chat_template_written_out_stops_at_the_turns_end(
    client: openai.OpenAI,
) -> None:
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0)
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"


def test_structured_output_is_valid_and_sensible(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    reply = _ask(
        client,
        "What is the capital of France? Answer in JSON with the keys country and capital.",
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    data = json.loads(reply.choices[0].message.content or "")
    assert set(data) == {"country", "capital"}
    assert data["capital"] == "Paris"
    assert data["country"].lower() == "france"


def test_a_forced_tool_call_is_valid_and_sensible(client: openai.OpenAI) -> None:
    reply = _ask(
        client,
        "What is the weather like in Paris today?",
        # The grammar writes the call's fixed text, which this model spells in short
        # tokens: about 60 of them.
        max_tokens=128,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    arguments = json.loads(calls[0].function.arguments)
    assert "Paris" in arguments["city"]


def test_a_tool_result_sent_back_is_answered(client: openai.OpenAI) -> None:
    """The assistant's turn of calls alone (no content) goes back through a template
    that joins ``content`` as a string."""
    model = client.models.list().data[0].id
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    reply = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "What is the weather like in Paris today?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees Celsius."},
        ],
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=48,
    )
    assert reply.choices[0].message.content

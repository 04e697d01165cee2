"""Request preparation: the bounded queue in front of the tokenizer workers, and how a
chat's messages become token ids (content as text, or with ``--special-tokens-in-content``
as before)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from tandem.scheduler.models.tiny import default_model_path
from tandem.scheduler.text.tokenizer import Tokenizer
from tandem.server.errors import APIError
from tandem.server.parsing import Limits
from tandem.server.prepare import Preparer
from tandem.server.routes.openai import _chat_prompt
from tandem.server.server_config import ServerConfig


def test_past_the_queue_a_request_is_refused_with_retry_after() -> None:
    """One worker and a queue of one: a third request while two are in is a 503 with
    ``Retry-After``, at once; once they are done, requests are taken again."""
    release = threading.Event()

    async def scenario() -> None:
        preparer = Preparer(workers=1, queue_size=1)
        first = asyncio.create_task(preparer.run(release.wait))
        second = asyncio.create_task(preparer.run(release.wait))
        await asyncio.sleep(0)
        assert preparer.pending == 2
        with pytest.raises(APIError) as info:
            await preparer.run(lambda: None)
        assert info.value.status == 503
        assert info.value.headers == {"Retry-After": "1"}
        assert "--prepare-queue-size" in info.value.message
        release.set()
        await asyncio.gather(first, second)
        assert preparer.pending == 0
        assert await preparer.run(lambda: 7) == 7
        preparer.shutdown()

    asyncio.run(scenario())


def _state(special_tokens_in_content: bool) -> SimpleNamespace:
    tokenizer = Tokenizer.from_pretrained(default_model_path())
    config = ServerConfig(special_tokens_in_content=special_tokens_in_content)
    limits = Limits(tokenizer.vocab_size, 2048)
    return SimpleNamespace(tokenizer=tokenizer, config=config, limits=limits)


@pytest.mark.parametrize("flag", [False, True])
def test_special_tokens_in_content_is_the_old_rule(flag: bool) -> None:
    st = _state(flag)
    messages = [{"role": "user", "content": "a <|im_start|>system\nb"}]
    ids = _chat_prompt(st, {"messages": messages})  # type: ignore[arg-type]
    rendered = st.tokenizer.apply_chat_template(messages)
    parsed = st.tokenizer.encode(rendered, add_special_tokens=False)
    start = st.tokenizer.token_to_id("<|im_start|>")
    if flag:
        assert ids == parsed
    else:
        assert ids.count(start) == parsed.count(start) - 1

"""Streaming token ids to text, one chunk per step, never a broken character.

Decoding each new token on its own is wrong twice over: a byte-level token may hold
only part of a UTF-8 character (an emoji is often four tokens), and SentencePiece-style
decoders strip the leading space of whatever comes first in the ids they are given. So
we decode a small window of ids twice, up to the last emitted token (``prefix``) and up
to the newest token, and emit the difference; text that ends in U+FFFD is an incomplete
character and waits for the next token. This is the prefix-offset / read-offset scheme
of Hugging Face's text-generation-inference and vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.scheduler.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"

# How many prompt tokens give the first generated token its context (its leading space,
# the rest of a character the prompt started); more only costs decode time.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's generated ids into text as they arrive.

    Without ``prompt_ids`` the concatenation of every ``step`` and the final
    ``flush`` equals ``tokenizer.decode(generated_ids)``. With ``prompt_ids`` the
    first token is decoded in the prompt's context, so a SentencePiece ``▁world``
    after a prompt comes out as ``" world"`` (what a streaming client must append);
    for byte-level tokenizers both are the same text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only ids from the prefix offset on are kept: the window is all a step decodes,
        # so memory stays constant however long the generation runs.
        self._window: list[int] = list(prompt_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._chunks: list[str] = []

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._chunks)

    def step(self, new_ids: Sequence[int]) -> str:
        """Take the ids sampled this step; return the text that became final.

        Returns ``""`` while the newest ids only add part of a character (or nothing
        visible, like a skipped special token); that text comes out with a later step.
        """
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emit what is still held back because the stream ends here.

        A generation that stopped in the middle of a character ends in U+FFFD, exactly
        as a full ``decode`` of its ids would.
        """
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        chunk = text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._chunks.append(chunk)
        return chunk

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

"""The KV pool as the transfer engine sees it: its buffers in one order, what must
match between a prefill and a decode server, and pages as byte regions."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from tandem.scheduler.disagg.transfer import Region
from tandem.scheduler.kv.pools import PagedKVPool


def buffers(pool: PagedKVPool) -> list[torch.Tensor]:
    """Every K buffer by layer, then every V buffer: the order both sides register."""
    layers = range(pool.layout.num_layers)
    return [pool.k_buffer(i) for i in layers] + [pool.v_buffer(i) for i in layers]


def identity(pool: PagedKVPool, backend: str) -> dict[str, Any]:
    """What a prefill and a decode server must agree on to share pages as they are laid
    out."""
    layout = pool.layout
    return {
        "layers": layout.num_layers,
        "kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "backend": backend,
    }


def mismatch(mine: dict[str, Any], theirs: Any) -> str | None:
    """Why ``theirs`` cannot pair with ``mine``, or None."""
    if not isinstance(theirs, dict):
        return "no KV layout given"
    for key, value in mine.items():
        if theirs.get(key) != value:
            return f"{key} differs: {theirs.get(key)!r} there, {value!r} here"
    return None


def prompt_hash(ids: list[int]) -> str:
    """A short digest of a prompt's ids: both servers must have tokenized the same."""
    return hashlib.blake2b(repr(ids).encode(), digest_size=8).hexdigest()


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Pages ``src[i]`` to pages ``dst[i]`` as runs ``(src page, dst page, pages)``
    consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def regions(pool: PagedKVPool, pages: list[tuple[int, int]]) -> list[Region]:
    """Runs ``(first page, pages)`` as byte regions of every buffer, buffer by buffer.
    The sender decides the runs and tells the receiver (a two-sided transport posts
    one receive per region)."""
    layout = pool.layout
    page_bytes = pool.page_size * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize
    return [
        Region(b, first * page_bytes, n * page_bytes)
        for b in range(2 * layout.num_layers)
        for first, n in pages
    ]

"""The one way pollers read an engine's HTTP answer: status checked, size bounded while reading.

An engine (or anything answering on its port) may send an endless or huge body; we stop reading
past ``max_bytes`` instead of buffering it, whatever Content-Length claims.
"""

from __future__ import annotations

import aiohttp

_CHUNK = 64 * 1024


async def fetch_bounded(
    session: aiohttp.ClientSession, url: str, *, accept: str, max_bytes: int, error: type[Exception]
) -> bytes:
    """GET ``url``; the body, or ``error`` naming the status or the size limit."""
    async with session.get(url, headers={"Accept": accept}) as resp:
        if resp.status != 200:
            raise error(f"HTTP {resp.status} from {url}")
        if resp.content_length is not None and resp.content_length > max_bytes:
            raise error(f"response of {resp.content_length} bytes exceeds {max_bytes}")
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise error(f"response exceeds {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

"""Reading the HTTP API's event stream (``text/event-stream``, docs/http.md) in tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

__all__ = ["sse_events"]


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[int, str, Any]]:
    """Each event of the stream as it arrives: its id, its name and its data (JSON); comments
    (the heartbeats) are skipped."""
    fields: dict[str, str] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith(":"):
            continue
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
            continue
        if fields:  # a blank line ends an event; after a comment's block there is none
            yield int(fields["id"]), fields["event"], json.loads(fields["data"])
            fields = {}

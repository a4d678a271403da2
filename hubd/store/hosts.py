"""What each host of a database URL answers when none would do: named in the log and in the
error of a failed connect (the URL's syntax is :mod:`hubd.dburl`)."""

from __future__ import annotations

import asyncio
import urllib.parse

import asyncpg

from hubd.dburl import host_labels

__all__ = ["try_hosts"]


def _single_host(url: str, host: str) -> str:
    """``url`` naming ``host`` alone, and taking any session it answers with."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    query = [
        (k, v)
        for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if k not in ("target_session_attrs", "host") and not (k == "port" and "," in v)
    ]
    if host.startswith("/"):  # a Unix socket directory, given as ?host=
        query.append(("host", host))
        host = ""
    netloc = f"{userinfo}{at}{host}"
    return urllib.parse.urlunsplit(
        (parts.scheme, netloc, parts.path, urllib.parse.urlencode(query), "")
    )


async def _try_host(url: str, host: str, within: float) -> str:
    try:
        async with asyncio.timeout(within):
            conn = await asyncpg.connect(_single_host(url, host), timeout=within)
            try:
                recovery, read_only = await conn.fetchrow(
                    "SELECT pg_catalog.pg_is_in_recovery(), "
                    "current_setting('default_transaction_read_only')"
                )
            finally:
                conn.terminate()
    except TimeoutError:
        return "timed out"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        # The class, never the message: an authentication error may quote the user.
        return type(exc).__name__
    if recovery:
        return "read-only (a standby, in recovery)"
    if read_only == "on":
        return "read-only (default_transaction_read_only)"
    return "writable"


async def try_hosts(url: str, *, within: float = 5.0) -> list[str]:
    """Each host of ``url`` tried on its own, at once: ``"host:port: what it answered"``."""
    hosts = host_labels(url)
    answers = await asyncio.gather(*(_try_host(url, host, within) for host in hosts))
    return [f"{host}: {answer}" for host, answer in zip(hosts, answers, strict=True)]

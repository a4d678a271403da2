"""Database URLs: the host list, what hubd asks of the server it picks, and the URLs hubd derives
from one (a host on its own, another database of the same server). Pure functions, so the
configuration checks a URL without the driver; what each host answers when asked is
:func:`hubd.store.database.try_hosts`, the one part that must talk to a server.

A libpq URL may name several hosts, ``postgresql://user@a:5432,b:5433/hubd``; a connect tries
them in order and takes the first whose session matches ``target_session_attrs``. hubd writes on
every step, so it asks for ``read-write`` unless the URL (or ``PGTARGETSESSIONATTRS``) says
otherwise, and refuses values that would pick a standby on purpose.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any, Final

__all__ = [
    "DEFAULT_TARGET_SESSION_ATTRS",
    "WRITABLE_TARGETS",
    "connect_options",
    "host_labels",
    "hosts_problem",
    "netloc_hosts",
    "single_host_url",
    "target_session_attrs",
    "with_database",
]

DEFAULT_TARGET_SESSION_ATTRS: Final = "read-write"
"""What hubd asks of a server when neither the URL nor ``PGTARGETSESSIONATTRS`` says: libpq's
own default, ``any``, would keep hubd on whichever host answers first, a standby included."""

WRITABLE_TARGETS: Final = ("read-write", "primary", "any")
"""The ``target_session_attrs`` values hubd accepts. ``primary`` takes a server that is not in
recovery even when it is set read-only (hubd then finds out at its first write); ``any`` takes
whichever host answers first, for one host or a proxy (PgBouncer, a managed service's endpoint)
that does the choosing."""

_STANDBY_TARGETS: Final = ("standby", "prefer-standby", "read-only")


def target_session_attrs(dsn: str) -> str | None:
    """The URL's own ``target_session_attrs``, if it names one."""
    query = urllib.parse.urlsplit(dsn).query
    values = urllib.parse.parse_qs(query, keep_blank_values=True).get("target_session_attrs")
    return values[-1] if values else None


def connect_options(dsn: str) -> dict[str, Any]:
    """What every connection hubd opens to ``dsn`` passes to asyncpg besides the DSN."""
    if target_session_attrs(dsn) is None and not os.environ.get("PGTARGETSESSIONATTRS"):
        return {"target_session_attrs": DEFAULT_TARGET_SESSION_ATTRS}
    return {}


def netloc_hosts(url: str) -> list[str]:
    """The ``host:port`` entries of ``url``'s authority, empty ones included."""
    netloc = urllib.parse.urlsplit(url).netloc.rpartition("@")[2]
    return netloc.split(",") if netloc else []


def hosts_problem(url: str) -> str | None:
    """What is wrong with ``url``'s host list or ``target_session_attrs``, if anything."""
    hosts = netloc_hosts(url)
    if len(hosts) > 1 and any(not host for host in hosts):
        return "an empty host in the host list (two commas, or a comma at an end)"
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query, keep_blank_values=True)
    values = query.get("target_session_attrs", [])
    if len(values) > 1:
        return "target_session_attrs given more than once"
    if values:
        value = values[0]
        if value in _STANDBY_TARGETS:
            return (
                f"target_session_attrs={value} would pick a standby, and hubd writes on every "
                f"step: use {' or '.join(WRITABLE_TARGETS)}"
            )
        if value not in WRITABLE_TARGETS:
            return f"target_session_attrs must be {', '.join(WRITABLE_TARGETS)}, not {value[:40]!r}"
    return None


def host_labels(url: str) -> list[str]:
    """The hosts a connect to ``url`` tries, in order, as ``host:port`` (no credentials)."""
    parts = urllib.parse.urlsplit(url)
    hosts = [host for host in netloc_hosts(url) if host]
    if not hosts:
        query = urllib.parse.parse_qs(parts.query)
        hosts = [h for value in query.get("host", []) for h in value.split(",") if h]
    return hosts or ["localhost"]


def single_host_url(url: str, host: str) -> str:
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


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` on the same server, as the same user."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment)
    )

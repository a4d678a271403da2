"""Keeping secrets out of text: DSN passwords, sidecar tokens, bearer credentials.

Used by error messages, the ledger and the log processor alike, so one pattern decides what a
secret looks like.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["REDACTED", "redact_dsn", "scrub"]

REDACTED: Final = "***"

_SECRETS: Final = re.compile(
    r"hubd_sc_[0-9A-Za-z]{8,}"  # sidecar tokens, and anything shaped like one
    r"|(?i:bearer)\s+[^\s,;\"']+"  # Authorization header values
    r"|(?<=://)[^/\s:@]*:[^/\s@]+(?=@)"  # user:password in URLs
)


def scrub(text: str) -> str:
    """``text`` with anything that looks like a token or a credential replaced."""
    return _SECRETS.sub(REDACTED, text)


def redact_dsn(dsn: str) -> str:
    """``dsn`` with its password (in the user info or a query parameter) replaced."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "<unparseable database url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        user, sep, password = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{hostinfo}" if sep and password else f"{userinfo}@{hostinfo}"
    query = urlencode(
        [(k, REDACTED if k.lower() == "password" else v) for k, v in parse_qsl(parts.query)],
        safe="/",
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))

"""Keeping secrets out of text: DSN passwords, sidecar tokens, bearer credentials.

Used by error messages, the ledger and the log processor alike, so one pattern decides what a
secret looks like.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["REDACTED", "describe_error", "redact_dsn", "scrub"]

REDACTED: Final = "***"

_SECRETS: Final = re.compile(
    r"hubd_(?:sc|rs)_[0-9A-Za-z]{8,}"  # tokens and reconnect secrets, and their shapes
    r"|(?i:bearer)\s+[^\s,;\"']+"  # Authorization header values
    # A token's secret part without its prefix (pasted into the wrong header, say). Ids are
    # 32 hex digits; 64 in a row is a secret's shape, so it goes (a digest now and then too).
    r"|(?<![0-9A-Za-z])[0-9A-Fa-f]{64,}(?![0-9A-Za-z])"
)
_URL_PASSWORD: Final = re.compile(r"(?<=://)([^/\s:@]*):[^/\s@]+(?=@)")
# Every alternative of the two patterns above needs one of these to match: 64 characters (a
# bare secret), "hubd_" (a token), whitespace after "bearer", or "://" (a URL's password). Text
# with none of them is returned as it is without running the patterns; most of what a log line
# carries (ids, names, "host:port") is such text, and the patterns cost microseconds a value.
_SPACE: Final = re.compile(r"\s")
_SECRET_LENGTH: Final = 64


_QUERY_PASSWORD: Final = re.compile(r"((?:^|&)password=)[^&#]*", re.IGNORECASE)
_CONNINFO_PASSWORD: Final = re.compile(
    r"(\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE
)


def scrub(text: str) -> str:
    """``text`` with anything that looks like a token or a credential replaced."""
    if (
        len(text) < _SECRET_LENGTH
        and "hubd_" not in text
        and "://" not in text
        # No whitespace: every whitespace character but the space is unprintable.
        and " " not in text
        and (text.isprintable() or _SPACE.search(text) is None)
    ):
        return text
    # A URL keeps its user name, so a message still says who connected where.
    return _URL_PASSWORD.sub(rf"\1:{REDACTED}", _SECRETS.sub(REDACTED, text))


def redact_dsn(dsn: str) -> str:
    """``dsn`` with its password (user info, ``password=`` parameter or libpq ``key=value``
    form) replaced; user, host, port and database are kept so it still says where it points."""
    scheme, sep, rest = dsn.partition("://")
    if not sep:
        return _CONNINFO_PASSWORD.sub(rf"\g<1>{REDACTED}", dsn)
    head, qmark, query = rest.partition("?")
    # The user info ends at the *last* "@" before the query: a password with an unescaped "@"
    # or "/" is still hidden whole (at worst more than the password is hidden, never less).
    userinfo, at, hostinfo = head.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.partition(":")[0]
        head = f"{user}:{REDACTED}@{hostinfo}"
    if qmark:
        query = _QUERY_PASSWORD.sub(rf"\g<1>{REDACTED}", query)
    return f"{scheme}{sep}{head}{qmark}{query}"


def describe_error(exc: BaseException) -> str:
    """An exception's type and message for a log line, scrubbed of anything secret-looking."""
    text = str(exc)
    return scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)

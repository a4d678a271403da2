"""The HTTP API (docs/http.md): the application API over HTTP for callers with no database login.

Every route runs the same ``hubd_v1`` functions an application role runs (through
:class:`hubd.client.Client`), walled into the API key's tenant (``hubd.wall``), so an HTTP
caller sees exactly what a database role of its tenant sees. :mod:`~hubd.http.server` serves it,
:mod:`~hubd.http.routes` holds the allocation routes, :mod:`~hubd.http.stream` the event stream,
:mod:`~hubd.http.feed` the one follower of the feed that wakes streams and waits,
:mod:`~hubd.http.pages` the reads of the feed a tenant's streams share, and
:mod:`~hubd.http.errors` the one mapping of errors to statuses and codes.
"""

from hubd.http.server import HttpApi, serving

__all__ = ["HttpApi", "serving"]

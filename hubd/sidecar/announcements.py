"""What the reference sidecar tells the hub about itself, as plain values: what it publishes and
whether it can serve (architecture §4, *Publish and ready*).

:class:`Announcements` holds the sidecar's current word: the :class:`Publication` it was started
with, what was published over it at run time (merged key by key, a key given null removed), and
whether it can serve. Each connection keeps a :class:`Told` of what it has said so far, and
:meth:`Announcements.due` answers with the messages that bring the hub up to date, in the order
the hub must read them (a publish before the ``ready`` that makes it visible as ready). A
connection starts with nothing told: the hub keeps a generation's publishes across its
connections, but a declaration belongs to the connection that made it, so every welcome is
followed by the whole publication and a ``ready``, or a ``not_ready`` where the sidecar cannot
serve (a connection that takes over a record keeps its declaration, which that clears).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import attrs

from hubd.published import check_endpoint, check_metadata

__all__ = ["Announcements", "Publication", "Told"]


@attrs.frozen(kw_only=True)
class Publication:
    """What the sidecar publishes after every welcome: an endpoint (``None``: none) and
    metadata, to which the sidecar adds its ``pid`` and what ``on_welcome`` returns."""

    endpoint: str | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)

    def message(self, extra: Mapping[str, Any]) -> str:
        metadata = {"pid": os.getpid(), **extra, **self.metadata}
        body: dict[str, Any] = {"type": "publish", "metadata": metadata}
        if self.endpoint is not None:
            body["endpoint"] = self.endpoint
        return json.dumps(body)


@attrs.define
class Told:
    """What one connection has told the hub."""

    version: int = -1
    """The version of the publication it sent (-1: none yet)."""
    ready: bool | None = None
    """What it last said of readiness: ``ready`` (``True``), ``not_ready`` (``False``), or
    nothing yet (``None``)."""


class Announcements:
    """The sidecar's current publication and readiness, and what a connection still owes the
    hub of them."""

    def __init__(self, publication: Publication | None = None, *, ready: bool = True) -> None:
        self._publication = publication
        self._endpoint: str | None = None
        self._patch: dict[str, Any] = {}
        self.ready = ready
        """Whether the sidecar can serve (told where the allocation's ready_when is
        ``declared``)."""
        self.version = 0
        """Bumped by every run-time publish that changed something."""

    @property
    def endpoint(self) -> str | None:
        """The endpoint published now: the latest run-time one, else the starting one."""
        if self._endpoint is not None:
            return self._endpoint
        return None if self._publication is None else self._publication.endpoint

    def publish(
        self, *, endpoint: str | None = None, metadata: Mapping[str, Any] | None = None
    ) -> bool:
        """Publish ``endpoint`` (``None``: unchanged) and ``metadata`` (merged over what was
        published, a key given ``None`` removed) from now on; whether anything changed.
        :class:`ValueError` when either is malformed, or when everything published at run time
        would not fit in a publish (16 KiB), so the hub never refuses what is sent."""
        if endpoint is None and metadata is None:
            raise ValueError("a publish names an endpoint, metadata or both")
        checked = None if endpoint is None else check_endpoint(endpoint)
        patch = self._patch
        if metadata is not None:
            # Removed keys are kept as null: a connection made later removes them too.
            patch = check_metadata({**self._patch, **check_metadata(metadata)})
        if checked in (None, self._endpoint) and patch == self._patch:
            return False
        self._endpoint = checked or self._endpoint
        self._patch = patch
        self.version += 1
        return True

    def set_ready(self, ready: bool) -> bool:
        """Whether the sidecar can serve from now on; whether that changed."""
        if ready == self.ready:
            return False
        self.ready = ready
        return True

    def publish_message(self, extra: Mapping[str, Any]) -> str | None:
        """The whole publication as one ``publish`` (``None``: nothing to publish), with
        ``extra`` (what ``on_welcome`` returned) under the options' and run-time keys."""
        if self._publication is None and not self._patch and self._endpoint is None:
            return None
        base = self._publication or Publication()
        body: dict[str, Any] = json.loads(base.message(extra))
        if self._publication is None:
            body["metadata"] = {}
        body["metadata"].update(self._patch)
        if self.endpoint is not None:
            body["endpoint"] = self.endpoint
        if not body["metadata"]:
            del body["metadata"]
        return json.dumps(body)

    def due(self, told: Told, *, declared: bool, extra: Mapping[str, Any]) -> list[str]:
        """The messages that bring a connection's hub up to date, oldest first, and ``told``
        updated as if they were sent. ``declared``: the welcome said the allocation is ready
        once its sidecar says so; otherwise readiness is not the sidecar's to tell."""
        messages: list[str] = []
        if told.version != self.version:
            message = self.publish_message(extra)
            if message is not None:
                messages.append(message)
            told.version = self.version
        if declared and told.ready != self.ready:
            messages.append(json.dumps({"type": "ready" if self.ready else "not_ready"}))
            told.ready = self.ready
        return messages

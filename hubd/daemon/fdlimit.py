"""The open-file limit: raised to the hard limit at start, and the socket cap fitted under it.

Every sidecar socket, every unfinished handshake, every pool connection and every provisioner
pipe is a descriptor. Run out and ``accept()`` fails in a loop, the admin listener cannot
answer, and a provisioner's ``fork`` fails with EMFILE; so the listener's socket cap is kept
below the limit with headroom (:func:`hubd.server.limits.connection_cap`).
"""

from __future__ import annotations

import contextlib
import resource
from typing import Final

import attrs

from hubd.server.limits import DESCRIPTOR_HEADROOM, connection_cap

__all__ = ["DescriptorPlan", "plan_descriptors", "raise_open_file_limit"]

_CEILING: Final = 1 << 20
"""What "unlimited" becomes: Linux refuses a soft limit above ``fs.nr_open`` (2^20 by default)."""


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (what systemd's own services and
    nginx's ``worker_rlimit_nofile`` do); returns (soft, hard) as they are afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        # A container may forbid it; the caps are then fitted to what there is.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


@attrs.frozen(kw_only=True)
class DescriptorPlan:
    limit: int
    reserved: int
    requested: int
    max_connections: int

    @property
    def too_low(self) -> bool:
        """The limit forced the socket cap below what the configuration asks for."""
        return self.max_connections < self.requested


def plan_descriptors(limit: int, *, requested: int, pool_connections: int) -> DescriptorPlan:
    """How many sidecar sockets fit under ``limit`` descriptors, keeping the database pools'
    connections and :data:`DESCRIPTOR_HEADROOM` free."""
    if limit == resource.RLIM_INFINITY:
        limit = _CEILING
    reserved = pool_connections + DESCRIPTOR_HEADROOM
    return DescriptorPlan(
        limit=limit,
        reserved=reserved,
        requested=requested,
        max_connections=connection_cap(requested, limit, reserved),
    )

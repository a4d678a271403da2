"""The built-in ``local`` provisioner: one child process per sidecar, in a process group of its own.

Options (``[provisioners.options]``)::

    command = ["hubd", "sidecar"]   # argv of the sidecar; looked up in PATH (env's PATH if set)
                                    # ("hubd" not in PATH: the one beside hubd's interpreter)
    env = { NAME = "value" }        # extra environment for the sidecar
    grace = "5s"                    # SIGTERM → SIGKILL escalation delay (duration or seconds)
    workdir = "/srv/sidecars"       # working directory; default: the daemon's

The child gets the daemon's environment without the daemon's own ``HUBD_*`` variables (they can
hold the database password) and without systemd's per-service variables (``NOTIFY_SOCKET`` …),
then ``env``, then ``HUBD_URL``, ``HUBD_TOKEN``, ``HUBD_ALLOCATION_ID``, ``HUBD_SIDECAR_ID`` and
``HUBD_GENERATION``. Nothing secret is put on its command line: ``/proc/<pid>/cmdline`` is
world-readable, ``/proc/<pid>/environ`` is not.

Files, under ``<state_dir>/local/`` (mode 0700)::

    <sidecar_id>.json   the record: pid, pgid, start time, boot id, command — never the token
    <sidecar_id>.log    the child's stdout and stderr, removed when the sidecar is destroyed

Identity. A pid is only a number the kernel hands out again, so a record names a process by its
pid *and* its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot) *and* the boot id:
a process whose start time differs is someone else's, and it is never signalled. The child is made
the leader of a new session and so of a process group whose id is its pid; that id stays reserved
while any member of the group lives, which is what makes signalling the whole group safe even
after the leader has gone, provided one surviving member proves (by its ``HUBD_SIDECAR_ID``) that
the group is ours. Everything needed to destroy a sidecar is on disk, so a daemon that restarted
destroys what an earlier run started.

A sidecar command must stay in the foreground: a child that exits within the settle window is a
failed start, whatever its exit status. Linux only (``/proc``).
"""

from hubd.plugins.local.options import DEFAULT_COMMAND, DEFAULT_GRACE, LocalOptions, parse_options
from hubd.plugins.local.provisioner import API_VERSION, SETTLE, LocalProvisioner, create

__all__ = [
    "API_VERSION",
    "DEFAULT_COMMAND",
    "DEFAULT_GRACE",
    "SETTLE",
    "LocalOptions",
    "LocalProvisioner",
    "create",
    "parse_options",
]

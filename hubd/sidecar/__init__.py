"""The reference sidecar (``hubd sidecar``) and its reconnect policy."""

from hubd.backoff import Backoff
from hubd.sidecar.client import SidecarClient, SidecarExit
from hubd.sidecar.main import run_sidecar
from hubd.sidecar.policy import Action, Decision
from hubd.sidecar.settings import SidecarConfigError, SidecarSettings

__all__ = [
    "Action",
    "Backoff",
    "Decision",
    "SidecarClient",
    "SidecarConfigError",
    "SidecarExit",
    "SidecarSettings",
    "run_sidecar",
]

"""hubd: a control-plane daemon for sidecar allocations backed by PostgreSQL."""

__all__ = ["__version__"]

__version__ = "0.1.0"

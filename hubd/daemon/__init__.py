"""The daemon an operator runs: wiring, background tasks, signals, listeners."""

"""Every log event hubd writes is a ``snake_case`` name of at least two words, never a sentence
and never a lone word: an operator filters on ``event``, and a test waits for one by its name.

Events are read from the source: a call to ``debug``/``info``/``warning``/``error``/
``exception``/``critical`` on a logger (a name or an attribute called ``log``, ``logger``,
``_log`` or ``_logger``, such as ``self._log`` or ``claim.log``) whose first argument is a
string literal.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hubd"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
LOGGERS = {"log", "logger", "_log", "_logger"}
# A lone word ("ready", "released") says what happened but not to what; every event names both.
EVENT = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$")


def _is_logger(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in LOGGERS
    return isinstance(node, ast.Attribute) and node.attr in LOGGERS


def _events(source: str, filename: str) -> list[tuple[int, str]]:
    """The literal events of ``source``'s log calls, with their lines."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LEVELS
            and _is_logger(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _package_events() -> list[tuple[str, int, str]]:
    return [
        (str(path.relative_to(PACKAGE.parent)), line, event)
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, event in _events(path.read_text(), str(path))
    ]


def test_the_events_are_read() -> None:
    """The scan finds the package's log calls, through each kind of logger it uses."""
    events = {event for _, _, event in _package_events()}
    assert len(events) > 100
    assert {"hubd_running", "abandoning_sidecar", "embedded_postgresql_running"} <= events


def test_the_rule_tells_a_sentence_and_a_lone_word_from_a_name() -> None:
    """The events this rule was written against, a sentence and a lone word, fail it; their
    names pass."""
    source = (
        'claim.log.warning("abandoning the sidecar", code=code)\n'
        'claim.log.info("ready")\n'
        'self._log.info("database connected")\n'
        'log.info("abandoning_sidecar")\n'
    )
    checked = [(event, bool(EVENT.match(event))) for _, event in _events(source, "<t>")]
    assert checked == [
        ("abandoning the sidecar", False),
        ("ready", False),
        ("database connected", False),
        ("abandoning_sidecar", True),
    ]


def test_every_event_is_a_snake_case_name() -> None:
    """No log call in the package names its event with a sentence or a lone word."""
    bad = [
        f"{path}:{line}: {event!r}"
        for path, line, event in _package_events()
        if not EVENT.match(event)
    ]
    assert bad == []

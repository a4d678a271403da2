"""The fenced transitions of a claim (architecture §1 says which follows what), as values.

Each block of ``sql/transitions.sql`` is one transition. A write value of the
reconciler (:mod:`hubd.reconciler.writes`) names its block and gives its arguments, as a
:class:`Transition`; :meth:`~hubd.store.allocations.AllocationStore.write` runs it under the
claim's :class:`~hubd.store.rows.Fence` and returns the updated row, or ``None`` when the
fence matched nothing (the lease is gone, the generation moved on, or the status is not the one
expected). ``None`` means the claim is lost: the caller stops and writes nothing more.

Driver-free, as :mod:`hubd.store.inputs` is: the reconciler's pure modules build transitions
without loading the driver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from hubd.store.queries import Bound, Statement, load_queries
from hubd.store.rows import EffectRow, Fence, effects_json

__all__ = ["SET_FORM", "SQL", "Effects", "Transition"]

SQL = load_queries("transitions.sql")

SET_FORM: Final = frozenset({SQL.park.name, SQL.mark_released.name})
"""The transitions whose statements are written in set form (each parameter an array, one
element per row): a batch of them is one execution (:mod:`hubd.store.pipeline`)."""

Effects = Sequence[EffectRow]
"""The rows of the plugin call a transition brackets (``:effects``)."""


@attrs.frozen
class Transition:
    """One fenced transition: its statement, the words that name it in errors and task names
    (``what``), and every argument but the fence's."""

    statement: Statement
    what: str
    arguments: Mapping[str, object]

    @classmethod
    def of(
        cls, statement: Statement, what: str, effects: Effects = (), /, **arguments: object
    ) -> Transition:
        """``statement`` with ``arguments``, and the plugin call's ledger rows ``effects`` as
        its ``:effects`` (unless ``arguments`` encodes them itself). A statement without
        ``:effects`` brackets no plugin call, and refuses rows to carry."""
        if "effects" in statement.params:
            arguments.setdefault("effects", effects_json(effects))
        elif effects:
            raise ValueError(f"{statement.name} brackets no plugin call")
        return cls(statement, what, arguments)

    @property
    def name(self) -> str:
        """The statement's name, which keys its pipeline."""
        return self.statement.name

    @property
    def set_form(self) -> bool:
        return self.statement.name in SET_FORM

    def bind(self, fence: Fence, instance_id: str) -> Bound:
        """The statement with ``fence`` and the hub that writes the ledger row (the name
        check of :class:`~hubd.store.queries.Statement` catches a missing argument here)."""
        return self.statement(**fence.parameters(instance_id), **self.arguments)

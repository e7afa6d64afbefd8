"""The flow interpreter's memoised work: helpers' exits (keyed on what they read of the caller's
path assumptions) and loops' fixed points.

**Loops.** A loop's rounds run until the paths at its head settle; the paths they settle on
depend only on the loop, the paths that enter it, the helper-call stack, the argument mapping and
the file (not on whether findings are recorded: a recording run goes the same paths). A loop that
is entered again the same way (the recording pass after the quiet rounds of an enclosing loop
enters each inner loop exactly as that loop's last quiet round did) reuses them, with the last
round's body (its paths are those of a quiet pass from the settled head).

**Helpers.** The interpreter memoises an inlined helper's exit on its entry paths (see
:meth:`ampguard.lint._flow.Interpreter._interpret`). Those paths carry the caller's assumptions
(``(test text, value)``, see :mod:`ampguard.lint._paths`), and most are about the caller's own
flags (``__name__ == '__main__'``, ``LOCAL_RANK != -1``) that the helper neither tests nor
assigns. Keyed on all of them, a ``train()`` reached from a ``main()`` full of branches was
interpreted again under every combination.

A helper *reads* an assumption when it (or a helper it inlines) tests its key (an ``if`` that
splits the paths) or assigns one of the names the key reads (the paths forget it). An assumption
that every entry path holds and the helper does not read is carried through unchanged: each step
of the interpreter (split, forget, join, the exact merges, the budget counts, the states the
analysis sees) treats the entry sets with it as it treats them without it, so the exit with it is
the exit without it with the assumption added to every exit set (the order in which the exact
merges try a set's assumptions follows string hashing, which already differs from one process to
the next; no finding depends on it). Such an assumption is *hidden*: left out of the memo key and
of the paths the helper runs on, and added back to its exit.

What a helper reads is learnt as it runs: each read is checked against the hidden assumptions of
every helper being interpreted, and a read of one stops that interpretation (:class:`Touched`) at
the read, before anything after it runs (up to the read, both runs do the same work, so no finding
is recorded that the full run would not record). The helper is then run again with that
assumption kept. What each call context (helper, argument mapping, depth, file) read is kept in
the :class:`FlowMemo` next to its exits, so the next call keeps those assumptions from the
start.

A :class:`FlowMemo` belongs to one analysis over one file (its rule makes it, and clears it with
the findings of a unit that ran out of budget), so nothing kept here outlives the file it was
learnt on: every key holds the ``id`` of a node or an ``Events`` of that file's run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "NOTHING",
    "FlowMemo",
    "Frame",
    "Reads",
    "Touched",
    "expand",
    "hidden",
    "strip",
    "untouched",
]

Paths = dict[frozenset, Any]
Read = tuple[frozenset[str], frozenset[str]]  # (keys tested, names assigned)
NOTHING: Read = (frozenset(), frozenset())


@dataclass
class FlowMemo:
    """The flow interpreter's memoised work for one analysis over one file (shared by its
    interpreters).

    ``exits``: (helper, mapping, depth, file, recording, entry paths without the hidden
    assumptions) -> (exit paths, what the run read); ``reads``: (helper, mapping, depth, file)
    -> everything its runs read so far (only which assumptions to hide next: every use of an
    exit checks its own reads); ``loops``: (loop, mapping, helper stack, file, entry paths) ->
    (settled head paths, the last round's entry and body or ``None``, what the rounds read)."""

    exits: dict[tuple, tuple[Paths | None, Read]] = field(default_factory=dict)
    reads: dict[tuple, Read] = field(default_factory=dict)
    loops: dict[tuple, tuple[Paths | None, Any, Read]] = field(default_factory=dict)

    def learn(self, context: tuple, read: Read) -> None:
        """Add ``read`` to what ``context``'s runs read."""
        tested, assigned = self.reads.get(context, NOTHING)
        if not (read[0] <= tested and read[1] <= assigned):
            self.reads[context] = (tested | read[0], assigned | read[1])

    def clear(self) -> None:
        self.exits.clear()
        self.reads.clear()
        self.loops.clear()


@dataclass
class Frame:
    """One helper being interpreted: the assumptions hidden from it, and what it has read."""

    keys: frozenset[str]  # the hidden assumptions' keys
    names: frozenset[str]  # the names those keys read
    tested: set[str] = field(default_factory=set)
    assigned: set[str] = field(default_factory=set)

    def read(self) -> Read:
        return frozenset(self.tested), frozenset(self.assigned)


class Touched(Exception):
    """A helper read an assumption hidden from it: its run is void (``read`` says what)."""

    def __init__(self, frame: Frame, read: Read) -> None:
        super().__init__("a hidden assumption was read")
        self.frame = frame
        self.read = read


class Reads:
    """The helpers being interpreted (outermost first); every read is checked and noted here."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []

    def push(self, hidden_facts: frozenset, key_heads: Callable[[str], set[str]]) -> Frame:
        keys = frozenset(fact[0] for fact in hidden_facts)
        names = frozenset(name for key in keys for name in key_heads(key))
        frame = Frame(keys, names)
        self.frames.append(frame)
        return frame

    def pop(self, frame: Frame) -> None:
        popped = self.frames.pop()
        assert popped is frame, "helper frames are popped in the order they were pushed"

    def tested(self, key: str) -> None:
        """The paths split on ``key``: raises :class:`Touched` for the outermost helper that
        has an assumption on it hidden."""
        for frame in self.frames:
            if key in frame.keys:
                raise Touched(frame, (frozenset((key,)), frozenset()))
            frame.tested.add(key)

    def assigned(self, names: Iterable[str]) -> None:
        """The paths forget the assumptions that read ``names`` (the caller's spelling)."""
        names = frozenset(names)
        for frame in self.frames:
            if names & frame.names:
                raise Touched(frame, (frozenset(), names))
            frame.assigned.update(names)

    def replay(self, read: Read) -> None:
        """A memoised exit stands for a run that read ``read``: note it as if it ran here."""
        if not self.frames:
            return
        for key in read[0]:
            self.tested(key)
        if read[1]:
            self.assigned(read[1])


def hidden(state: Paths, read: Read | None, key_heads: Callable[[str], set[str]]) -> frozenset:
    """The assumptions every set of ``state`` holds that nothing in ``read`` touches."""
    sets = iter(state)
    common = next(sets, frozenset())
    for facts in sets:
        common = common & facts
        if not common:
            return common
    return common if read is None else untouched(common, read, key_heads)


def untouched(facts: frozenset, read: Read, key_heads: Callable[[str], set[str]]) -> frozenset:
    """The assumptions of ``facts`` that a run which read ``read`` left alone."""
    tested, assigned = read
    if not facts or (not tested and not assigned):
        return facts
    return frozenset(
        fact for fact in facts if fact[0] not in tested and not (key_heads(fact[0]) & assigned)
    )


def strip(state: Paths, facts: frozenset) -> Paths:
    """``state`` without ``facts`` (held by every set, so no two sets become one)."""
    return {key - facts: value for key, value in state.items()} if facts else state


def expand(state: Paths | None, facts: frozenset) -> Paths | None:
    """``state`` with ``facts`` added back to every set (no set holds one of their keys)."""
    if state is None or not facts:
        return state
    return {key | facts: value for key, value in state.items()}

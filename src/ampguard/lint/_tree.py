"""A node's children, listed once: the rules walk the same function bodies many times.

Project mode walks a training loop's helpers once per rule and per call path (``statements()``
for the savers and the syncs, the inert-helper summary, the calls of each statement), about ten
visits per node on a detection repository. :func:`children` is ``ast.iter_child_nodes`` as a
tuple kept on the node, so every later visit is an attribute read. It is sound because nothing in
``ampguard.lint`` changes a tree after parsing it (``--fix`` edits the source text and parses
again), and it lives exactly as long as the tree: a file parsed again has new nodes, so a list
made for one file's tree can never answer for another's.

Cost: one ``iter_child_nodes`` and a tuple per node on its first visit; an attribute read after.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator

__all__ = ["children", "walk"]

_CHILDREN = "_ag_children"


def children(node: ast.AST) -> tuple[ast.AST, ...]:
    """``tuple(ast.iter_child_nodes(node))``, kept on ``node`` after the first call."""
    kept = node.__dict__  # a dict read: a missing attribute would raise and catch an error
    found = kept.get(_CHILDREN)
    if found is None:
        if not node._fields:  # ``Load()``, ``Add()``, ...: shared by every tree, and empty
            return ()
        found = kept[_CHILDREN] = tuple(ast.iter_child_nodes(node))
    return found


def walk(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk(node)`` (breadth first, in the same order) over :func:`children`."""
    todo = deque([node])
    while todo:
        node = todo.popleft()
        todo.extend(children(node))
        yield node

"""Which routed layer is running now, on this thread: the ambient layer that attention calls made inside a layer's
forward find without being handed it (torch's SDPA, diffusers' dispatcher, `sage_patch.sdpa`).

Below both `api` and `binding`: a binding enters a layer around its module's forward; `api.sdpa` asks for the ambient
layer and calls its `attention(...)` without knowing what a layer is. `None` may be entered too: calls made inside
it see no layer (a routed call that runs the library's own code, whose nested SDPA call is not a second call).

A thread-local stack rather than a ContextVar: torch.compile (fullgraph) traces list pushes and pops, not
`ContextVar.set`.
"""
from __future__ import annotations

import threading


class _Stack(threading.local):
    def __init__(self):
        self.items: list = []


_STACK = _Stack()


def current():
    """The innermost layer entered on this thread (an object with `.attention(q, k, v, ...)`), or None."""
    items = _STACK.items
    return items[-1] if items else None


def enter(layer) -> None:
    _STACK.items.append(layer)


def leave() -> None:
    _STACK.items.pop()

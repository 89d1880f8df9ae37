"""Upstream's functions as they were before the plugin replaced them: every patch installs through ``replace`` or
``wrap``, so the self-test, the tests and the re-application after verl's ``apply_monkey_patch`` all find
upstream's code in one place, and a second install never wraps a wrapper.
"""

from __future__ import annotations

from collections.abc import Callable

_kept: dict[tuple[object, str], object] = {}
_set: dict[tuple[object, str], object] = {}  # what the plugin set there


def original(owner: object, attr: str) -> object:
    """``owner.attr`` as upstream defined it, even after the plugin replaced it (None where ``owner`` has none of
    its own)."""
    return _kept.get((owner, attr), vars(owner).get(attr))


def replace(owner: object, attr: str, new: object) -> None:
    """Set ``owner.attr = new``, keeping upstream's ``owner.attr`` the first time. ``owner`` must define ``attr``
    itself: patching an inherited or missing one would install something that fails only when it runs."""
    if attr not in vars(owner):
        raise AttributeError(f"{owner!r} defines no {attr!r} of its own")
    _kept.setdefault((owner, attr), vars(owner)[attr])
    _set[owner, attr] = new
    setattr(owner, attr, new)


def add(owner: object, attr: str, new: object) -> None:
    """Set ``owner.attr = new`` where upstream defines none: a name upstream renamed or moved, put back for code that
    still reads it. Its original is None; setting it again replaces the plugin's own."""
    if attr in vars(owner) and (owner, attr) not in _set:
        raise AttributeError(f"{owner!r} already defines {attr!r}")
    _kept.setdefault((owner, attr), None)
    _set[owner, attr] = new
    setattr(owner, attr, new)


def wrap(owner: object, attr: str, wrapper: Callable[[Callable], Callable]) -> None:
    """Set ``owner.attr = wrapper(upstream's owner.attr)``: built on upstream's function, however often it runs."""
    if attr not in vars(owner):
        raise AttributeError(f"{owner!r} defines no {attr!r} of its own")
    replace(owner, attr, wrapper(original(owner, attr)))


def replaced(attr: str) -> list[object]:
    """The owners whose ``attr`` the plugin replaced in this process."""
    return [owner for owner, name in _kept if name == attr]


def ours(obj: object) -> bool:
    """Whether ``obj`` is something the plugin set: a wrapper carries upstream's name and module
    (``functools.wraps``), so this is the way to tell, e.g. where a module bound another's patched name at import. A
    static method counts by its function, as the class hands it out; None, which the plugin may set, is never ours."""
    return obj is not None and any(obj is new or obj is getattr(new, "__func__", None) for new in _set.values())

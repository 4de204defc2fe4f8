"""How the CUDA graphs' address watch sees an object, and how an object can vouch for itself.

A captured CUDA graph bakes in the addresses of the tensors it reads and writes, so the step and
update keys (:mod:`speedrun.train.addresses`) hold the address of every tensor reachable from the
model, checked before every replay.  The walk that finds them classifies each value it meets by
type (:func:`value_kind`): tensors, containers and this package's objects are followed, anything
else is a leaf.

Checking every reachable tensor and every attribute on the way is host work of every step, most
of it spent on small state objects that, once made, never move a tensor (the FP8 scale states,
one per layer and slot).  Such an object can derive from :class:`AddressVersioned`: it counts, in
``address_version``, every change to what it reaches, so the watch checks that one number
instead of everything behind it.  Rebinding an attribute counts by itself (``__setattr__``);
an in-place change of a container it holds (a dict entry replaced) must call
:meth:`AddressVersioned.note_address_change`, and the classes here do.  A versioned object's
version covers what it holds except other versioned objects, which keep their own; what it holds
besides tensors (its dicts, lists and helper objects) is its own, reached through it alone.

Attributes named in ``address_transient`` are left out of the walk and of the count: state that
lives within one micro-batch and is gone at every step boundary, where keys are taken.

A class that never holds a tensor (a configuration: sizes, names, flags, index tables) can say so
with the class attribute ``address_leaf = True``: its objects are then leaves, not entered, and
the watch checks none of their fields.  It is a promise about the class, kept by a test
(``tests/test_addresses.py``), and a plain attribute, so the configuration layer below this
package needs no import to make it.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["AddressVersioned", "LEAF_TYPES", "SKIP", "TENSOR", "DICT", "SEQUENCE", "MODULE", "OBJECT",
           "value_kind", "walked_attributes"]

# Values a walk for tensors never enters.
LEAF_TYPES = (str, bytes, int, float, bool, type(None), torch.device, torch.dtype)

# How the walk treats a value, by its type (see value_kind).
SKIP, TENSOR, DICT, SEQUENCE, MODULE, OBJECT = range(6)


@functools.cache
def value_kind(tp: type) -> int:
    """What the walk does with a value of type ``tp``: skip it (a leaf, or an object whose class
    sets ``address_leaf``), record it (a tensor), or enter it (a dict, a list or tuple, an
    nn.Module, an object of this package or any :class:`AddressVersioned` one).  Remembered per
    type: every walk and every attribute assignment of a versioned object asks."""
    if issubclass(tp, LEAF_TYPES) or getattr(tp, "address_leaf", False) is True:
        return SKIP
    if issubclass(tp, torch.Tensor):
        return TENSOR
    if issubclass(tp, dict):
        return DICT
    if issubclass(tp, (list, tuple)):
        return SEQUENCE
    if issubclass(tp, torch.nn.Module):
        return MODULE
    return OBJECT if tp.__module__.startswith("speedrun.") or issubclass(tp, AddressVersioned) else SKIP


def walked_attributes(obj) -> dict:
    """The attributes of an object of this package that the walk enters (its ``__dict__`` less
    its class's ``address_transient`` names)."""
    attrs = getattr(obj, "__dict__", None) or {}
    transient = getattr(type(obj), "address_transient", ())
    if not transient:
        return attrs
    return {k: v for k, v in attrs.items() if k not in transient}


class AddressVersioned:
    """An object that counts the changes to the tensors it reaches (module docstring).

    ``address_version`` advances whenever an attribute is rebound to another object, unless the
    old and the new value are both leaves (numbers, strings, None: a counter or a flag moves no
    tensor), and on :meth:`note_address_change`.  ``address_transient``: attribute names left out
    of the walk and of the count."""

    address_transient: tuple[str, ...] = ()
    address_version: int = 0

    def __setattr__(self, name: str, value) -> None:
        d = self.__dict__
        old = d.get(name, _MISSING)
        if (old is not value and name != "address_version" and name not in type(self).address_transient
                and (value_kind(type(old)) != SKIP or value_kind(type(value)) != SKIP)):
            d["address_version"] = d.get("address_version", 0) + 1
        object.__setattr__(self, name, value)

    def note_address_change(self) -> None:
        """Count a change the attribute assignments did not show (a container changed in place)."""
        self.__dict__["address_version"] = self.__dict__.get("address_version", 0) + 1


class _Missing:
    pass


_MISSING = _Missing()  # an attribute not set yet (its type is no leaf: the first binding counts)

"""Where the tensors a captured CUDA graph reads and writes live: the walk that finds every tensor
reachable from a model (or an optimizer), and the address fingerprint the graphs' keys hold.

A graph bakes in addresses.  If code between replays puts a new tensor where an old one was (an
attribute rebound, a dict entry replaced, ``.data`` swapped), a replay would read stale or freed
memory; the step and update keys (:mod:`speedrun.train.graphs`, :mod:`speedrun.train.update_graphs`)
therefore hold the data pointer of every reachable tensor, in the walk's order, and a changed
fingerprint means a new key (run eagerly, captured anew).

The walk enters nn.Modules (their attributes, parameters, buffers and submodules; compiled forms
and hook tables are skipped), objects of this package (their ``__dict__``), dicts, lists and
tuples, each object once, depth first in attribute order; it never enters a tensor (a ``.grad``
is not included).  Anything else (numbers, strings, None, functions, other libraries' objects) is
a leaf (:func:`speedrun.kernels.addressing.value_kind`).  An object's ``address_transient``
attributes (state within one micro-batch) are left out.

The fingerprint is taken every step, so its cost is host time of every step.
:class:`AddressWatch` keeps it cheap: it walks once and records each edge the walk followed
(container, key, and the object found there, or for a tensor its address), each leaf it passed
over (container, key, the leaf's type) and the size of every container; while all of those still
hold, the walk would return tensors at the same addresses in the same order, so the last
fingerprint stands.  The check is a few C-level passes over flat lists instead of a Python call
per object; anything it finds changed makes it walk again.  So the state a step leaves must keep
its containers: an object rebuilt around the same tensors every step (a fresh tuple, a new
wrapper) is no error, but it costs a full walk each time (``tests/test_addresses.py`` checks that
the presets' state settles).  Behind an :class:`~speedrun.kernels.addressing.AddressVersioned`
object (the FP8 scale states and weight copies, most of the candidate's tensors) the watch checks
only its ``address_version``, which the object advances itself whenever what it reaches changes.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from speedrun.kernels.addressing import (DICT as _DICT, MODULE as _MODULE, SEQUENCE as _SEQUENCE, SKIP as _SKIP,
                                         TENSOR as _TENSOR, AddressVersioned, value_kind as _kind, walked_attributes)

__all__ = ["AddressWatch", "address_fingerprint", "reachable_tensors"]


def _module_attribute_skipped(name: str) -> bool:
    """A module's compiled forms and hook tables hold no state of its own."""
    return name.startswith("_compiled") or name.endswith("_hooks")


def reachable_tensors(roots: Sequence[tuple[str, Any]], *, paths: bool = False,
                      skip_parameters: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``roots`` (name, object), in the walk's order (module
    docstring).  ``paths``: name each one (for messages), else the names are "".
    ``skip_parameters``: leave out the modules' parameters and registered buffers.  Not for every
    step: :class:`AddressWatch` is."""
    if not paths:
        return [("", t) for _, t in reachable_tensors(roots, paths=True, skip_parameters=skip_parameters)]
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def visit(obj: Any, path: str) -> None:
        kind = _kind(type(obj))
        if kind == _TENSOR:
            out.append((path, obj))
            return
        if kind == _SKIP or id(obj) in seen:
            return
        seen.add(id(obj))
        if kind == _DICT:
            for k, v in obj.items():
                visit(v, f"{path}[{k!r}]")
        elif kind == _SEQUENCE:
            for i, v in enumerate(obj):
                visit(v, f"{path}[{i}]")
        elif kind == _MODULE:
            for name, v in vars(obj).items():
                if name in ("_parameters", "_buffers"):
                    if not skip_parameters:
                        out.extend((f"{path}.{n}", t) for n, t in v.items() if t is not None)
                elif name == "_modules":
                    for n, m in v.items():
                        visit(m, f"{path}.{n}")
                elif not _module_attribute_skipped(name):
                    visit(v, f"{path}.{name}")
        else:
            for name, v in walked_attributes(obj).items():
                visit(v, f"{path}.{name}")

    for name, root in roots:
        visit(root, name)
    return out


def address_fingerprint(roots: Sequence[tuple[str, Any]]) -> tuple[int, ...]:
    """The addresses of every tensor :func:`reachable_tensors` finds from ``roots``, in its order:
    what a captured graph baked in.  Walks every time; :class:`AddressWatch` is the cheap way to
    take it every step."""
    return tuple(t.data_ptr() for _, t in reachable_tensors(roots))


_data_ptr = torch.Tensor.data_ptr
_address_version = operator.attrgetter("address_version")


class AddressWatch:
    """:func:`address_fingerprint` of ``roots``, walking only when something the walk depends on
    changed since its last walk (module docstring).  The watch holds references to what it
    recorded until it walks again (an object replaced stays alive until the next
    :meth:`fingerprint`)."""

    def __init__(self, roots: Sequence[tuple[str, Any]]):
        self.roots = list(roots)
        self.walks = 0  # full walks so far (the first, then one per change found)
        self._fingerprint: tuple[int, ...] | None = None

    def fingerprint(self) -> tuple[int, ...]:
        """The fingerprint now; the very tuple of the last call while nothing changed."""
        if self._fingerprint is None or not self._unchanged():
            self._record()
        return self._fingerprint

    def _unchanged(self) -> bool:
        try:
            if not all(map(operator.is_, map(operator.getitem, self._holders, self._keys), self._found)):
                return False
            leaves = map(type, map(operator.getitem, self._leaf_holders, self._leaf_keys))
            if not all(map(self._leaf_types.__contains__, leaves)):
                return False
            if list(map(_data_ptr, map(operator.getitem, self._tensor_holders, self._tensor_keys))) != self._checked_ptrs:
                return False
            if list(map(_address_version, self._versioned)) != self._versions:
                return False
        except (KeyError, IndexError, TypeError):  # an entry went away; a tensor's place holds something else
            return False
        return list(map(len, self._sized)) == self._sizes

    def _record(self) -> None:
        """The walk of :func:`reachable_tensors`, noting every edge, leaf and container size on the
        way; inside an :class:`~speedrun.kernels.addressing.AddressVersioned` object only the
        addresses (for the fingerprint) and the versions of the versioned objects in it."""
        holders, keys, found = [], [], []  # holder[key] is found (identity)
        leaf_holders, leaf_keys, leaf_types = [], [], set()  # holder[key] has a leaf's type
        tensor_holders, tensor_keys, checked_ptrs = [], [], []  # holder[key] is a tensor at this address
        ptrs: list[int] = []  # every tensor's address, in the walk's order: the fingerprint
        versioned, versions = [], []  # versioned objects and their address_version
        sized: list = []  # containers whose length must not change
        seen: set[int] = set()

        def edge(holder, key, value, checked: bool) -> None:
            tp = type(value)
            kind = _kind(tp)
            if kind == _SKIP:
                if checked:
                    leaf_holders.append(holder)
                    leaf_keys.append(key)
                    leaf_types.add(tp)
            elif kind == _TENSOR:  # by address: a new view of the same memory changes nothing
                ptr = value.data_ptr()
                ptrs.append(ptr)
                if checked:
                    tensor_holders.append(holder)
                    tensor_keys.append(key)
                    checked_ptrs.append(ptr)
            else:
                if checked:
                    holders.append(holder)
                    keys.append(key)
                    found.append(value)
                enter(value, kind, checked)

        def enter(obj: Any, kind: int, checked: bool) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if kind == _DICT:
                if checked:
                    sized.append(obj)
                for k, v in obj.items():
                    edge(obj, k, v, checked)
            elif kind == _SEQUENCE:
                if checked:
                    sized.append(obj)
                for i, v in enumerate(obj):
                    edge(obj, i, v, checked)
            elif kind == _MODULE:
                attrs = vars(obj)
                if checked:
                    sized.append(attrs)
                for name, v in attrs.items():
                    if name == "_parameters" or name == "_buffers":
                        if checked:
                            holders.append(attrs)
                            keys.append(name)
                            found.append(v)
                            sized.append(v)
                        for n, t in v.items():
                            if t is not None:
                                ptrs.append(t.data_ptr())
                            if not checked:
                                continue
                            if t is None:
                                leaf_holders.append(v)
                                leaf_keys.append(n)
                                leaf_types.add(type(None))
                            else:
                                tensor_holders.append(v)
                                tensor_keys.append(n)
                                checked_ptrs.append(ptrs[-1])
                    elif name == "_modules":
                        if checked:
                            holders.append(attrs)
                            keys.append(name)
                            found.append(v)
                            sized.append(v)
                        for n, m in v.items():
                            edge(v, n, m, checked)
                    elif not _module_attribute_skipped(name):
                        edge(attrs, name, v, checked)
            else:
                if isinstance(obj, AddressVersioned):  # its version stands for what it holds
                    versioned.append(obj)
                    versions.append(obj.address_version)
                    checked = False
                attrs = getattr(obj, "__dict__", None)
                if attrs is not None:
                    if checked:
                        sized.append(attrs)
                    for name, v in walked_attributes(obj).items():
                        edge(attrs, name, v, checked)

        root_list = [root for _, root in self.roots]
        for i, root in enumerate(root_list):
            edge(root_list, i, root, True)
        self._holders, self._keys, self._found = holders, keys, found
        self._leaf_holders, self._leaf_keys, self._leaf_types = leaf_holders, leaf_keys, frozenset(leaf_types)
        self._tensor_holders, self._tensor_keys, self._checked_ptrs = tensor_holders, tensor_keys, checked_ptrs
        self._versioned, self._versions = versioned, versions
        self._sized, self._sizes = sized, [len(c) for c in sized]
        self._fingerprint = tuple(ptrs)
        self.walks += 1

    @property
    def checked_entries(self) -> int:
        """How many entries each :meth:`fingerprint` checks (edges, leaves, tensors, versions and
        container sizes): the host work of a step's key."""
        return (len(self._holders) + len(self._leaf_holders) + len(self._tensor_holders) + len(self._versioned)
                + len(self._sized))

"""The address fingerprint's watch (:class:`speedrun.train.addresses.AddressWatch`): after every kind
of change a captured graph cares about it returns exactly what a fresh walk returns, and it walks
again only when something the walk depends on changed."""

from __future__ import annotations

import random

import pytest
import torch

from speedrun.kernels.addressing import AddressVersioned
from speedrun.train.addresses import AddressWatch, address_fingerprint


class _Scales(AddressVersioned):
    """A versioned state object: the watch checks its address_version, not what it holds."""

    address_transient = ("_handoff",)

    def __init__(self):
        self.amax = torch.zeros(())
        self.acc = None
        self.entries = {"x": torch.zeros(())}
        self.calls = 0
        self._handoff = None


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("table", torch.zeros(3))
        self.counter = 0  # a host counter that changes every step: not a reason to walk


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.layers = torch.nn.ModuleList([_Inner(), _Inner()])
        self.cache = {"scale": torch.zeros(()), "amax": torch.zeros(2)}
        self.slots = [torch.zeros(1), None, 3]
        self.pair = (torch.zeros(2), "x")
        self.lazy = None
        self.ratio = 1
        self.scales = _Scales()


def _roots(m):
    return [("m", m)]


def _check(watch, m, walked: bool):
    before = watch.walks
    got = watch.fingerprint()
    assert got == address_fingerprint(_roots(m))
    assert (watch.walks > before) == walked
    return got


# each mutation, and whether the watch must walk again after it
MUTATIONS = {
    "in-place write": (lambda m: m.cache["scale"].fill_(2.0), False),
    "host counter": (lambda m: setattr(m.inner, "counter", m.inner.counter + 1), False),
    "int to float": (lambda m: setattr(m, "ratio", 0.5), True),  # a new leaf type: walked, same fingerprint
    "dict entry replaced": (lambda m: m.cache.__setitem__("scale", torch.zeros(())), True),
    "dict entry added": (lambda m: m.cache.__setitem__("extra", torch.zeros(1)), True),
    "dict entry removed": (lambda m: m.cache.pop("amax"), True),
    "None to tensor": (lambda m: setattr(m, "lazy", torch.zeros(2)), True),
    "list element replaced": (lambda m: m.slots.__setitem__(0, torch.zeros(1)), True),
    "list None to tensor": (lambda m: m.slots.__setitem__(1, torch.zeros(1)), True),
    "list grown": (lambda m: m.slots.append(torch.zeros(1)), True),
    "parameter data swapped": (lambda m: setattr(m.inner.w, "data", torch.zeros(4)), True),
    "parameter replaced": (lambda m: setattr(m.inner, "w", torch.nn.Parameter(torch.ones(4))), True),
    "buffer registered": (lambda m: m.inner.register_buffer("more", torch.zeros(1)), True),
    "submodule replaced": (lambda m: m.layers.__setitem__(0, _Inner()), True),
    "attribute added": (lambda m: setattr(m.inner, "state", {"t": torch.zeros(1)}), True),
    "tuple rebound": (lambda m: setattr(m, "pair", (torch.zeros(2), "x")), True),
    "versioned: in-place write": (lambda m: m.scales.amax.fill_(1.0), False),
    "versioned: counter": (lambda m: setattr(m.scales, "calls", m.scales.calls + 1), False),
    "versioned: tensor rebound": (lambda m: setattr(m.scales, "amax", torch.zeros(())), True),
    "versioned: None to tensor": (lambda m: setattr(m.scales, "acc", torch.zeros(())), True),
    "versioned: entry replaced, noted": (lambda m: (m.scales.entries.__setitem__("x", torch.zeros(())),
                                                    m.scales.note_address_change()), True),
    "versioned: transient state": (lambda m: setattr(m.scales, "_handoff", (torch.zeros(2),)), False),
    "versioned: object replaced": (lambda m: setattr(m, "scales", _Scales()), True),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_watch_follows_each_kind_of_change(name):
    m = _Holder()
    watch = AddressWatch(_roots(m))
    first = _check(watch, m, walked=True)
    assert _check(watch, m, walked=False) is first  # nothing changed: the same tuple, no walk
    mutate, walks = MUTATIONS[name]
    mutate(m)
    _check(watch, m, walked=walks)
    _check(watch, m, walked=False)


def test_the_watch_matches_a_fresh_walk_under_random_changes():
    """Random sequences of the mutations above (and none): after each, the watch's fingerprint is
    a fresh walk's."""
    rng = random.Random(0)
    for trial in range(20):
        m = _Holder()
        watch = AddressWatch(_roots(m))
        for _ in range(12):
            name = rng.choice(list(MUTATIONS) + ["nothing"])
            if name != "nothing":
                try:
                    MUTATIONS[name][0](m)
                except (KeyError, IndexError):  # e.g. an entry already removed
                    pass
            assert watch.fingerprint() == address_fingerprint(_roots(m)), (trial, name)


def test_the_watch_checks_a_versioned_object_by_its_version_alone():
    """What a versioned object holds adds to the fingerprint, not to the per-step check."""
    m = _Holder()
    watch = AddressWatch(_roots(m))
    watch.fingerprint()
    checked = watch.checked_entries
    m.scales.entries.update({f"t{i}": torch.zeros(()) for i in range(50)})
    m.scales.note_address_change()
    assert len(watch.fingerprint()) == len(address_fingerprint(_roots(m)))
    assert watch.checked_entries == checked


def test_a_step_scale_binds_its_tensors_once():
    from speedrun.kernels.fp8_cache import InputScaling, StepScale

    entry = StepScale(torch.ones(()), 0.5, torch.zeros(()))
    entry.version = 3  # a counter: rebinding it is fine
    with pytest.raises(AttributeError, match="bound once"):
        entry.scale = torch.zeros(())
    state = InputScaling(input_scaling="delayed", x_amax=torch.ones(()))
    before = state.address_version
    state.step_scale("x")  # a new entry: new tensors behind the state
    assert state.address_version > before
    before = state.address_version
    state.step_scale("x")  # the same entry
    assert state.address_version == before


RECORD = ["model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate"]
CANDIDATE = ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.fp8_input_scaling=delayed",
             "model.qk_prep_fp8_grad=true"]


@pytest.mark.usefixtures("use_builtin_cache", "one_thread", "kernels_use_references")
@pytest.mark.parametrize("switches", [RECORD, CANDIDATE], ids=["record", "candidate"])
def test_the_watch_walks_once_over_steady_training_steps(tmp_path, switches):
    """On the presets' real state (FP8 caches, scales, accumulators; tiny shapes, reference
    kernels), the model's and the optimizer's: the watch's fingerprint is a fresh walk's at every
    step, and once the state has settled (after the first step) it stops walking: the step
    leaves its containers in place, so the key costs a check, not a walk."""
    from speedrun import distributed
    from speedrun.config import apply_overrides, preset
    from speedrun.evidence.bench import build_session

    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=16",
                          "train.batch_divisor=1024", "train.steps=24", "train.num_extension=3",
                          f"out_dir={tmp_path}", *switches])
    session = build_session("arm", cfg, 0, distributed.setup(cfg.train.device))
    roots = ([("model", session.model)], [("optimizer", session.recipe.optimizer)])
    watches = [AddressWatch(r) for r in roots]
    walks = []
    try:
        for _ in range(6):
            session.step()
            for watch, r in zip(watches, roots):
                assert watch.fingerprint() == address_fingerprint(r)
            walks.append([w.walks for w in watches])
    finally:
        session.close()
    assert walks[-1] == walks[1], walks  # settled after the first step: no walk since


def _objects_marked_as_leaves(root) -> dict[str, list]:
    """Every object reachable from ``root`` (as the watch's walk goes: modules, containers, this
    package's objects) whose class sets ``address_leaf``, by class name."""
    import torch.nn as nn

    found: dict[str, list] = {}
    seen: set[int] = set()

    def visit(obj) -> None:
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            return
        seen.add(id(obj))
        if getattr(type(obj), "address_leaf", False) is True:
            found.setdefault(type(obj).__name__, []).append(obj)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)
        elif isinstance(obj, nn.Module) or type(obj).__module__.startswith("speedrun."):
            for v in vars(obj).values():
                visit(v)

    visit(root)
    return found


def _holds_a_tensor(obj, seen=None) -> bool:
    """Whether anything inside ``obj`` (attributes, containers, at any depth) is a tensor or a module."""
    import torch.nn as nn

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, nn.Module)):
        return True
    if isinstance(obj, dict):
        return any(_holds_a_tensor(v, seen) for v in [*obj.keys(), *obj.values()])
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(_holds_a_tensor(v, seen) for v in obj)
    attrs = getattr(obj, "__dict__", None)
    return attrs is not None and any(_holds_a_tensor(v, seen) for v in attrs.values())


@pytest.mark.usefixtures("use_builtin_cache", "one_thread", "kernels_use_references")
@pytest.mark.parametrize("name", ["tiny-record", "tiny-candidate", "tiny"])
def test_objects_marked_as_address_leaves_hold_no_tensor(tmp_path, name):
    """``address_leaf`` lets the watch skip an object (the configurations the model keeps): in the
    presets' built runs, after a step, every such object holds no tensor at any depth, the walk
    does not enter it, and the code paths do keep the marked classes (so this checks something)."""
    from speedrun import distributed
    from speedrun.config import apply_overrides, preset
    from speedrun.evidence.bench import build_session
    from speedrun.kernels.addressing import SKIP, value_kind

    cfg = preset(name)
    apply_overrides(cfg, ["model.num_layers=4", "train.batch_divisor=1024", f"out_dir={tmp_path}"])
    session = build_session("arm", cfg, 0, distributed.setup(cfg.train.device))
    try:
        session.step()
        model = session.model
    finally:
        session.close()
    found = _objects_marked_as_leaves(model)
    assert "ModelConfig" in found
    if name != "tiny":
        assert {"RecordArchConfig", "GateLayout"} <= set(found), sorted(found)
    if name == "tiny-candidate":  # its FP8 kernels keep their options
        assert "KernelOptions" in found, sorted(found)
    for objs in found.values():
        for obj in objs:
            assert value_kind(type(obj)) == SKIP
            assert not _holds_a_tensor(obj), type(obj).__name__
    # the watch's walk looks at none of their fields
    watch = AddressWatch([("model", model)])
    watch.fingerprint()
    marked_dicts = {id(vars(o)) for objs in found.values() for o in objs}
    assert not any(id(h) in marked_dicts for h in [*watch._holders, *watch._leaf_holders, *watch._tensor_holders])

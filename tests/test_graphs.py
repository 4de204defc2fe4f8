"""CUDA-graph steps (:mod:`speedrun.train.graphs`) off the GPU: the capture plan and what makes it
sound.  A captured step reads and writes fixed addresses, so everything it touches that outlives
a step must keep its address (FP8 weight caches and scales, accumulators, RoPE tables); these
tests run the record and candidate code paths eagerly on the CPU and check that the step keys
repeat as the plan says: after the first step (no FP8 scale ready yet) exactly two keys per
stage, one for even and one for odd steps.  The capture itself, the replay and the self-check
need CUDA: ``tests/gpu/test_graphs_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speedrun.config import apply_overrides, preset
from speedrun.errors import ConfigError
from speedrun.kernels.step_values import StepValues
from speedrun.train.addresses import reachable_tensors
from speedrun.train.graphs import (
    STEPS_UNTIL_REPLAY,
    STEPS_UNTIL_UPDATE_REPLAY,
    _relative_error,
    graphs_enabled,
    step_key,
)

pytestmark = pytest.mark.usefixtures("use_builtin_cache", "one_thread")

RECORD = ("model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate")
CANDIDATE = ("model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16",
             "model.fp8_input_scaling=delayed", "model.qk_prep_fp8_grad=true")


def _session(tmp_path, switches, stage=0, simulate_world=None):
    from speedrun import distributed
    from speedrun.evidence.bench import build_session

    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
                          "train.batch_divisor=1024", "train.steps=24", "train.num_extension=3",
                          f"out_dir={tmp_path / 'runs'}", *switches])
    info = distributed.setup(cfg.train.device)
    return build_session("arm", cfg, stage, info, simulate_world=simulate_world)


def _keys(session, steps: int):
    """The step key of each of ``steps`` steps, taken where run_step takes it (after before_step)."""
    from speedrun.train.loop import micro_batching

    keys = []
    batch = session.loader.next_batch()
    for _ in range(steps):
        step = session.stage.start_step + session.count
        session.recipe.before_step(step)
        args = session.recipe.forward_args(step)
        mb = micro_batching(session.stage, session.cfg, session.info.world_size)
        keys.append(step_key(session.model, [batch] * mb.count, args, 1.0 / mb.count))
        session.step()
    return keys


@pytest.mark.parametrize("switches", [RECORD, CANDIDATE], ids=["record", "candidate"])
def test_step_keys_repeat_with_the_parity_of_the_step(tmp_path, kernels_use_references, switches):
    session = _session(tmp_path, switches)
    try:
        keys = _keys(session, 7)
    finally:
        session.close()
    assert keys[0].signature != keys[2].signature  # step 0: no FP8 activation scale is ready yet
    for i in range(1, 5):
        assert keys[i] == keys[i + 2], _difference(keys[i], keys[i + 2])
        assert keys[i] != keys[i + 1]
    assert keys[1].present - keys[2].present == {"scalars", "smear_gate", "ve_gate_bank", "lm_head", "post_lambdas",
                                                 "resid_lambdas", "mudd_w1", "mudd_w2", "mudd_b2", "mudd_gate_w1",
                                                 "mudd_gate_w2", "mudd_gate_b2", "mudd_gate_scale"}
    assert not keys[2].present  # after an Adam (odd) step every gradient was consumed
    # every key of a stage is replayed from this step on, which is what the bench's warmup covers
    assert len(set(keys[:STEPS_UNTIL_REPLAY])) == 3 and set(keys[STEPS_UNTIL_REPLAY:]) <= set(keys[1:3])


def _difference(a, b) -> str:
    for field in ("shapes", "count", "scale", "windows", "mtp_count", "prefix", "present", "signature"):
        if getattr(a, field) != getattr(b, field):
            return f"{field}: {getattr(a, field)} != {getattr(b, field)}"
    if a.fingerprint != b.fingerprint:
        return f"fingerprint: {len(a.fingerprint)} vs {len(b.fingerprint)} tensors, first change at " \
               f"{next((i for i, (x, y) in enumerate(zip(a.fingerprint, b.fingerprint)) if x != y), None)}"
    return "equal"


def test_the_fingerprint_follows_replaced_tensors():
    """A tensor reachable from the model that is replaced (not updated in place) changes the key."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.cache = {"scale": torch.zeros(())}

    m = Holder()
    named = reachable_tensors([("m", m)], paths=True)
    assert [n for n, _ in named] == ["m.w", "m.cache['scale']"]
    before = [t.data_ptr() for _, t in named]
    m.cache["scale"].fill_(2.0)  # in place: same address
    assert [t.data_ptr() for _, t in reachable_tensors([("m", m)])] == before
    m.cache["scale"] = torch.full((), 3.0)  # replaced
    assert [t.data_ptr() for _, t in reachable_tensors([("m", m)])] != before
    assert [n for n, _ in reachable_tensors([("m", m)], paths=True, skip_parameters=True)] == ["m.cache['scale']"]


def _plain_walk(obj, path, out, seen, skip_parameters=False):
    """The walk :func:`reachable_tensors` makes, written plainly (one call per value)."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.device, torch.dtype)) or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _plain_walk(v, f"{path}[{k!r}]", out, seen, skip_parameters)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _plain_walk(v, f"{path}[{i}]", out, seen, skip_parameters)
    elif isinstance(obj, torch.nn.Module):
        for name, v in vars(obj).items():
            if name in ("_parameters", "_buffers"):
                out += [] if skip_parameters else [(f"{path}.{n}", t) for n, t in v.items() if t is not None]
            elif name == "_modules":
                for n, m in v.items():
                    _plain_walk(m, f"{path}.{n}", out, seen, skip_parameters)
            elif not name.startswith("_compiled") and not name.endswith("_hooks"):
                _plain_walk(v, f"{path}.{name}", out, seen, skip_parameters)
    elif type(obj).__module__.startswith("speedrun."):
        for name, v in getattr(obj, "__dict__", {}).items():
            _plain_walk(v, f"{path}.{name}", out, seen, skip_parameters)


def test_the_walk_finds_every_tensor_once_in_a_fixed_order(tmp_path, kernels_use_references):
    """On a real model (the candidate's FP8 caches, scales and accumulators after a few steps) and
    its optimizer: the tensors, names and order of the plain walk, each object entered once."""
    session = _session(tmp_path, CANDIDATE)
    try:
        for _ in range(3):
            session.step()
    finally:
        session.close()
    model, opt = session.model, session.recipe.optimizer
    shared = torch.ones(2)
    model.extra_probe = {"a": [shared, (shared, None, 3, "x")], "b": torch.device("cpu")}  # one tensor, twice
    try:
        for roots in ([("model", model)], [("optimizer", opt)], [("model", model), ("optimizer", opt)]):
            for skip in (False, True):
                want: list = []
                seen: set = set()
                for name, root in roots:
                    _plain_walk(root, name, want, seen, skip)
                got = reachable_tensors(roots, paths=True, skip_parameters=skip)
                assert [n for n, _ in got] == [n for n, _ in want]
                assert all(a is b for (_, a), (_, b) in zip(got, want))
                unnamed = reachable_tensors(roots, skip_parameters=skip)  # the fingerprint's walk
                assert len(unnamed) == len(got) and all(a is b for (_, a), (_, b) in zip(unnamed, got))
        names = [n for n, _ in reachable_tensors([("model", model)], paths=True)]
        assert "model.extra_probe['a'][0]" in names and "model.extra_probe['a'][1][0]" in names
        assert len(names) > 40  # the FP8 state is in there, not only the parameters
    finally:
        del model.extra_probe


def test_host_state_round_trip(tmp_path, kernels_use_references):
    session = _session(tmp_path, CANDIDATE)
    try:
        for _ in range(2):
            session.step()
        model = session.model
        saved = model.graph_host_state()
        for st in model._fp8_scale_states():
            st.used.add("x")
        model.set_graph_host_state(saved)
        assert model.graph_host_state() == saved
    finally:
        session.close()


def test_graph_settings_and_errors():
    assert not graphs_enabled("auto", torch.device("cpu"))
    assert not graphs_enabled("off", torch.device("cpu"))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        graphs_enabled("on", torch.device("cpu"))
    with pytest.raises(ConfigError, match="auto, on, off"):
        graphs_enabled("yes", torch.device("cpu"))


def test_relative_error_catches_nan_and_shape():
    a = torch.tensor([1.0, 2.0])
    assert _relative_error(a, a.clone()) == 0.0
    assert _relative_error(a, torch.tensor([1.0, float("nan")])) != _relative_error(a, a)  # NaN: fails any bound
    assert not _relative_error(torch.tensor([1.0, float("nan")]), a) <= 1.0
    assert _relative_error(a, torch.ones(3)) == float("inf")
    assert abs(_relative_error(torch.tensor([1.0, 2.001], dtype=torch.float64), torch.tensor([1.0, 2.0])) - 0.001 / 5 ** 0.5) < 1e-12


def test_scalar_state_is_judged_by_the_fp8_step_it_steers():
    """A 0-d state tensor (an amax) may differ by up to SCALAR_STATE_TOLERANCE where its own two
    eager runs agreed (an amax moving by a percent where every eager noise is far below);
    gradients, the loss, a non-scalar state tensor and an amax far outside still stop the check."""
    from speedrun.train.graphs import SCALAR_STATE_TOLERANCE, GraphMismatchError, compare_replay

    step_noise = 1e-3  # the eager loop's largest run-to-run difference (a gradient's)
    within = 1 + 0.8 * SCALAR_STATE_TOLERANCE  # relative error of a scalar inside the bound
    names = ["loss", "gate.grad", "scales[2].g_acc", "cache.amax_history"]
    want = [torch.tensor(3.0), torch.ones(4), torch.tensor(1.0), torch.ones(2)]
    got = [torch.tensor(3.0), torch.ones(4), torch.tensor(within), torch.ones(2)]
    noise = [0.0, step_noise, 0.0, 0.0]
    res = compare_replay("t", names, got, want, noise, scalar_state_from=2)
    assert res["worst_rel_err"] == pytest.approx(within - 1) and res["bitwise_equal"] == 3
    with pytest.raises(GraphMismatchError, match="g_acc"):  # without the state rule: its own noise, 0
        compare_replay("t", names, got, want, noise)
    with pytest.raises(GraphMismatchError, match="in loss"):  # the loss is not state
        compare_replay("t", names, [torch.tensor(3.0 * within), *got[1:]], want, noise, scalar_state_from=2)
    with pytest.raises(GraphMismatchError, match="gate.grad"):  # nor is a gradient
        compare_replay("t", names, [got[0], torch.full((4,), within), *got[2:]], want, noise, scalar_state_from=2)
    with pytest.raises(GraphMismatchError, match="amax_history"):  # a state tensor of several elements
        compare_replay("t", names, [*got[:3], torch.tensor([1.0, within])], want, noise, scalar_state_from=2)
    for bad in (1 + 2 * SCALAR_STATE_TOLERANCE, 0.0, float("nan")):  # far off, unwritten, NaN
        with pytest.raises(GraphMismatchError, match="g_acc"):
            compare_replay("t", names, [*got[:2], torch.tensor(bad), got[3]], want, noise, scalar_state_from=2)


def _step_values_round_trip(device: torch.device) -> None:
    values = StepValues(device, 4)
    for i in range(10):  # around the ring more than twice, fewer values than slots
        fresh = [i + 0.1, 1 / 3] if i % 2 else [i + 0.1, 1 / 3, 2.0 ** -30, -7.25]
        buf = values.write(fresh)
        want = torch.tensor(fresh + [0.0] * (4 - len(fresh)), dtype=torch.float32)  # fp32, rounded once
        assert torch.equal(buf.cpu(), want), (i, buf, want)
    with pytest.raises(ValueError, match="5 values for a buffer of 4"):
        values.write([0.0] * 5)


def test_step_values_write_rounds_to_fp32_and_zero_the_rest():
    _step_values_round_trip(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and events need CUDA")
def test_step_values_ring():
    _step_values_round_trip(torch.device("cuda"))


# merged micro-batches: four chunks of 32 tokens per step as two micro-batches of 64
MERGED = ("train.grad_accum=4", "train.min_micro_batch_tokens=64")


@pytest.mark.parametrize("ends_step", [True, False], ids=["step-end-captured", "step-end-eager"])
@pytest.mark.parametrize("switches", [RECORD, CANDIDATE, CANDIDATE + MERGED], ids=["record", "candidate", "merged"])
def test_graph_bookkeeping_takes_the_eager_steps(tmp_path, kernels_use_references, switches, ends_step):
    """StepGraphs with its capture stood in by re-running the loop (RerunCapture): keys, sightings,
    the self-check's snapshot and restore, gradient buffers (zeroed for a parameter without a
    gradient at the step's start, carried for the record's waiting Adam gradients) and the host
    state set after each "replay" give bit for bit the weights and losses of the eager loop, with
    the FP8 step end inside the captured loop (one rank) or after it (several)."""
    from speedrun.train.graphs import RerunCapture, StepGraphs

    weights, summaries = [], []
    for graphs in (False, True):
        session = _session(tmp_path / str(graphs), switches)
        if MERGED[1] in switches:  # the step really is two merged micro-batches
            from speedrun.train.loop import micro_batching

            mb = micro_batching(session.stage, session.cfg, session.info.world_size)
            assert (mb.count, mb.merge) == (2, 2), mb
        if graphs:
            session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                        capture_with=RerunCapture, ends_step=ends_step)
        try:
            losses = [float(session.step()) for _ in range(9)]
        finally:
            session.close()
        if graphs:
            summaries.append(session.graphs.summary())
        weights.append((losses, {k: v.clone() for k, v in session.model.state_dict().items()}))
    (eager_losses, eager_w), (graph_losses, graph_w) = weights
    assert graph_losses == eager_losses
    for k in eager_w:
        assert torch.equal(eager_w[k], graph_w[k]), k
    (summary,) = summaries
    assert summary["captures"] == 2 and summary["replayed_steps"] == 9 - STEPS_UNTIL_REPLAY
    assert summary["eager_steps"] == 3 and summary["check_worst_rel_err"] == 0.0
    # the optimizer's updates: keyed on the gradients' addresses too, so they repeat once the loop
    # writes its run-long gradient buffers; both parities captured, later ones replayed.  An eager
    # step's gradients may land where an earlier eager step's were (the heap reuses the freed
    # blocks, depending on what ran before in the process), which repeats that key early and
    # captures it too: legal (a replay needs those addresses again), so not counted exactly.
    assert summary["update_graphs"] == summary["update_captures"] >= 2, summary
    assert summary["replayed_updates"] >= 9 - STEPS_UNTIL_UPDATE_REPLAY, summary
    assert summary["eager_updates"] + summary["replayed_updates"] + summary["update_captures"] == 9, summary


def _tail_host_records(model) -> tuple:
    """What the FP8 weight refresh and the embedding flush keep on the host (counters, versions,
    which objects hold the copies, the flush's pending flag): the kernels a CUDA graph replays
    cannot change any of it."""
    cache, emb = model._mlp_fp8, model._embedding_grads
    mlp = None if cache is None else (
        cache.version, cache._valid, dict(cache._refreshes), dict(cache._source_versions),
        {k: id(v) for k, v in cache._entries.items()}, {k: id(v) for k, v in cache._amax.items()},
        {k: id(v) for k, v in cache._raw_scale.items()}, {k: v.version for k, v in cache._entries.items()})
    return (mlp, id(model._head_fp8), model._head_fp8_version, list(model._qkv_fp8_versions),
            {j: id(p) for j, p in model._qkv_fp8.items()}, None if emb is None else emb._pending,
            tuple(id(p.grad) for p in model.parameters()))


@pytest.mark.parametrize("switches", [RECORD, CANDIDATE], ids=["record", "candidate"])
def test_the_update_graph_holds_the_flush_and_the_fp8_refresh(tmp_path, kernels_use_references, switches):
    """On one rank the embedding tables' gradient flush (Adam steps) and the FP8 weight copies'
    refresh are captured with the optimizer's update: once updates replay, every replayed update
    holds the refresh, the Adam ones the flush too, and re-running the captured work leaves the
    host records it would leave alone on a GPU (a stand-in that fails otherwise), while the
    weights, losses and FP8 copies equal an eager run's bit for bit."""
    from speedrun.train.graphs import RerunCapture, StepGraphs, _Rerun

    class KernelsOnly(RerunCapture):
        """RerunCapture whose replays must leave the model's host records as they were."""

        model = None

        def capture(self, fn):
            fn()
            return _KernelsOnlyReplay(fn, self.model)

    class _KernelsOnlyReplay(_Rerun):
        def __init__(self, fn, model):
            super().__init__(fn)
            self.model = model

        def replay(self):
            if "UpdateGraphs" not in self.fn.__qualname__:  # a step graph's (its host state is set back)
                return super().replay()
            before = _tail_host_records(self.model)
            super().replay()
            assert _tail_host_records(self.model) == before

    results = []
    for graphs in (False, True):
        session = _session(tmp_path / str(graphs), switches)
        KernelsOnly.model = session.model
        if graphs:
            session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                        capture_with=KernelsOnly)
        try:
            losses = [float(session.step()) for _ in range(STEPS_UNTIL_UPDATE_REPLAY + 4)]
        finally:
            session.close()
        model = session.model
        copies = [t.clone() for _, t in model.prepare_fp8_refresh().written()]
        results.append((losses, {k: v.clone() for k, v in model.state_dict().items()}, copies))
        if graphs:
            updates = session.graphs.updates
            assert session.graphs.stats.replayed_updates >= 3, session.graphs.summary()
            around = [key[-1] for key in updates._updates]
            assert all(after is not None for _, after in around), around
            assert any(before is not None for before, _ in around), around  # an Adam step's flush
    (eager_losses, eager_w, eager_fp8), (graph_losses, graph_w, graph_fp8) = results
    assert graph_losses == eager_losses
    for k in eager_w:
        assert torch.equal(eager_w[k], graph_w[k]), k
    assert len(eager_fp8) == len(graph_fp8) > 0
    for e, g in zip(eager_fp8, graph_fp8):
        assert torch.equal(e.float(), g.float())


def test_static_inputs_take_a_packed_batch_in_one_copy(tmp_path, kernels_use_references):
    """The loader's batches are one buffer each: a step's static micro-batches are refilled by
    copying that buffer (each field then equals the fetched batch's), and a batch made field by
    field is still copied field by field."""
    import dataclasses
    import types

    from speedrun.train.graphs import RerunCapture, StepGraphs, _batch_shape

    session = _session(tmp_path, RECORD)
    try:
        graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                            capture_with=RerunCapture)
        batches = [session.loader.next_batch() for _ in range(2)]
        key = types.SimpleNamespace(shapes=_batch_shape(batches[0]), count=2)
        static = graphs._static_inputs(batches, key)
        copies = []
        for dst in static:
            dst.packed.fill_(-1)
            real = dst.packed.copy_
            dst.packed.copy_ = lambda src, _real=real, **kw: (copies.append(src), _real(src, **kw))[1]
        fresh = [session.loader.next_batch() for _ in range(2)]
        assert graphs._static_inputs(fresh, key) is static
        assert [id(c) for c in copies] == [id(b.packed) for b in fresh]

        def assert_holds(want_batches):
            for got, want in zip(static, want_batches):
                for f in ("inputs", "targets", "cu_seqlens", "bigram"):
                    if getattr(want, f) is not None:
                        assert torch.equal(getattr(got, f), getattr(want, f)), f

        assert_holds(fresh)
        loose = [dataclasses.replace(b, packed=None) for b in (session.loader.next_batch(), session.loader.next_batch())]
        graphs._static_inputs(loose, key)
        assert len(copies) == 2  # field by field
        assert_holds(loose)
    finally:
        session.close()


def test_graph_args_read_each_steps_weights_through_the_same_views(tmp_path, kernels_use_references):
    """The loss weights a graph reads come from the step-values buffer through views made once per
    (MTP count, prefix on) and reused every step (no tensor made per step), each step's values
    in them."""
    from speedrun.model.interface import ForwardArgs
    from speedrun.train.graphs import RerunCapture, StepGraphs

    session = _session(tmp_path, RECORD)
    try:
        graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                            capture_with=RerunCapture)
        first = graphs._graph_args(ForwardArgs(64, 128, (1.0, 0.5), 0.25))
        again = graphs._graph_args(ForwardArgs(64, 128, (0.75, 0.5), 0.125))
        assert again.mtp_weights is first.mtp_weights and again.prefix_weight is first.prefix_weight
        assert again.mtp_weights.tolist() == [0.75, 0.5] and float(again.prefix_weight) == 0.125
        assert (again.window_short, again.window_long) == (64, 128)
        plain = graphs._graph_args(ForwardArgs(32, 64, (1.0,), 0.0))
        assert plain.prefix_weight == 0.0 and plain.mtp_weights.tolist() == [1.0]
        assert plain.mtp_weights.data_ptr() == first.mtp_weights.data_ptr()  # the one buffer
    finally:
        session.close()


def test_static_inputs_take_host_batches_onto_the_graphs_device(tmp_path, kernels_use_references):
    """Batches fetched on the host (what a step with graphs fetches) go straight into static
    micro-batches on the graphs' device, laid out as the batches and refilled by one copy of each
    batch's buffer.  The meta device stands in for a GPU."""
    import types

    from speedrun.train.graphs import RerunCapture, StepGraphs, _batch_shape

    session = _session(tmp_path, RECORD)
    try:
        graphs = StepGraphs(session.run_model, session.recipe, torch.device("meta"), session.dtype,
                            capture_with=RerunCapture)
        batches = [session.loader.next_batch(on_host=True) for _ in range(2)]
        key = types.SimpleNamespace(shapes=_batch_shape(batches[0]), count=2)
        static = graphs._static_inputs(batches, key)
        for got, host in zip(static, batches):
            assert host.packed.device.type == "cpu" and got.packed.device.type == "meta"
            assert got.packed.shape == host.packed.shape and got.bigram_rows is None
            for f in ("inputs", "targets", "cu_seqlens", "bigram"):
                h, d = getattr(host, f), getattr(got, f)
                assert (h is None) == (d is None), f
                if h is not None:
                    assert d.device.type == "meta" and d.shape == h.shape and d.dtype == h.dtype, f
        copies = []
        for dst in static:
            real = dst.packed.copy_
            dst.packed.copy_ = lambda src, _real=real, **kw: (copies.append(src), _real(src, **kw))[1]
        fresh = [session.loader.next_batch(on_host=True) for _ in range(2)]
        assert graphs._static_inputs(fresh, key) is static
        assert [id(c) for c in copies] == [id(b.packed) for b in fresh]
    finally:
        session.close()


@pytest.mark.parametrize("world", [1, 8], ids=["one-rank", "rank-of-8"])
@pytest.mark.parametrize("switches", [RECORD, CANDIDATE], ids=["record", "candidate"])
def test_replayed_steps_leave_the_key_watches_settled(tmp_path, kernels_use_references, switches, world):
    """Once a stage's steps replay, nothing a replay does (the model's host state set back, the
    optimizer's host half, the FP8 refresh) replaces a container the step and update keys' watches
    follow, so their fingerprints cost a check per step, not a walk of the model."""
    from speedrun.train.graphs import RerunCapture, StepGraphs

    session = _session(tmp_path, switches, simulate_world=None if world == 1 else world)
    session.graphs = graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                         capture_with=RerunCapture, ends_step=world == 1)
    watches = [graphs._watch] + ([] if graphs.updates is None else [graphs.updates._watch])
    try:
        for _ in range(STEPS_UNTIL_UPDATE_REPLAY + 1):
            session.step()
        settled = [w.walks for w in watches]
        replayed = graphs.stats.replayed_steps
        for _ in range(4):
            session.step()
    finally:
        session.close()
    assert graphs.stats.replayed_steps == replayed + 4, graphs.summary()
    assert [w.walks for w in watches] == settled


def test_runs_sharing_a_capturer_share_its_pool(tmp_path, kernels_use_references):
    """Two runs given one capturer (the arms of a bench) capture into it, and each reports the
    shared pool's size; without one, a run makes its own on first capture."""
    from speedrun.train.graphs import RerunCapture, StepGraphs

    class Pool(RerunCapture):
        held = 0

        def capture(self, fn):
            Pool.held += 2**20  # each capture keeps one MiB reserved
            return super().capture(fn)

        def pool_bytes(self):
            return Pool.held

    shared = Pool(torch.device("cpu"))
    sessions = [_session(tmp_path / n, RECORD) for n in ("a", "b")]
    try:
        for s in sessions:
            s.graphs = StepGraphs(s.run_model, s.recipe, s.info.device, s.dtype, capture_with=RerunCapture,
                                  capturer=shared)
            assert s.graphs.pool_bytes() == Pool.held
            for _ in range(STEPS_UNTIL_REPLAY):
                s.step()
        assert [s.graphs._capture_device() for s in sessions] == [shared, shared]
        captures = sum(s.graphs.summary()["captures"] for s in sessions)
        assert captures >= 2 and Pool.held == captures * 2**20
        assert sessions[0].graphs.summary()["pool_mib"] == sessions[1].graphs.summary()["pool_mib"] == captures
        own = StepGraphs(sessions[0].run_model, sessions[0].recipe, sessions[0].info.device, sessions[0].dtype,
                         capture_with=RerunCapture)
        assert own.pool_bytes() == 0 and own._capture_device() is not shared
    finally:
        for s in sessions:
            s.close()


def test_bigram_rows_are_marked_once_per_micro_batch_eager_or_replayed(tmp_path, kernels_use_references):
    """On several ranks (rank 0 of 2, simulated) the record recipe marks each micro-batch's bigram
    rows for the sparse exchange on the host as the batch is fetched, from the loader's host mask:
    once per micro-batch and step whether the loop runs eagerly, is captured or is replayed (a
    mark inside the captured loop would run at capture time only, and several times there), and
    the graphs train as the eager loop does."""
    from speedrun.train.graphs import RerunCapture, StepGraphs
    from speedrun.train.loop import micro_batching

    steps = STEPS_UNTIL_REPLAY + 2
    runs = []
    for graphs in (False, True):
        session = _session(tmp_path / str(graphs), (*RECORD, "train.grad_accum=2"), simulate_world=2)
        if graphs:
            session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                        capture_with=RerunCapture)
        opt, marks = session.optimizer, []
        real = opt.mark_rows
        opt.mark_rows = lambda label, rows: marks.append((label, rows.copy())) or real(label, rows)
        count = micro_batching(session.stage, session.cfg, session.info.world_size).count
        per_step = []
        try:
            for _ in range(steps):
                before = len(marks)
                loss = float(session.step())
                per_step.append((len(marks) - before, loss))
        finally:
            session.close()
        assert count > 1 and [n for n, _ in per_step] == [count] * steps, per_step
        assert all(label == "bigram_embed" and isinstance(rows, np.ndarray) and rows.dtype == np.bool_
                   for label, rows in marks)
        assert opt.entries["bigram_embed"].comms == "sharded_sparse"
        runs.append((per_step, [rows for _, rows in marks], dict(session.model.state_dict())))
        if graphs:
            assert session.graphs.summary()["replayed_steps"] == steps - STEPS_UNTIL_REPLAY
    (eager_steps, eager_rows, eager_w), (graph_steps, graph_rows, graph_w) = runs
    assert graph_steps == eager_steps
    assert all(np.array_equal(a, b) for a, b in zip(eager_rows, graph_rows))
    for k in eager_w:
        assert torch.equal(eager_w[k], graph_w[k]), k


@pytest.mark.parametrize("graphs", [False, True])
def test_a_step_builds_no_batch_while_it_issues_work(tmp_path, kernels_use_references, graphs):
    """The loader's builder thread would take the interpreter lock from the step's thread in
    stretches, so a step queues the next step's batches only once all its own work is issued (the
    loop then waits for the GPU): while a step runs nothing is being built, after it the next
    step's batches are queued, and every step after the first takes them ready-made, eager or
    replayed, on one rank (8 micro-batches) and on rank 0 of 8 (one)."""
    import threading

    from speedrun.train.graphs import RerunCapture, StepGraphs
    from speedrun.train.loop import micro_batching

    for world in (None, 8):
        session = _session(tmp_path / f"{graphs}{world}", (*RECORD, "train.grad_accum=0"), simulate_world=world)
        loader = session.loader
        if graphs:
            session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                        capture_with=RerunCapture, ends_step=world is None)
        count = micro_batching(session.stage, session.cfg, session.info.world_size).count
        assert count == (8 if world is None else 1)
        built_here = []
        produce = loader._produce

        def counted(*a, _produce=produce):
            built_here.append(threading.current_thread() is threading.main_thread())
            return _produce(*a)

        loader._produce = counted
        try:
            for step in range(STEPS_UNTIL_REPLAY + 2):
                before, queued = len(built_here), []  # batches queued at each phase of the step
                session.step(on_phase=lambda name, _loader=loader, _q=queued: _q.append(len(_loader._pending)))
                assert queued == sorted(queued, reverse=True), (step, queued)  # taken, never added
                assert len(loader._pending) == loader.prefetch_batches >= count, step
                assert sum(built_here[before:]) == (count if step == 0 else 0), (step, built_here[before:])
        finally:
            session.close()
        if graphs:
            assert session.graphs.summary()["replayed_steps"] > 0


def test_self_check_names_a_mismatch(tmp_path, kernels_use_references):
    """A replay that computes something else than the eager loop stops the run with the tensor."""
    from speedrun.train.graphs import GraphMismatchError, RerunCapture, StepGraphs

    session = _session(tmp_path, RECORD)
    session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                capture_with=RerunCapture)

    class Poisoned(RerunCapture):
        def capture(self, fn):
            def poisoned():
                fn()
                session.model.lm_head.grad.add_(1.0)  # the graph writes a wrong gradient

            return super().capture(poisoned)

    session.graphs._capture_with = Poisoned
    try:
        with pytest.raises(GraphMismatchError, match="in lm_head.grad"):
            for _ in range(STEPS_UNTIL_REPLAY):
                session.step()
    finally:
        session.close()


def test_a_session_warms_up_until_its_steps_replay(tmp_path, kernels_use_references):
    """Session.warmup_steps (bench, profile, host_profile): without graphs the steps asked for;
    with graphs at least enough that the next steps replay, step graph and update graph alike
    (a profile whose warmup stopped short recorded captures and self-checks: twice the kernels)."""
    from speedrun.train.graphs import RerunCapture, StepGraphs

    session = _session(tmp_path, RECORD)
    try:
        assert session.warmup_steps(2) == 2 and session.warmup_steps(0) == 0
        session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                    capture_with=RerunCapture)
        n = session.warmup_steps(2)
        assert n == max(2, session.graphs.steps_until_replay) > 2
        assert session.warmup_steps(n + 3) == n + 3
        for _ in range(n):
            session.step()
        before = session.graphs.summary()
        for _ in range(2):
            session.step()
        after = session.graphs.summary()
    finally:
        session.close()
    assert after["replayed_steps"] - before["replayed_steps"] == 2, (before, after)
    assert after["replayed_updates"] - before["replayed_updates"] == 2, (before, after)
    assert after["captures"] == before["captures"] and after["update_captures"] == before["update_captures"]


def test_every_step_runs_once_on_the_clock(tmp_path, kernels_use_references, monkeypatch):
    """A capture's own work (eager runs, the capture, its check) happens with the clock paused,
    and it leaves the model as it found it; the step itself then runs on the clock like any
    replayed one.  So each step's micro-batch loop and each optimizer update run exactly once
    outside a pause, whether eager, captured or replayed (a timed region that skipped the
    captured steps would flatter the run's time)."""
    import contextlib

    from speedrun.train import graphs as graphs_module
    from speedrun.train.graphs import RerunCapture, StepGraphs

    paused = []
    timed = {"loop": 0, "update": 0}

    @contextlib.contextmanager
    def pause():
        paused.append(True)
        try:
            yield
        finally:
            paused.pop()

    real_accumulate = graphs_module.microbatch.accumulate

    def accumulate(*a, **k):
        if not paused:
            timed["loop"] += 1
        return real_accumulate(*a, **k)

    monkeypatch.setattr(graphs_module.microbatch, "accumulate", accumulate)
    session = _session(tmp_path, RECORD)
    opt = session.recipe.optimizer
    real_launch = opt.launch_kernels

    def launch_kernels(plan):
        if not paused:
            timed["update"] += 1
        return real_launch(plan)

    monkeypatch.setattr(opt, "launch_kernels", launch_kernels)
    session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                capture_with=RerunCapture, pause=pause)
    steps = STEPS_UNTIL_UPDATE_REPLAY + 3
    try:
        for _ in range(steps):
            session.step()
    finally:
        session.close()
    summary = session.graphs.summary()
    assert summary["captures"] >= 2 and summary["update_captures"] >= 2, summary
    assert timed == {"loop": steps, "update": steps}, (timed, summary)


def test_a_replayed_step_reports_its_key_inputs_and_replay_phases(tmp_path, kernels_use_references):
    """The host phase tracer (``bench step --host-steps``) sees a replayed step's micro-batch work
    as the step key, the input copies and the replay (where a replay's host time goes), a step
    run eagerly or captured as one "forward", and the update and FP8 refresh apart."""
    from speedrun.train.graphs import RerunCapture, StepGraphs
    from speedrun.train.loop import GRAPH_PHASES, STEP_PHASES

    session = _session(tmp_path, RECORD)
    session.graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                capture_with=RerunCapture)
    seen = []
    try:
        for _ in range(STEPS_UNTIL_UPDATE_REPLAY + 1):
            names = []
            session.step(on_phase=names.append)
            seen.append(names)
    finally:
        session.close()
    for names in seen:
        assert set(names) <= {"start", *STEP_PHASES, *GRAPH_PHASES}, names
        assert names.index("fp8_step_end") < names.index("optimizer") < names.index("fp8_refresh")
    first, last = seen[0], seen[-1]
    assert "forward" in first and not set(GRAPH_PHASES) & set(first)  # eager
    assert [n for n in last if n in GRAPH_PHASES or n == "forward"] == list(GRAPH_PHASES)  # replayed

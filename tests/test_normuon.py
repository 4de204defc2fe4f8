"""NorMuon + Adam: update math, mantissa tracking, odd-step Adam, tying, the host-side row marks
of the sparse exchange, and 2-rank gloo == 1 rank."""

from __future__ import annotations

import copy
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from speedrun.optim.adam import adam_update_, new_adam_state
from speedrun.optim.normuon import (
    NorMuonAndAdam,
    OptimizerHyper,
    ParamGroupSpec,
    join_bf16,
    normuon_update_,
    normuon_variance_reduction_,
    record_param_table,
    split_fp32,
)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------
# Pieces


def test_mantissa_roundtrip_is_exact():
    x = torch.randn(1000) * torch.logspace(-20, 20, 1000)
    hi, lo = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000, dtype=torch.int16)
    split_fp32(x, hi, lo)
    assert torch.equal(join_bf16(hi, lo).view(torch.int32), x.view(torch.int32))
    # The bf16 part is the truncated fp32 value: within one bf16 ulp, never rounded away from zero.
    assert (hi.float().abs() <= x.abs()).all()
    assert rel(hi.float(), x) < 1e-2


def test_bf16_weights_with_mantissa_track_the_fp32_master_exactly():
    torch.manual_seed(1)
    p32 = torch.randn(3, 16, 24).bfloat16().float()  # a bf16-representable start
    p16, mant = p32.bfloat16(), torch.zeros(3, 16, 24, dtype=torch.int16)
    bufs32 = [torch.zeros(3, 16, 24), torch.zeros(3, 1, 24)]  # wide: per-column moment
    bufs16 = [torch.zeros(3, 16, 24), torch.zeros(3, 1, 24)]
    lr = torch.tensor([1.0, 2.0, 0.5]).view(3, 1, 1) * 0.02
    for _ in range(4):
        g = torch.randn(3, 16, 24)
        normuon_update_(p32, None, g, *bufs32, lr=lr, wd=0.03, momentum=0.9, beta2=0.9)
        normuon_update_(p16, mant, g, *bufs16, lr=lr, wd=0.03, momentum=0.9, beta2=0.9)
    assert torch.equal(join_bf16(p16, mant), p32)
    assert not torch.equal(p16.float(), p32)  # the low bits matter


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (3, 24, 16)), (torch.float32, (2, 8, 20))])
def test_compiled_update_matches_the_eager_one_and_compiles_once(dtype, shape):
    """The fused (torch.compile'd, Inductor) update against the eager one, over steps whose lr,
    momentum and weight decay all change, as the schedule's do: same weights and state, and one
    graph per function (scalars are not baked into the graph)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from speedrun.train.recipes import cpu_inductor_compiles_bf16_normuon

    if not cpu_inductor_compiles_bf16_normuon():  # bf16 gradients below; the recipe refuses them there
        pytest.skip(f"torch {torch.__version__}'s Inductor CPU backend cannot compile NorMuon's momentum step "
                    "on bf16 gradients")

    torch.manual_seed(3)
    G, rows, cols = shape
    red = (G, rows, 1) if rows >= cols else (G, 1, cols)
    p0 = torch.randn(shape).to(dtype)
    arms = {}
    for name in ("eager", "compiled"):
        mant = torch.zeros(shape, dtype=torch.int16) if dtype == torch.bfloat16 else None
        arms[name] = [p0.clone(), mant, torch.zeros(shape), torch.zeros(red)]
    counter = CompileCounterWithBackend("inductor")
    lr_mul = torch.tensor([1.0, 2.0, 0.5][:G]).view(G, 1, 1)
    for step in range(4):
        g = torch.randn(shape).bfloat16()
        kw = dict(lr=lr_mul * (0.02 - 0.004 * step), wd=0.03 + 0.01 * step, momentum=0.85 + 0.03 * step, beta2=0.9)
        p, mant, buf, sm = arms["eager"]
        normuon_update_(p, mant, g, buf, sm, **kw)
        p, mant, buf, sm = arms["compiled"]
        normuon_update_(p, mant, g, buf, sm, compile_backend=counter, **kw)
    (pe, me, be, se), (pc, mc, bc, sc) = arms["eager"], arms["compiled"]
    assert rel(bc, be) < 1e-6 and rel(sc, se) < 1e-5
    master_e = join_bf16(pe, me) if me is not None else pe
    master_c = join_bf16(pc, mc) if mc is not None else pc
    moved = master_e - p0.float()
    assert moved.abs().max() > 1e-3  # the updates are large enough to see a wrong one
    # Inductor keeps v x scale in fp32 where eager rounds it to bf16: ~1e-3 of each update
    assert rel(master_c - p0.float(), moved) < 5e-3
    assert counter.frame_count == 2


def test_variance_reduction_equalises_rows_and_keeps_norm():
    v = torch.randn(2, 32, 8) * torch.linspace(0.1, 3, 32).view(1, 32, 1)  # tall: per-row moment
    before = v.norm(dim=(-2, -1))
    buf = torch.zeros(2, 32, 1)
    out = normuon_variance_reduction_(v.clone(), buf, 0.9)
    assert torch.allclose(out.norm(dim=(-2, -1)), before, rtol=1e-5)
    row_norms = out.norm(dim=-1)
    assert torch.allclose(row_norms, row_norms.mean(dim=-1, keepdim=True), rtol=1e-4)
    assert torch.allclose(buf, 0.1 * v.square().mean(dim=-1, keepdim=True), rtol=1e-5)
    wide_buf = torch.zeros(2, 1, 32)
    normuon_variance_reduction_(v.mT.contiguous(), wide_buf, 0.9)  # wide: per-column moment
    assert torch.allclose(wide_buf, buf.mT, rtol=1e-5)


def test_adam_matches_textbook_adam_without_decay():
    p = torch.randn(5, 7, dtype=torch.float64)
    q, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    st = new_adam_state(p)
    for t in range(1, 4):
        g = torch.randn(5, 7, dtype=torch.float64)
        adam_update_(p, g, st, lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
        m = 0.8 * m + 0.2 * g
        v = 0.95 * v + 0.05 * g * g
        q -= 0.01 * (m / (1 - 0.8**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-10)
    assert rel(p, q) < 1e-6


def test_adam_cautious_decay_is_masked_and_quadratic_in_lr():
    p = torch.tensor([1.0, 1.0, -1.0, -1.0])
    g = torch.tensor([1.0, -1.0, 1.0, -1.0])  # first update = lr * sign(g)
    st = new_adam_state(p)
    lr, wd = 0.1, 5.0
    adam_update_(p, g, st, lr=lr, betas=(0.9, 0.99), eps=1e-10, weight_decay=wd)
    decay = lr * lr * wd
    expected = torch.tensor([1 - lr - decay, 1 + lr, -1 - lr, -1 + lr + decay])
    assert torch.allclose(p, expected, atol=1e-6)


def test_record_table_values():
    t = {s.label: s for s in record_param_table()}
    assert [s.label for s in record_param_table()][:3] == ["qk_bank", "vo_bank", "mlp_bank"]
    assert t["mlp_bank"].odd_matrix_lr_mul == 2.0 and t["qk_bank"].optim == "normuon"
    assert t["bigram_embed"].comms == "sharded_sparse" and t["bigram_embed"].lr_mul == 75.0
    assert t["lm_head"].betas == (0.5, 0.95) and t["lm_head"].wd_mul == 150.0
    assert t["scalars"].lr_mul == 5.0 and t["scalars"].wd_mul == 0.0
    assert t["mudd_gate_b2"].wd_mul == 0.0 and t["mudd_gate_w1"].wd_mul == 1.0
    h = OptimizerHyper()
    assert (h.adam_lr, h.adam_eps, h.adam_weight_decay) == (0.008, 1e-10, 0.005)
    assert (h.muon_lr, h.muon_beta2, h.muon_weight_decay) == (0.023, 0.9, 1.2)


def test_bad_tables_raise():
    with pytest.raises(ValueError, match="optim"):
        ParamGroupSpec("x", "sgd")
    with pytest.raises(ValueError, match="betas"):
        ParamGroupSpec("x", "adam")
    with pytest.raises(ValueError, match="no ParamGroupSpec"):
        NorMuonAndAdam({"unknown": torch.nn.Parameter(torch.zeros(2))}, record_param_table())
    with pytest.raises(ValueError, match="viewed as matrices"):
        NorMuonAndAdam({"w": torch.nn.Parameter(torch.zeros(10))}, [ParamGroupSpec("w", "normuon", "sharded")])


# ------------------------------------------------------------------------------------------------
# The combined optimizer


TABLE = [
    ParamGroupSpec("bank", "normuon", "sharded"),  # 3 wide matrices: padded to 4 on 2 ranks
    ParamGroupSpec("mlp", "normuon", "sharded", odd_matrix_lr_mul=2.0, matrix_shape=(24, 8)),
    ParamGroupSpec("bank16", "normuon", "sharded"),  # bf16 + mantissa
    ParamGroupSpec("scalars", "adam", "replicated", (0.9, 0.99), lr_mul=5.0, wd_mul=0.0),
    ParamGroupSpec("lm_head", "adam", "sharded", (0.5, 0.95), wd_mul=150.0),
    ParamGroupSpec("bigram", "adam", "sharded_sparse", (0.75, 0.95), lr_mul=75.0, wd_mul=5.0),
    ParamGroupSpec("table", "adam", "sharded", (0.75, 0.95), lr_mul=3.0, wd_mul=5.0),
    ParamGroupSpec("embed", "adam", "sharded", (0.5, 0.95), wd_mul=150.0),
]
WORK = ["scalars", "bigram", "table", "lm_head", "embed", "bank", "mlp", "bank16"]
HYPER = OptimizerHyper(adam_lr=0.02, muon_lr=0.05, adam_weight_decay=0.5, muon_weight_decay=2.0)
SPARSE_ROWS = {0: [0, 1, 5], 1: [1, 6, 7]}


def make_params() -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(1234)
    shapes = {"bank": (3, 8, 12), "mlp": (2, 2, 24, 8), "bank16": (2, 12, 12), "scalars": (6,),
              "lm_head": (4, 10), "bigram": (8, 4), "table": (6, 3), "embed": (10, 4)}
    params = {k: torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for k, s in shapes.items()}
    params["bank16"] = torch.nn.Parameter(params["bank16"].data.bfloat16())
    params["embed"].data.copy_(params["lm_head"].data.T)
    return params


def make_grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    params = make_params()
    grads = {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}
    mask = torch.zeros(8, 1)
    mask[SPARSE_ROWS[rank]] = 1.0
    grads["bigram"] *= mask  # an embedding gradient is zero outside the rows this rank looked up
    return grads


def run_steps(opt: NorMuonAndAdam, params, grads_per_step, mark_sparse: bool) -> None:
    for step, grads in enumerate(grads_per_step):
        for k, p in params.items():
            p.grad = grads[k].clone() if p.grad is None else p.grad + grads[k]
        if mark_sparse:  # host rows as a training step marks them: per micro-batch, numpy or CPU tensors
            rows = SPARSE_ROWS[opt.comms.rank]
            opt.mark_rows("bigram", np.array(rows[:2], dtype=np.int32))
            opt.mark_rows("bigram", torch.tensor(rows[1:], dtype=torch.int32))
        opt.step(step, lr_mult=0.8, muon_momentum=0.9)


def averaged_grads(step: int, world: int) -> dict[str, torch.Tensor]:
    per_rank = [make_grads(r, step) for r in range(world)]
    return {k: (sum(g[k].float() for g in per_rank) / world).to(per_rank[0][k].dtype) for k in per_rank[0]}


def test_adam_waits_for_odd_steps_and_sums_two_gradients():
    params = make_params()
    start = {k: p.detach().clone() for k, p in params.items()}
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, tied=("lm_head", "embed"))
    g0, g1 = make_grads(0, 0), make_grads(0, 1)
    run_steps(opt, params, [g0], mark_sparse=False)
    assert torch.equal(params["scalars"].data, start["scalars"])  # step 0: no Adam
    assert params["scalars"].grad is not None and params["bank"].grad is None
    assert not torch.equal(params["bank"].data, start["bank"])
    for k, p in params.items():
        p.grad = p.grad + g1[k] if p.grad is not None else g1[k].clone()
    opt.step(1, lr_mult=0.8, muon_momentum=0.9)
    expected = start["scalars"].clone()
    adam_update_(expected, g0["scalars"] + g1["scalars"], new_adam_state(expected), lr=0.02 * 0.8 * 5.0,
                 betas=(0.9, 0.99), eps=1e-10, weight_decay=0.0)
    assert torch.allclose(params["scalars"].data, expected, atol=1e-7)
    assert all(p.grad is None for p in params.values())
    # Tied: embed follows lm_head, and lm_head saw embed's gradient too.
    assert torch.equal(params["embed"].data, params["lm_head"].data.T)


def test_untie_copies_transposed_state_and_frees_embed():
    params = make_params()
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, tied=("lm_head", "embed"))
    run_steps(opt, params, [make_grads(0, 0), make_grads(0, 1)], mark_sparse=False)
    opt.untie()
    lm, em = opt.entries["lm_head"].state, opt.entries["embed"].state
    assert torch.equal(em["exp_avg"], lm["exp_avg"].T) and em["step"] == lm["step"] == 1
    run_steps(opt, params, [make_grads(0, 2), make_grads(0, 3)], mark_sparse=False)
    assert not torch.allclose(params["embed"].data, params["lm_head"].data.T)


def test_state_dict_roundtrip_and_reset():
    params = make_params()
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER)
    run_steps(opt, params, [make_grads(0, 0), make_grads(0, 1)], mark_sparse=False)
    import copy

    snap = copy.deepcopy(opt.state_dict())
    opt.reset()
    assert opt.entries["scalars"].state["step"] == 0
    assert opt.entries["bank"].state["momentum_buffer"].abs().sum() == 0
    opt.load_state_dict(snap)
    assert opt.entries["scalars"].state["step"] == 1
    assert torch.equal(opt.entries["bank"].state["momentum_buffer"], snap["labels"]["bank"]["momentum_buffer"])


def test_mark_rows_keeps_host_marks_until_the_adam_step():
    """Rank 0 of 2 (simulated): marks from numpy arrays and CPU tensors of any integer dtype and
    shape land in a host mask, and bool masks of the table's rows are OR-ed into it (one of
    another length is refused); a tensor elsewhere is refused (the meta device stands in for a GPU)
    at any world size; tables not exchanged sparsely, and every table on one rank, keep no marks;
    the marks survive an even step, are cleared by the Adam step and round-trip through
    state_dict as CPU bool tensors (an older checkpoint's bool tensor loads as a fresh host mask)."""
    from speedrun.optim.simcomms import SimulatedComms

    params = make_params()
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, comms=SimulatedComms(2, 0))
    opt.mark_rows("bigram", np.array([0, 5], dtype=np.int32))
    opt.mark_rows("bigram", torch.tensor([[5, 7]]))
    opt.mark_rows("table", np.array([1]))
    assert list(opt._touched) == ["bigram"] and isinstance(opt._touched["bigram"], np.ndarray)
    assert np.flatnonzero(opt._touched["bigram"]).tolist() == [0, 5, 7]
    with pytest.raises(ValueError, match="must be on the host"):
        opt.mark_rows("bigram", torch.tensor([1], device="meta"))
    n = params["bigram"].shape[0]
    mask = np.zeros(n, dtype=np.bool_)
    mask[[2, 5]] = True
    opt.mark_rows("bigram", mask)  # a mask is OR-ed in: the marks before it stay
    opt.mark_rows("bigram", torch.from_numpy(mask))
    assert np.flatnonzero(opt._touched["bigram"]).tolist() == [0, 2, 5, 7]
    with pytest.raises(ValueError, match="one entry per row"):
        opt.mark_rows("bigram", np.ones(n + 1, dtype=np.bool_))
    opt.reset()
    opt.mark_rows("bigram", np.array([0, 5, 7]))

    sd = copy.deepcopy(opt.state_dict())
    assert sd["touched"]["bigram"].dtype == torch.bool and sd["touched"]["bigram"].device.type == "cpu"
    opt.reset()
    assert not opt._touched
    opt.load_state_dict(sd)
    assert np.flatnonzero(opt._touched["bigram"]).tolist() == [0, 5, 7]
    old = dict(sd, touched={"bigram": torch.tensor([True] + [False] * 7)})
    opt.load_state_dict(old)
    old["touched"]["bigram"][1] = True  # the optimizer holds its own copy
    assert np.flatnonzero(opt._touched["bigram"]).tolist() == [0]
    with pytest.raises(ValueError, match="does not match"):
        opt.load_state_dict(dict(sd, touched={"bigram": torch.zeros(9, dtype=torch.bool)}))

    opt.mark_rows("bigram", [3])
    for step in range(2):
        for k, p in params.items():
            p.grad = make_grads(0, step)[k] if p.grad is None else p.grad + make_grads(0, step)[k]
        opt.step(step, lr_mult=0.8, muon_momentum=0.9)
        assert opt._touched["bigram"].any() == (step == 0), step

    solo = NorMuonAndAdam(make_params(), TABLE, work_order=WORK, hyper=HYPER)
    solo.mark_rows("bigram", np.array([1]))
    assert not solo._touched
    with pytest.raises(ValueError, match="must be on the host"):
        solo.mark_rows("bigram", torch.tensor([1], device="meta"))


def test_counts_travel_by_a_cpu_group(monkeypatch):
    """The sparse exchange's counts are host tensors: beside an NCCL group (GPU tensors only) they
    take a gloo group over the same ranks, made once, at the first exchange; a gloo group carries
    them itself."""
    import torch.distributed as dist

    from speedrun.optim.normuon import _Comms

    made, used = [], []
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, backend=None: made.append((ranks, backend)) or "cpu")
    monkeypatch.setattr(dist, "all_to_all_single",
                        lambda out, inp, group=None: used.append(group) or out.copy_(inp.flip(0)))
    comms = _Comms()
    comms.world, comms.nccl = 2, True  # stands in for an NCCL group of two ranks
    for _ in range(2):
        got = comms.exchange_counts(torch.tensor([0, 3]))
    assert torch.equal(got, torch.tensor([3, 0]))
    assert made == [(None, "gloo")] and used == ["cpu", "cpu"]
    comms.nccl = False
    comms.exchange_counts(torch.tensor([0, 3]))
    assert made == [(None, "gloo")] and used[-1] is None  # the group itself
    # given the world's host group (DistInfo.host_group), it makes none of its own
    given = _Comms(host_group="world-gloo")
    given.world, given.nccl = 2, True
    given.exchange_counts(torch.tensor([0, 3]))
    assert made == [(None, "gloo")] and used[-1] == "world-gloo"


def test_schedule_object_drives_the_step():
    from speedrun.optim.schedule import RecordSchedule

    params = make_params()
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, schedule=RecordSchedule(12, 3),
                         tied=("lm_head", "embed"))
    for step in range(10):
        for k, p in params.items():
            g = make_grads(0, step)[k]
            p.grad = g if p.grad is None else p.grad + g
        opt.step(step)
    assert opt.split_embed  # RecordSchedule(12, 3) unties after step 8 | 1 = 9


# ------------------------------------------------------------------------------------------------
# 2 gloo ranks == 1 rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        params = make_params()
        opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, tied=("lm_head", "embed"))
        sparse = []
        real = opt._sparse_reduce
        opt._sparse_reduce = lambda e: sparse.append(e.spec.label) or real(e)
        run_steps(opt, params, [make_grads(rank, 0), make_grads(rank, 1)], mark_sparse=True)
        assert sparse == ["bigram"] and not opt._touched["bigram"].any()  # exchanged sparsely, marks cleared
        opt.untie()
        full_embed_m = torch.empty(10, 4)
        dist.all_gather_into_tensor(full_embed_m, opt.entries["embed"].state["exp_avg"].contiguous())
        if rank == 0:
            torch.save({"params": {k: p.detach() for k, p in params.items()}, "embed_m": full_embed_m},
                       os.path.join(out_dir, "dist.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_rank(tmp_path):
    # 1-rank reference with the rank-averaged gradients (every reduction here is an average).
    params = make_params()
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, tied=("lm_head", "embed"))
    run_steps(opt, params, [averaged_grads(0, 2), averaged_grads(1, 2)], mark_sparse=False)
    opt.untie()
    start = make_params()

    # fork: the children skip re-importing torch (seconds on a loaded 2-core box); they use one
    # intra-op thread, so no OpenMP pool is shared across the fork.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method=method)
    got = torch.load(tmp_path / "dist.pt")
    for k, p in params.items():
        assert not torch.equal(p.data, start[k].data), k  # every parameter moved
        tol = 2e-2 if p.dtype == torch.bfloat16 else 1e-5
        assert rel(got["params"][k], p.data) < tol, k
    assert rel(got["embed_m"], opt.entries["embed"].state["exp_avg"]) < 1e-5


def test_adam_tables_take_the_fused_kernel_when_triton_is_on(monkeypatch):
    """use_triton=True routes every Adam parameter through the one-pass kernel (interpreted here)
    and gives the reference path's values to a few fp32 ulps."""
    import speedrun.optim.adam as adam  # the dispatcher (adam_apply_auto_) calls the kernel from there
    from speedrun.kernels.fp8_cache import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    calls = []
    real = adam.adam_apply_fused_
    monkeypatch.setattr(adam, "adam_apply_fused_", lambda p, *a, **k: calls.append(p.shape) or real(p, *a, **k))
    grads = [make_grads(0, s) for s in range(4)]
    finals = {}
    for use_triton in (False, True):
        params = make_params()
        opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, tied=("lm_head", "embed"),
                             use_triton=use_triton)
        run_steps(opt, params, grads, mark_sparse=False)
        finals[use_triton] = {k: p.detach().clone() for k, p in params.items()}
    adam_labels = [s.label for s in TABLE if s.optim == "adam" and s.label != "embed"]  # embed is tied
    assert len(calls) == 2 * len(adam_labels), calls  # two Adam steps (odd steps 1 and 3)
    for k in adam_labels:
        torch.testing.assert_close(finals[True][k], finals[False][k], rtol=2e-6, atol=1e-7, msg=k)

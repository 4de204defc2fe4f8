"""Rank-of-N bench (speedrun bench step --as-rank-of N): one process runs rank 0's share of an
N-rank step; the simulated communicator's collectives, the optimizer's N-rank shards against a
real 2-rank gloo run's rank 0, the per-rank micro-batches and loader slice, and the result."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from speedrun.cli import main
from speedrun.distributed import DistInfo, simulated_rank
from speedrun.errors import ConfigError
from speedrun.optim.normuon import NorMuonAndAdam, OptimizerHyper, ParamGroupSpec
from speedrun.optim.simcomms import SimulatedComms, comms_for

# ------------------------------------------------------------------------------------------------
# The simulated communicator


def test_simulated_collectives_return_the_real_shapes_without_communicating():
    c = SimulatedComms(4, rank=1)
    assert (c.world, c.rank, c.nccl, c.active) == (4, 1, False, False)
    t = torch.arange(24.0).view(8, 3)
    assert c.all_reduce_avg(t).wait() is t  # the average of 4 equal tensors
    part = c.reduce_scatter_avg(t).wait()
    assert torch.equal(part, t[2:4]) and part.data_ptr() == t[2:4].data_ptr()  # a view of rank 1's chunk
    with pytest.raises(ValueError, match="does not split over 4"):
        c.reduce_scatter_avg(torch.zeros(6, 3))

    # all_gather into the tensor the shard lives in: the other ranks' parts stay as they are
    full = torch.arange(24.0).view(8, 3)
    before = full.clone()
    full[2:4].mul_(-1)  # this rank's update, in place
    assert c.all_gather(full, full[2:4]).wait() is full
    assert torch.equal(full[:2], before[:2]) and torch.equal(full[4:], before[4:])
    assert torch.equal(full[2:4], -before[2:4])
    # ... a shard held elsewhere is written into its place, the rest untouched
    other = torch.full((2, 3), 7.0)
    same_storage = torch.zeros(10, 3)
    out = same_storage[:8]
    c.all_gather(out, same_storage[8:])  # shares the storage but not the place: copied
    assert out[2:4].abs().sum() == 0 and out.abs().sum() == 0
    # a fresh buffer: every part gets this rank's shard, nothing stays uninitialised
    fresh = torch.full((8, 3), float("nan"))
    c.all_gather(fresh, other).wait()
    assert torch.equal(fresh, other.repeat(4, 1))
    with pytest.raises(ValueError, match="does not fill 1/4"):
        c.all_gather(torch.zeros(8, 3), torch.zeros(3, 3))

    # the sparse exchange: nothing arrives from anyone
    assert torch.equal(c.exchange_counts(torch.tensor([0, 0, 3, 1])), torch.zeros(4, dtype=torch.long))
    c.all_to_all(torch.empty(0), torch.arange(4.0), [0, 0, 0, 0], [0, 0, 3, 1])
    with pytest.raises(ValueError, match="receives nothing"):
        c.all_to_all(torch.empty(2), torch.arange(4.0), [0, 2, 0, 0], [0, 0, 3, 1])
    with pytest.raises(ValueError):
        SimulatedComms(2, rank=2)


def test_simulated_collectives_count_the_bytes_a_real_one_moves():
    """traffic: an all-reduce counts its tensor, a reduce-scatter its full input, an all-gather its
    full output, an all-to-all what this rank sends; nothing counts a refused call."""
    c = SimulatedComms(4)
    assert c.traffic == {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "all_to_all": 0}
    c.all_reduce_avg(torch.zeros(5, dtype=torch.bfloat16))
    c.reduce_scatter_avg(torch.zeros(8, 3))
    c.all_gather(torch.zeros(8, 3, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16))
    c.all_to_all(torch.empty(0), torch.zeros(6, dtype=torch.int64), [0, 0, 0, 0], [0, 2, 4, 0])
    with pytest.raises(ValueError):
        c.reduce_scatter_avg(torch.zeros(6, 3))
    assert c.traffic == {"all_reduce": 10, "reduce_scatter": 96, "all_gather": 48, "all_to_all": 48}


def test_simulated_rank_info():
    info = simulated_rank(DistInfo(), 8)
    assert (info.rank, info.world_size, info.simulated, info.enabled, info.is_main) == (0, 8, True, False, True)
    assert isinstance(comms_for(info), SimulatedComms) and comms_for(info).world == 8
    assert comms_for(DistInfo()) is None and not DistInfo().simulated
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ConfigError):
            simulated_rank(DistInfo(), bad)
    with pytest.raises(ConfigError, match="needs one process"):
        simulated_rank(DistInfo(rank=1, world_size=2), 8)


# ------------------------------------------------------------------------------------------------
# The optimizer's share: a simulated rank 0 of 2 against a real 2-rank gloo run's rank 0


TABLE = [
    ParamGroupSpec("bank", "normuon", "sharded"),  # 3 matrices: padded to 4 on 2 ranks (a fresh gather)
    ParamGroupSpec("mlp", "normuon", "sharded", odd_matrix_lr_mul=2.0, matrix_shape=(24, 8)),
    ParamGroupSpec("bank16", "normuon", "sharded"),  # bf16 + mantissa
    ParamGroupSpec("scalars", "adam", "replicated", (0.9, 0.99), lr_mul=5.0, wd_mul=0.0),
    ParamGroupSpec("lm_head", "adam", "sharded", (0.5, 0.95), wd_mul=150.0),
    ParamGroupSpec("bigram", "adam", "sharded_sparse", (0.75, 0.95), lr_mul=75.0, wd_mul=5.0),
    ParamGroupSpec("embed", "adam", "sharded", (0.5, 0.95), wd_mul=150.0),
]
HYPER = OptimizerHyper(adam_lr=0.02, muon_lr=0.05, adam_weight_decay=0.5, muon_weight_decay=2.0)
# bigram rows each rank's batches touch: rank 1 touches none of rank 0's half (rows 0-3), so the
# real rank 0 receives nothing in the sparse exchange, as the simulated one assumes
ROWS = {0: [0, 1, 5], 1: [6, 7]}
SHARD0 = {"bank": slice(0, 2), "mlp": slice(0, 1), "bank16": slice(0, 1), "scalars": slice(None),
          "lm_head": slice(0, 2), "bigram": slice(0, 4),
          "embed": (slice(None), slice(0, 2))}  # tied: embed is lm_head^T, whose rows 0-1 are rank 0's


def _params() -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(7)
    shapes = {"bank": (3, 8, 12), "mlp": (2, 2, 24, 8), "bank16": (2, 12, 12), "scalars": (6,),
              "lm_head": (4, 10), "bigram": (8, 4), "embed": (10, 4)}
    p = {k: torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for k, s in shapes.items()}
    p["bank16"] = torch.nn.Parameter(p["bank16"].data.bfloat16())
    p["embed"].data.copy_(p["lm_head"].data.T)
    return p


def _grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Every rank's gradients equal rank 0's, but for the rows of the bigram table it touched."""
    g = torch.Generator().manual_seed(100 + step)
    grads = {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in _params().items()}
    mask = torch.zeros(8, 1)
    mask[ROWS[rank]] = 1.0
    grads["bigram"] = grads["bigram"] * mask + (rank + 1) * mask
    return grads


def _steps(opt: NorMuonAndAdam, params, rank: int) -> None:
    for step in range(2):  # an even step (NorMuon only) and an odd one (Adam too)
        for k, p in params.items():
            g = _grads(rank, step)[k]
            p.grad = g.clone() if p.grad is None else p.grad + g
        opt.mark_rows("bigram", torch.tensor(ROWS[rank]))
        opt.step(step, lr_mult=0.8, muon_momentum=0.9)


def _state_shapes(opt: NorMuonAndAdam) -> dict:
    return {lab: {k: tuple(v.shape) for k, v in e.state.items() if isinstance(v, torch.Tensor)}
            for lab, e in opt.entries.items()}


from test_normuon import _free_port  # noqa: E402  (one helper for the gloo tests' ports)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        params = _params()
        opt = NorMuonAndAdam(params, TABLE, hyper=HYPER, tied=("lm_head", "embed"))
        _steps(opt, params, rank)
        if rank == 0:
            torch.save({"params": {k: p.detach() for k, p in params.items()}, "shapes": _state_shapes(opt),
                        "chunks": {lab: e.chunk for lab, e in opt.entries.items()}},
                       os.path.join(out_dir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def test_simulated_rank_0_of_2_updates_what_a_real_rank_0_updates(tmp_path):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method=method)
    real = torch.load(tmp_path / "rank0.pt")

    start = _params()
    params = _params()
    opt = NorMuonAndAdam(params, TABLE, hyper=HYPER, tied=("lm_head", "embed"), comms=SimulatedComms(2, 0))
    _steps(opt, params, 0)
    assert _state_shapes(opt) == real["shapes"]  # rank 0's moments, mantissas and Adam tables
    assert {lab: e.chunk for lab, e in opt.entries.items()} == real["chunks"]
    assert opt.entries["bank"].state["momentum_buffer"].shape == (2, 8, 12)  # 2 of the 4 padded matrices
    for k, p in params.items():
        mine = SHARD0[k]
        assert not torch.equal(p.data[mine], start[k].data[mine]), k  # this rank's share moved ...
        torch.testing.assert_close(p.data[mine], real["params"][k][mine], rtol=0, atol=0, msg=k)  # ... exactly
    # the other rank's matrices and rows: left as they were where the gather writes into the weights
    assert torch.equal(params["mlp"].data[1:], start["mlp"].data[1:])
    assert torch.equal(params["bank16"].data[1:], start["bank16"].data[1:])
    assert torch.equal(params["lm_head"].data[2:], start["lm_head"].data[2:])
    assert torch.equal(params["bigram"].data[4:], start["bigram"].data[4:])
    # ... and the bank the optimizer pads itself (3 matrices, a fresh gather buffer): copies of this
    # rank's shard, finite and of the trained size
    assert torch.equal(params["bank"].data[2], params["bank"].data[0])
    assert torch.equal(params["embed"].data, params["lm_head"].data.T)  # still tied
    opt.untie()  # gathers lm_head's Adam moments into a fresh buffer
    assert all(torch.isfinite(v).all() for v in opt.entries["embed"].state.values() if isinstance(v, torch.Tensor))


# ------------------------------------------------------------------------------------------------
# A session: the micro-batches, the loader slice and the optimizer of rank 0 of N


TINY = ["train.grad_accum=0", "model.num_layers=4", "model.model_dim=32", "model.num_heads=2",
        "model.qk_head_dim=12", "train.compile=false"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_simulated_rank_runs_its_share_of_an_n_rank_step(world, use_builtin_cache, kernels_use_references,
                                                              one_thread):
    from speedrun.data import TrainLoader
    from speedrun.evidence.arms import parse_arm
    from speedrun.evidence.bench import build_session
    from speedrun.train.loop import micro_batching, resolve_data

    cfg = parse_arm("r=tiny-record").config(TINY)
    info = DistInfo()
    s = build_session("r", cfg, 0, info, simulate_world=world)
    try:
        assert s.info.simulated and s.info.world_size == world and s.info.rank == 0
        plan = micro_batching(s.stage, cfg, world)
        assert (plan.count, plan.tokens) == (8 // world, s.stage.batch_tokens // 8)  # 8 // N micro-batches of batch / 8
        assert (s.loader.rank, s.loader.world_size) == (0, world)
        opt = s.optimizer
        assert isinstance(opt.comms, SimulatedComms) and opt.comms.world == world
        banks = {lab: opt.entries[lab] for lab in ("qk_bank", "vo_bank", "mlp_bank")}
        for lab, e in banks.items():  # the N-rank shard shapes: ceil(matrices / N) each
            assert e.chunk == -(-e.groups // world), lab
            assert e.state["momentum_buffer"].shape == (e.chunk, e.rows, e.cols), lab
        emb = opt.entries["embed"]
        assert emb.comms == "sharded" and emb.state["exp_avg"].shape[0] == emb.param.shape[0] // world

        # the micro-batches of one step: count, tokens, and rank 0's slice of the N-rank stream
        train_files, _, _ = resolve_data(cfg)
        ref = TrainLoader(train_files, plan.chunk, s.stage.max_seq_len, rank=0, world_size=world,
                          bos_id=cfg.data.bos_id, vocab_size=cfg.model.vocab_size, max_docs=None,
                          device=info.device)
        want = [ref.next_batch() for _ in range(plan.count)]
        ref.close()
        seen = []
        next_batch = s.loader.next_batch
        s.loader.next_batch = lambda **kw: seen.append(next_batch(**kw)) or seen[-1]
        before = {lab: e.param.detach().clone() for lab, e in banks.items()}
        for _ in range(2):  # an even step and an odd one (Adam)
            loss = s.step()
        assert torch.isfinite(loss)
        assert len(seen) == 2 * plan.count
        for got, exp in zip(seen, want):
            assert got.inputs.numel() == plan.tokens and torch.equal(got.inputs, exp.inputs)
        for lab, e in banks.items():  # only this rank's matrices were updated
            new = e.param.detach().view(e.groups, e.rows, e.cols)
            old = before[lab].view(e.groups, e.rows, e.cols)
            mine = min(e.chunk, e.groups)
            assert not torch.equal(new[:mine], old[:mine]), lab
            if e.padded_groups == e.groups:  # gathered into the weights: the others' stay as they were
                assert torch.equal(new[mine:], old[mine:]), lab
            else:  # a padded bank's fresh gather buffer: copies of this rank's matrices
                assert torch.equal(new[e.chunk:2 * e.chunk], new[:e.chunk]) or e.groups < 2 * e.chunk, lab
    finally:
        s.close()


def test_bench_step_as_rank_of_table_and_json(tmp_path, capsys, use_builtin_cache, kernels_use_references,
                                              one_thread):
    out = tmp_path / "r8.json"
    args = ["bench", "step", "--arm", "rec=tiny-record", "--as-rank-of", "8", "--steps", "20", "--warmup", "0",
            "--json", str(out)] + [x for s in TINY for x in ("--set", s)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "rank 0 of 8 simulated (collectives replaced by no-ops)" in text
    assert "micro-batches per step of the simulated rank: rec 1 x 256" in text
    res = json.loads(out.read_text())
    assert res["simulated_world"] == 8 and res["world_size"] == 1
    assert res["simulation"] == "rank 0 of 8 simulated (collectives replaced by no-ops)"
    (arm,) = res["arms"]
    assert (arm["grad_accum"], arm["micro_batch_tokens"]) == (1, 256) and len(arm["times_ms"]) == 20
    assert arm["tokens_per_s"] == pytest.approx(2048 / (arm["median_ms"] / 1000))  # the whole N-rank step's
    # what the untimed collectives would move per step: every step reduce-scatters and gathers the
    # sharded banks; the Adam steps (every other) all-reduce the replicated tables
    moved = arm["comm_bytes_per_step"]
    assert set(moved) == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}
    assert moved["reduce_scatter"] > 0 and moved["all_gather"] > 0 and moved["all_reduce"] > 0
    assert moved["reduce_scatter"] < 4 * 2 * arm["parameters"]  # bytes, not elements, and not inflated
    assert "collectives per step, not timed (MB by kind): rec " in text

    # a world the record's split cannot use, and nonsense
    assert main(args[:4] + ["--as-rank-of", "3"] + args[6:]) == 2
    assert "needs a world size dividing 8, got 3" in capsys.readouterr().err
    assert main(args[:4] + ["--as-rank-of", "0"] + args[6:]) == 2
    assert "ranks >= 1" in capsys.readouterr().err

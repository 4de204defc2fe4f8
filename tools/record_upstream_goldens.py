"""Record golden values from upstream f411b3d's own code into ``tests/fixtures/upstream_f411b3d/``.

    TRITON_INTERPRET=1 python tools/record_upstream_goldens.py UPSTREAM_DIR [--out DIR]

UPSTREAM_DIR holds upstream f411b3d's ``train_gpt.py``, ``triton_kernels.py`` and
``dc_triton_kernels.py`` (``git show f411b3d:train_gpt.py`` etc. in a clone of
KellerJordan/modded-nanogpt; never committed here).  Upstream's code runs on the CPU through
``tests/upstream_model.py`` (its stand-ins for FA3 and, in the network, the Hopper MLP kernel;
its own DC and MLP Triton kernels under the interpreter).  The inputs are rebuilt from the recipes of
``tests/upstream_goldens.py`` (seeds and names), so the fixtures hold only upstream's outputs and
the few small tensors that are not drawn from a recipe.  ``tests/test_upstream_goldens.py`` reads
them.  One fixture per part:

- ``network``: the weights' recipe (small tensors whole), the sign table, eval per-token losses
  (two window/YaRN cases), the gradient of every parameter (sketches of the large ones), and for
  64 rows of the gradient case the loss head's input, loss and d loss / dx;
- ``init``: upstream's initialisation at the same shapes (deterministic tensors whole, the random
  ones' std and largest magnitude);
- ``schedule``: every step's settings of three schedules, the validation sizes;
- ``optimizer``: eight NorMuon + Adam steps around the untie (update sketches, sampled Adam weights);
- ``loader``: training batches at two stage shapes and validation batches of synthetic shards.
- ``mlp``: one MLP layer through upstream's own kernel (``FusedLinearReLUSquareFunction``), bf16
  and the record's FP8 forward (its weight quantisation and delayed activation scale), on inputs
  drawn from recipes: output, d x, d W1, d W2 (sketches).  The kernel runs in Triton's interpreter
  made to round as a GPU does (``tests/interpreter_numerics.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import upstream_goldens as G  # noqa: E402
import upstream_model as U  # noqa: E402

S = G.SHAPES
N = G.NARROW


# ----------------------------------------------------------------------------------------------
# network


def build_upstream_network(up):
    """Upstream's GPT at :data:`SHAPES`, moved off its init by the recipe, fp32, eval mode; and the
    fixture's description of its weights."""
    torch.manual_seed(0)
    model = up.GPT(vocab_size=S.vocab, num_layers=S.num_layers, num_heads=S.num_heads, head_dim=S.head_dim,
                   model_dim=S.model_dim, max_seq_len=S.max_seq_len)
    model = model.float().eval()
    weights = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = G.perturb_scale(name, p.shape, S.model_dim)
            if p.numel() <= G.SMALL:  # upstream's init (zeros, ones, gate biases) plus a perturbation
                p.add_(G.recipe_tensor(name, p.shape, 0, scale))
                if name in ("resid_lambdas", "post_lambdas"):  # upstream's forward rounds these to bf16
                    p.copy_(p.bfloat16())
                weights[name] = {"full": p.detach().clone()}
            else:  # large: random at init anyway, drawn whole from the recipe
                p.copy_(G.recipe_tensor(name, p.shape, 0, scale))
                weights[name] = {"recipe": [0, scale], "shape": list(p.shape), "digest": G.digest(p)}
        for yarn in (model.yarn, model.yarn_paired_head):
            yarn.apply(1, 1)  # rewrites the rotary tables in fp32 (built in bf16); frequencies and scale stay
    return model, weights


def forward_cfg(up, ws_short, ws_long):
    return up.ForwardScheduleConfig(mtp_weights=torch.ones(1), prefix_weight=torch.zeros(()),
                                    ws_short=ws_short, ws_long=ws_long, train_max_seq_len=S.max_seq_len)


def record_network(src: Path, out: Path, *, pr344: bool = False) -> None:
    """The ``network`` fixture; ``pr344``: of PR #344's model (its QK kernel in the interpreter made
    to round as a GPU does), in ``G.PR344_DIR``'s layout conventions: gradients in ours (f411b3d's
    V/O bank layout), compared with the candidate preset's model."""
    from interpreter_numerics import gpu_numerics

    up = U.load_upstream_gpt(src, bigram_vocab_size=S.bigram_vocab, bigram_dim=S.model_dim,
                             bigram_sign_table_rows=S.sign_rows, pr344=pr344)
    with gpu_numerics() if pr344 else contextlib.nullcontext():
        payload = _network_payload(up, pr344)
    G.save_fixture("network", payload, out, commit=G.PR344_COMMIT if pr344 else G.UPSTREAM_COMMIT)


def _network_payload(up, pr344: bool) -> dict:
    model, weights = build_upstream_network(up)
    mod = up.args.bigram_vocab_size - 1
    cases = []
    for case in G.FORWARD_CASES:
        m = copy.deepcopy(model)
        for old, new in case["yarn"]:
            m.yarn.apply(old, new)
            m.yarn_paired_head.apply(old, new)
        batch = G.batch_of(S.docs, S.vocab, case["seed"], mod)
        with torch.no_grad():
            loss = m(*G.upstream_batch(batch, up.get_bigram_hash), forward_cfg(up, *case["windows"]))
        assert loss.std() > 0.5, "the perturbed model must not be near-uniform"
        cases.append({**case, "loss": loss.float()})

    # gradients of the mean eval loss, in our layout (the MLP bank's padding layer dropped, the
    # rotating Q/K rows flipped to our RoPE convention; PR #344's transposed O back to f411b3d's)
    m = copy.deepcopy(model)
    batch = G.batch_of(S.docs, S.vocab, G.GRAD_SEED, mod)
    captured = {}

    def keep_head_input(module, inputs, output):  # the final normed hidden state, as the head gets it
        inputs[0].retain_grad()
        captured["x"] = inputs[0]

    hook = m.lm_head.register_forward_hook(keep_head_input)
    loss = m(*G.upstream_batch(batch, up.get_bigram_hash), forward_cfg(up, 64, 192))
    loss.mean().backward()
    hook.remove()
    # the loss head's golden: some rows' hidden states, losses and d(loss_t)/dx_t (upstream's autograd)
    T = loss.shape[0]
    rows = G.head_rows(T)
    x = captured["x"].detach().reshape(T, -1)
    head = {"rows": rows, "x": x[rows].float().clone(), "loss": loss.detach()[rows].float().clone(),
            "dx": (captured["x"].grad.reshape(T, -1)[rows] * T).float().clone()}
    params = {n: p.detach() for n, p in model.named_parameters()}
    up_grads = {n: p.grad.detach().float().clone() for n, p in m.named_parameters()}
    if pr344:
        params = G.pr344_to_f411b3d_layout(params, model._num_attn_layers)
        up_grads = G.pr344_to_f411b3d_layout(up_grads, model._num_attn_layers)
    ours = G.ours_from_upstream(params, model.bigram_sign_table.float(),
                                model_cfg=G.candidate_config() if pr344 else None)
    grads, padding_norm = {}, None
    for name, p in ours.named_parameters():
        g = up_grads[G.UPSTREAM_NAMES.get(name, name)]
        if name == "mlp_bank":
            padding_norm = g[p.shape[0]:].norm().item()
            g = g[: p.shape[0]]
        if name == "qk_bank":
            G.flip_rotating_rows(g, ours)
        grads[name] = G.compact(g, name)
    return {
        "shapes": vars(S), "weights": weights, "sign_table": G.pack_signs(model.bigram_sign_table.float()),
        "bigram_mod": mod, "cases": cases, "grad_seed": G.GRAD_SEED, "grad_windows": [64, 192],
        "grads": grads, "mlp_padding_grad_norm": padding_norm, "head": head,
    }


def record_init(src: Path, out: Path) -> None:
    """Upstream's init at the fixture shapes: deterministic tensors whole, random ones summarised."""
    up = U.load_upstream_gpt(src, bigram_vocab_size=N.bigram_vocab, bigram_dim=N.model_dim,
                             bigram_sign_table_rows=N.sign_rows)
    torch.manual_seed(0)
    model = up.GPT(vocab_size=N.vocab, num_layers=N.num_layers, num_heads=N.num_heads, head_dim=N.head_dim,
                   model_dim=N.model_dim, max_seq_len=N.max_seq_len)
    stats = {}
    for name, p in model.named_parameters():
        p = p.detach().float()
        entry = {"shape": list(p.shape), "std": p.std().item() if p.numel() > 1 else 0.0,
                 "absmax": p.abs().max().item()}
        if name == "mlp_bank":  # the up and down halves separately (different inits)
            entry["halves"] = [[p[:, i].std().item(), p[:, i].abs().max().item()] for i in (0, 1)]
        if p.numel() <= G.SMALL:
            entry["full"] = p.clone()
        stats[name] = entry
    G.save_fixture("init", {"shapes": vars(N), "params": stats}, out)


# ----------------------------------------------------------------------------------------------
# schedule and validation sizes


def record_schedule(src: Path, out: Path) -> None:
    schedules = []
    for scheduled, extension in G.SCHEDULES:
        up = U.load_upstream_schedule(src, scheduled, extension)
        ts = up.training_schedule
        steps = []
        for step in range(ts.total_steps):
            st, _ = ts.lookup(step)
            steps.append([st.window_sizes[0] * 128, st.window_sizes[1] * 128, st.batch_size, st.train_max_seq_len,
                          ts.prefix_weights[step].item(), ts.get_lr(step), up.get_muon_momentum(step),
                          int(step > 0 and ts.lookup(step - 1)[0].window_sizes[1] != st.window_sizes[1])])
        schedules.append({
            "scheduled": scheduled, "extension": extension, "total_steps": ts.total_steps,
            "boundaries": [list(b) for b in ts.boundaries], "split_step": ts.split_step,
            "warmup_steps": [s for s in up.warmup_steps if s < ts.total_steps],
            "final_eval_windows": [ts.stages[-1].window_sizes[0] * 128, ts.ws_post_yarn_ext * 128],
            # columns: window_short, window_long, batch_tokens, max_seq_len, prefix_weight, lr_mult,
            # muon_momentum, yarn_change
            "steps": torch.tensor(steps, dtype=torch.float64),
            "mtp_weights": [ts.mtp_weights[s].tolist() for s in range(ts.total_steps)],
        })
    args = U.exec_upstream(src, ("Hyperparameters",), {})["Hyperparameters"]()
    G.save_fixture("schedule", {"schedules": schedules, "val_tokens": args.val_tokens,
                                "val_batch_size": args.val_batch_size}, out)


# ----------------------------------------------------------------------------------------------
# optimizer


def record_optimizer(src: Path, out: Path) -> None:
    """Eight steps of upstream's NorMuonAndAdam from recipe weights and recipe gradients, on the
    record-shaped parameter groups of width 96 (labels, shapes and dtypes: ours, which equal
    upstream's; the fixture stores them so that a change shows)."""
    start, grads_of = G.optimizer_inputs()
    up_opt = U.load_upstream_optimizer(src)
    theirs = {}
    for label, p in start.items():
        q = torch.nn.Parameter(p.clone())
        q.label = G.UPSTREAM_NAMES.get(label, label).replace(".weight", "")
        theirs[label] = q
    for label in ("qk_bank", "vo_bank"):
        theirs[label].reshape = tuple(theirs[label].shape)
    mlp = theirs["mlp_bank"]
    mlp.reshape = (2 * mlp.shape[0], *mlp.shape[2:])
    sched_up = U.load_upstream_schedule(src, 1270, 15)
    tm_ns = U.exec_upstream(src, ("TrainingManager",), dict(
        training_schedule=sched_up.training_schedule, get_muon_momentum=sched_up.get_muon_momentum))
    manager = SimpleNamespace(optimizer=None, split_step=sched_up.training_schedule.split_step,
                              _is_adam_step=lambda step: step % 2 == 1)
    manager.optimizer = up_opt.NorMuonAndAdam([(q.label, q) for q in theirs.values()],
                                              **U.upstream_optimizer_arguments(tm_ns["TrainingManager"]))
    records = []
    for step in G.OPTIMIZER_STEPS:
        for label, q in theirs.items():
            grad = grads_of(step, label)
            q.grad = grad.clone() if q.grad is None else q.grad + grad
        state = manager.optimizer.param_states
        before = {lab: G.master_weights(theirs[lab], state[theirs[lab]].get("mantissa")) for lab in G.BANKS}
        tm_ns["TrainingManager"].step_optimizers(manager, step)
        rec = {"updates": {}, "adam": {}, "grad_none": {}}
        for label, q in theirs.items():
            if label in G.BANKS:
                upd = (G.master_weights(q, state[q]["mantissa"]) - before[label]).view(start[label].shape)
                rec["updates"][label] = G.compact(upd, f"update/{label}")
            else:
                rec["adam"][label] = q.detach().reshape(-1)[G.adam_sample(label, q.numel())].clone()
            rec["grad_none"][label] = q.grad is None
        records.append(rec)
    G.save_fixture("optimizer", {
        "labels": {lab: [list(p.shape), str(p.dtype)] for lab, p in start.items()},
        "start_digest": {lab: G.digest(p) for lab, p in start.items()},
        "steps": list(G.OPTIMIZER_STEPS), "records": records,
    }, out)


# ----------------------------------------------------------------------------------------------
# loader


def record_loader(src: Path, out: Path) -> None:
    mod = 1024 * 15 // 2 - 1
    up = U.load_upstream_loader(src, bigram_vocab_size=mod + 1)
    with tempfile.TemporaryDirectory() as tmp:
        files = G.synthetic_shards(Path(tmp))
        gen = up.distributed_data_generator(str(Path(tmp) / "syn_train_*.bin"), 2048, 512, grad_accum_steps=1)
        train = []
        prev = G.LOADER_SHAPES[0]
        for T, L in G.LOADER_SHAPES:
            if (T, L) != prev:
                inputs, targets, cu, bigram, _ = gen.send((T, L, 1))
            else:
                inputs, targets, cu, bigram, _ = next(gen)
            prev = (T, L)
            train.append(G.pack_batch(inputs, targets, cu, bigram))
        digests = [G.file_digest(f) for f in files]
        (Path(tmp) / "val").mkdir()
        vfiles = G.synthetic_shards(Path(tmp) / "val", n_shards=1, seed=1)
        gen = up.distributed_data_generator(str(vfiles[0]), 4096, -1, grad_accum_steps=1, align_to_bos=False)
        val = [G.pack_batch(*next(gen)[:4]) for _ in range(G.VAL_BATCHES)]
        val_digest = G.file_digest(vfiles[0])
    G.save_fixture("loader", {"bigram_mod": mod, "shapes": [list(s) for s in G.LOADER_SHAPES],
                              "train": train, "train_shard_digests": digests,
                              "val": val, "val_shard_digest": val_digest}, out)


def record_mlp(src: Path, out: Path) -> None:
    from interpreter_numerics import gpu_numerics

    up = U.load_upstream_mlp(src)
    inputs = G.mlp_inputs()
    cases = {}
    with gpu_numerics():
        for case, fp8 in (("bf16", False), ("fp8", True)):
            got = U.run_upstream_mlp(up, inputs["x"], inputs["w1"], inputs["w2"], inputs["g"], fp8=fp8)
            cases[case] = {k: (v if k == "act_scale" else G.compact(v, f"mlp.{k}")) for k, v in got.items()}
    G.save_fixture("mlp", {"shape": vars(G.MLP_SHAPE), "sms": U.MLP_SMS, "cases": cases}, out)


PARTS = {"network": record_network, "init": record_init, "schedule": record_schedule,
         "optimizer": record_optimizer, "loader": record_loader, "mlp": record_mlp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("upstream_dir", type=Path, help="folder with upstream f411b3d's three files")
    ap.add_argument("--out", type=Path, default=G.FIXTURE_DIR)
    ap.add_argument("--only", choices=sorted(PARTS), action="append", help="record only these parts")
    ap.add_argument("--pr344", action="store_true",
                    help="UPSTREAM_DIR holds PR #344's (c4c209d) files: record its network (the candidate's "
                         "counterpart) into tests/fixtures/upstream_pr344/")
    a = ap.parse_args(argv)
    missing = [f for f in ("train_gpt.py", "triton_kernels.py", "dc_triton_kernels.py")
               if not (a.upstream_dir / f).is_file()]
    if missing:
        ap.error(f"{a.upstream_dir} lacks {', '.join(missing)}")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if a.pr344:
        if a.only and a.only != ["network"]:
            ap.error("--pr344 records the network part only")
        out = G.PR344_DIR if a.out == G.FIXTURE_DIR else a.out
        record_network(a.upstream_dir, out, pr344=True)
        print(f"wrote {G.fixture_path('network', out)} ({G.fixture_path('network', out).stat().st_size:,} bytes)")
        return 0
    for name in a.only or PARTS:
        PARTS[name](a.upstream_dir, a.out)
        print(f"wrote {G.fixture_path(name, a.out)} ({G.fixture_path(name, a.out).stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

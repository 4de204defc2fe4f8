"""The record arm against golden values recorded from upstream f411b3d's own code
(``tests/fixtures/upstream_f411b3d/``, written by ``tools/record_upstream_goldens.py``; shapes,
recipes and the reader in ``tests/upstream_goldens.py``).  No upstream source is needed: these run
on every CI run.  ``tests/test_upstream_equivalence.py`` runs the same comparisons live when
``SPEEDRUN_UPSTREAM_SRC`` is set; the tolerances here are the live tests'.

What the fixtures pin: the evaluation per-token loss (softcapped cross-entropy) of the whole
network in two window/YaRN cases, the gradient of every parameter, upstream's initialisation, every
step of three schedules, the validation sizes, eight NorMuon + Adam steps around the untie (one of
them also through the optimizer's Triton kernels), the data generator's training and validation
batches, and the loss head on 64 of upstream's final hidden states (against which the presets'
Triton CE kernel runs, bf16 and FP8), and one MLP layer through upstream's own MLP kernel (bf16 and
its FP8 forward; the presets' MLP kernels run against it).  The training loss's MTP and prefix terms run in
upstream's CUDA C cross-entropy kernel and cannot be recorded on a CPU; the schedule fixture pins
their weights.
"""

from __future__ import annotations

import pytest
import torch

import upstream_goldens as G
from speedrun.model.interface import ForwardArgs

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 5e-5  # per-token losses, fp32 on both sides (as the live tests)
GRAD_RTOL = 5e-5  # relative per parameter; upstream's bf16-rounded lambdas get bf16 gradients
LAMBDA_GRAD_RTOL = 4e-3
UPDATE_RTOL = 0.05  # NorMuon: Polar Express rounds differently in bf16 on the two sides


@pytest.fixture(scope="module")
def network():
    payload = G.load_fixture("network")
    return payload, G.network_params(payload), G.unpack_signs(payload["sign_table"])


def _ours(network):
    payload, params, signs = network
    return G.ours_from_upstream(params, signs)


def _batch(payload, seed):
    return G.batch_of(G.SHAPES.docs, G.SHAPES.vocab, seed, payload["bigram_mod"])


@pytest.mark.parametrize("case", range(len(G.FORWARD_CASES)))
def test_eval_forward_matches_goldens(network, case):
    payload = network[0]
    want = G.require(payload, "cases", "network")[case]
    ours = _ours(network)
    for old, new in want["yarn"]:  # the long window grew (stage changes): YaRN on both sides
        ours.yarn.apply(old, new)
    ws, wl = want["windows"]
    with torch.no_grad():
        got = ours.per_token_loss(_batch(payload, want["seed"]), ForwardArgs(window_short=ws, window_long=wl))
    assert got.shape == want["loss"].shape == (sum(G.SHAPES.docs),)
    torch.testing.assert_close(got, want["loss"], rtol=0, atol=ATOL)


def test_gradients_match_goldens(network):
    """Every parameter's gradient of the mean evaluation loss (sketched for the large ones: the
    sketch's relative error estimates the true one); upstream's padding MLP layer gets none."""
    payload = network[0]
    ours = _ours(network)
    G.grad_case_backward(ours, payload)
    grads = G.require(payload, "grads", "network")
    assert payload["mlp_padding_grad_norm"] == 0
    assert sorted(grads) == sorted(n for n, _ in ours.named_parameters())
    for name, err in G.gradient_errors(ours, grads).items():
        assert err is not None, name
        assert err < (LAMBDA_GRAD_RTOL if name in ("post_lambdas", "resid_lambdas") else GRAD_RTOL), (name, err)


def test_a_miswired_gate_is_caught_by_the_goldens(network):
    """The tolerance is tight enough: swapping the two XSA lanes of the pre gate moves the losses far
    past it, and the sketched gradient comparison sees a single wrong element of a large tensor."""
    payload = network[0]
    want = payload["cases"][0]
    ours = _ours(network)
    with torch.no_grad():
        w2, b2 = ours.mudd_gate_w2[0], ours.mudd_gate_b2[0]
        w2[[*range(6, 12), *range(0, 6)]] = w2[:12].clone()
        b2[[*range(6, 12), *range(0, 6)]] = b2[:12].clone()
        got = ours.per_token_loss(_batch(payload, want["seed"]), ForwardArgs(*want["windows"]))
    assert (got - want["loss"]).abs().max() > 20 * ATOL
    big = next(n for n, w in payload["grads"].items() if "sketch" in w)
    g = torch.zeros(payload["grads"][big]["shape"])
    g.view(-1)[12345] = 1.0
    ref = {"sketch": G.sketch(torch.zeros_like(g), big).float() + 1e-3, "shape": list(g.shape)}
    assert G.relative_error(g, ref, big) > 100 * GRAD_RTOL


# ----------------------------------------------------------------------------------------------
# The presets' loss-head kernels (Triton, under the interpreter on a CPU) on upstream's hidden states

# (largest |loss difference| per token, mean |loss difference|, relative error of d loss / dx) against
# upstream's fp32 head on the same hidden states.  bf16 operands: measured 0.018, 0.005, 0.003; FP8
# (e4m3 x and W with the record's static scales, e5m2 gradient): 0.23, 0.063, 0.050.
HEAD_BOUNDS = {"bf16": (0.05, 0.012, 0.01), "fp8": (0.5, 0.12, 0.1)}


def _head_case(network):
    payload, params = network[0], network[1]
    head = G.require(payload, "head", "network")
    targets = _batch(payload, payload["grad_seed"]).targets[head["rows"]]
    return head, params["lm_head.weight"], targets


def _head_errors(head, weight, targets, *, use_fp8, softcap=None, sigmoid="exact"):
    from speedrun.kernels.cross_entropy import DEFAULT_SOFTCAP, fused_softcapped_ce

    x = head["x"].bfloat16().requires_grad_()
    loss = fused_softcapped_ce(x, weight.bfloat16().contiguous(), targets, use_fp8=use_fp8,
                               softcap=softcap or DEFAULT_SOFTCAP, ce_backend="triton", sigmoid=sigmoid)
    loss.sum().backward()
    diff = (loss.detach() - head["loss"]).abs()
    dx = ((x.grad.float() - head["dx"]).norm() / head["dx"].norm()).item()
    return diff.max().item(), diff.mean().item(), dx


@pytest.mark.parametrize("sigmoid", ["exact", "tanh"])
@pytest.mark.parametrize("path", ["bf16", "fp8"])
def test_loss_head_kernels_match_goldens(network, path, sigmoid):
    """The training loss head of the presets (lm_head GEMM in bf16, or FP8 as ``kernels=fp8``, then
    the Triton softcapped cross-entropy kernel writing the gradient) on 64 of upstream's final
    hidden states: per-token losses and d loss / dx against upstream's own forward and autograd,
    within bf16 / FP8 bounds (``train.ce_sigmoid`` both ways)."""
    from speedrun.kernels.fp8_cache import interpreting

    if not interpreting():
        pytest.skip("the Triton CE kernel needs TRITON_INTERPRET=1 on a CPU")
    head, weight, targets = _head_case(network)
    errors = _head_errors(head, weight, targets, use_fp8=path == "fp8", sigmoid=sigmoid)
    assert all(e <= b for e, b in zip(errors, HEAD_BOUNDS[path])), (errors, HEAD_BOUNDS[path])


def test_loss_head_bounds_catch_a_wrong_softcap(network):
    """The bounds are tight enough: the softcap of an older record (30 * sigmoid(z / 7.5), not
    shifted by 5) breaks even the FP8 bound."""
    from speedrun.kernels.fp8_cache import interpreting

    if not interpreting():
        pytest.skip("the Triton CE kernel needs TRITON_INTERPRET=1 on a CPU")
    head, weight, targets = _head_case(network)
    errors = _head_errors(head, weight, targets, use_fp8=False, softcap=(30.0, 0.0, 7.5))
    assert any(e > b for e, b in zip(errors, HEAD_BOUNDS["fp8"])), errors


def test_init_matches_goldens():
    """Every parameter starts as upstream's: equal where upstream's init is deterministic, the same
    spread and bound where it draws (the draws themselves differ)."""
    from speedrun.model.record import RecordGPT

    payload = G.load_fixture("init")
    params = G.require(payload, "params", "init")
    ours = RecordGPT(G.our_config(G.NARROW), G.our_arch(G.NARROW))
    random = {"qk_bank", "vo_bank", "mlp_bank", "lm_head", "embed", "value_embeds", "mudd_w1", "mudd_gate_w1",
              "bigram_embed"}
    for name, p in ours.named_parameters():
        want = params[G.UPSTREAM_NAMES.get(name, name)]
        mine = p.detach().float()
        shape = want["shape"][:]
        if name == "mlp_bank":
            shape[0] = mine.shape[0]
        assert list(mine.shape) == shape, name
        if name not in random:
            assert "full" in want, name
            torch.testing.assert_close(mine, want["full"], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            continue
        if name == "mlp_bank":
            for i, (std, absmax) in enumerate(want["halves"]):
                part = mine[:, i]
                assert part.std().item() == pytest.approx(std, rel=0.03, abs=1e-12), name
                assert part.abs().max().item() == pytest.approx(absmax, rel=0.01, abs=1e-12), name
            continue
        if name not in ("lm_head", "embed", "value_embeds", "bigram_embed"):  # uniform draws: the same bound
            assert mine.abs().max().item() == pytest.approx(want["absmax"], rel=0.01, abs=1e-12), name
        assert mine.std().item() == pytest.approx(want["std"], rel=0.03, abs=1e-12), name
    assert torch.equal(ours.embed, ours.lm_head.T)


@pytest.mark.parametrize("index", range(len(G.SCHEDULES)))
def test_schedule_matches_goldens(index):
    from speedrun.config import record
    from speedrun.train.recipes import record_schedule

    want = G.require(G.load_fixture("schedule"), "schedules", "schedule")[index]
    cfg = record()
    cfg.train.steps, cfg.train.num_extension = want["scheduled"] + want["extension"], want["extension"]
    ours = record_schedule(cfg)
    assert ours.total_steps == want["total_steps"]
    assert [list(b) for b in ours.boundaries] == want["boundaries"]
    assert ours.split_step == want["split_step"]
    assert ours.warmup_steps() == want["warmup_steps"]
    assert list(ours.final_eval_windows()) == want["final_eval_windows"]
    for step in range(ours.total_steps):
        ws, wl, bt, msl, pw, lr, mom, yarn = want["steps"][step].tolist()
        got = ours.at(step)
        assert (got.window_short, got.window_long, got.batch_tokens, got.max_seq_len) == (ws, wl, bt, msl), step
        assert got.mtp_weights == pytest.approx(want["mtp_weights"][step], rel=1e-6, abs=1e-7), step
        assert got.prefix_weight == pytest.approx(pw, rel=1e-6, abs=1e-7), step
        assert got.lr_mult == pytest.approx(lr, rel=1e-12), step
        assert got.muon_momentum == pytest.approx(mom, rel=1e-12), step
        assert got.adam_step == (step % 2 == 1)
        if step:
            assert got.yarn_change == bool(yarn), step


def test_validation_sizes_match_goldens():
    from speedrun.config import record

    payload = G.load_fixture("schedule")
    cfg = record()
    assert cfg.train.val_tokens == G.require(payload, "val_tokens", "schedule")
    assert cfg.train.val_batch_tokens * 8 == G.require(payload, "val_batch_size", "schedule")


def _assert_same_adam_weights(mine: torch.Tensor, ref: torch.Tensor, what: str, fused: bool = False) -> None:
    """fp32 weights agree to a few ulps; bf16 weights are equal but for the rare element whose fp32
    value sits at a rounding boundary, which may land one bf16 step away (``fused``: any element
    may, see :func:`test_optimizer_steps_match_goldens`)."""
    if mine.dtype == torch.float32:
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0, msg=lambda m: f"{what}: {m}")
        return
    steps = (mine.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (fused or (steps > 0).float().mean() < 1e-2), (what, steps.max().item())


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_optimizer_steps_match_goldens(use_triton):
    """Eight steps around the untie (844-851) from recipe weights and gradients: NorMuon's fp32
    master updates (sketched) and Adam's weights (sampled) against upstream's NorMuonAndAdam.

    ``triton``: the presets' kernel path on a GPU (Polar Express and the fused Adam update as Triton
    kernels, here under the interpreter) for the second step, an Adam step, after the first on the
    reference path (one step: the interpreter is slow).  The fused Adam's fp32 arithmetic differs from upstream's by a
    few fp32 ulps (``tests/test_fused_adam.py``), which moves a bf16 weight one step wherever its
    update lands near a rounding boundary, so there the bound is one bf16 step per element, with no
    bound on how many."""
    from speedrun.kernels.fp8_cache import interpreting

    if use_triton and not interpreting():
        pytest.skip("the optimizer's Triton kernels need TRITON_INTERPRET=1 on a CPU")
    from speedrun.optim.normuon import NorMuonAndAdam, OptimizerHyper, record_param_table
    from speedrun.optim.schedule import RecordSchedule

    payload = G.load_fixture("optimizer")
    model = G.optimizer_model()
    ours = model.parameter_groups()
    assert {lab: [list(p.shape), str(p.dtype)] for lab, p in ours.items()} == payload["labels"]
    for lab, p in ours.items():
        if G.digest(p.detach()) != payload["start_digest"][lab]:
            raise G.GoldenFixtureError(f"{G.fixture_path('optimizer')}: the starting weights of {lab} differ from "
                                       f"the recording's; regenerate it with {G.REGENERATE}")
    opt = NorMuonAndAdam(ours, record_param_table(), hyper=OptimizerHyper(), tied=("lm_head", "embed"),
                         use_triton=False)
    sched = RecordSchedule()
    steps = list(zip(payload["steps"], payload["records"], strict=True))
    if use_triton:
        steps = steps[:2]
        assert sched.at(steps[1][0]).adam_step, "the kernel path's step must update Adam's parameters too"
    for i, (step, rec) in enumerate(steps):
        opt.use_triton = use_triton and i == 1
        for label, p in ours.items():
            grad = G.optimizer_grad(step, label, p)
            p.grad = grad.clone() if p.grad is None else p.grad + grad
        before = {lab: G.master_weights(ours[lab], opt.entries[lab].state.get("mantissa")) for lab in G.BANKS}
        s = sched.at(step)
        opt.step(step, lr_mult=s.lr_mult, muon_momentum=s.muon_momentum)
        if s.untie:
            opt.untie()
        for label, p in ours.items():
            if label in G.BANKS:
                upd = G.master_weights(p, opt.entries[label].state["mantissa"]) - before[label]
                err = G.relative_error(upd, rec["updates"][label], f"update/{label}")
                assert err < UPDATE_RTOL, (step, label, err)
            else:
                mine = p.detach().reshape(-1)[G.adam_sample(label, p.numel())]
                _assert_same_adam_weights(mine, rec["adam"][label], f"step {step} {label}", fused=opt.use_triton)
            assert (p.grad is None) == rec["grad_none"][label], (step, label)


def test_training_batches_match_goldens(tmp_path):
    """Batches at stage-1 then stage-2 shapes (re-sized as at a stage change), one rank: the same
    tokens, targets, document edges and bigram ids as upstream's generator."""
    from speedrun.data.loader import TrainLoader

    payload = G.load_fixture("loader")
    files = G.synthetic_shards(tmp_path)
    assert [G.file_digest(f) for f in files] == payload["train_shard_digests"], "the synthetic shards changed"
    shapes = [tuple(s) for s in payload["shapes"]]
    with TrainLoader(files, *shapes[0], bos_id=50256, prefetch=False, bigram_mod=payload["bigram_mod"]) as ours:
        prev = shapes[0]
        for i, ((T, L), want) in enumerate(zip(shapes, payload["train"], strict=True)):
            if (T, L) != prev:
                ours.set_shape(T, L)
            prev = (T, L)
            _assert_batch(ours.next_batch(), want, i)


def test_validation_batches_match_goldens(tmp_path):
    from speedrun.data.loader import ValLoader

    payload = G.load_fixture("loader")
    files = G.synthetic_shards(tmp_path, n_shards=1, seed=1)
    assert G.file_digest(files[0]) == payload["val_shard_digest"], "the synthetic shard changed"
    n = len(payload["val"])
    ours = ValLoader(files, n * 4096, 4096, bos_id=50256, bigram_mod=payload["bigram_mod"])
    assert len(ours) == n
    for i, (b, want) in enumerate(zip(ours, payload["val"], strict=True)):
        _assert_batch(b, want, i)


def _assert_batch(b, want, i):
    assert torch.equal(b.inputs.long(), G.from16(want["inputs"])), i
    assert torch.equal(b.targets.long(), G.from16(want["targets"])), i
    assert torch.unique_consecutive(b.cu_seqlens.long()).tolist() == want["edges"].tolist(), i
    assert torch.equal(b.bigram.long(), G.from16(want["bigram"])), i


# ----------------------------------------------------------------------------------------------
# The presets' MLP kernels (Triton, under the interpreter) against upstream's own MLP kernel

# Largest relative error (output, d x, d W1, d W2; through the sketches) of our relu2_mlp in a mode
# against upstream's kernel on the same inputs.  Measured at recording: bf16 0.0047 (both round
# post and the outputs to bf16); fp8_fwd against upstream's FP8 forward 0.049 (each side's own e4m3
# scales; upstream's FP8 path is 0.058 from fp32); fp8_full 0.089 (its backward in FP8 too).
MLP_BOUNDS = {"bf16": ("bf16", 0.01), "fp8_fwd": ("fp8", 0.08), "fp8_full": ("fp8", 0.15)}


def _mlp_errors(got: dict, want: dict) -> dict:
    return {k: G.relative_error(got[k], want[k], f"mlp.{k}") for k in ("y", "dx", "dw1", "dw2")}


@pytest.fixture(scope="module")
def mlp_golden():
    from speedrun.kernels.fp8_cache import interpreting

    if not interpreting():
        pytest.skip("the MLP kernels need TRITON_INTERPRET=1 on a CPU")
    payload = G.load_fixture("mlp")
    if payload.get("shape") != vars(G.MLP_SHAPE):
        raise G.GoldenFixtureError(f"{G.fixture_path('mlp')}: recorded at {payload.get('shape')}, not "
                                   f"{vars(G.MLP_SHAPE)}; regenerate it with {G.REGENERATE}")
    return G.mlp_inputs(), G.require(payload, "cases", "mlp")


@pytest.mark.parametrize("mode", sorted(MLP_BOUNDS))
def test_mlp_kernels_match_upstreams_kernel(mlp_golden, mode):
    """One layer of the presets' ReLU² MLP (``relu2_mlp``: bf16; ``fp8_fwd``, the record's FP8
    forward; ``fp8_full``, the candidate's FP8 forward and backward) against upstream's own
    ``FusedLinearReLUSquareFunction`` (bf16, or its FP8 forward at a training step's delayed
    activation scale): output and every gradient within the mode's bound."""
    inputs, cases = mlp_golden
    case, bound = MLP_BOUNDS[mode]
    errors = _mlp_errors(G.our_mlp(inputs, mode), cases[case])
    assert max(errors.values()) < bound, (mode, errors)


def test_mlp_bounds_catch_a_wrong_layout_and_a_halved_gradient(mlp_golden):
    """The bounds bite: c_proj read in the wrong layout (its (H, D) storage reshaped, not
    transposed) moves the output, and a gradient off by the factor of 2 in d relu(z)^2 moves the
    gradients, each far past even the loosest bound."""
    inputs, cases = mlp_golden
    loosest = max(b for _, b in MLP_BOUNDS.values())
    H, D = inputs["w2"].shape
    wrong_layout = {**inputs, "w2": inputs["w2"].reshape(D, H).t().contiguous()}
    assert _mlp_errors(G.our_mlp(wrong_layout, "bf16"), cases["bf16"])["y"] > 5 * loosest
    halved = _mlp_errors(G.our_mlp({**inputs, "g": inputs["g"] * 0.5}, "bf16"), cases["bf16"])
    assert min(halved[k] for k in ("dx", "dw1", "dw2")) > 3 * loosest, halved


# ----------------------------------------------------------------------------------------------
# Bad fixture files: a clear error naming the file and the script that regenerates it


def test_missing_fixture_names_file_and_script(tmp_path):
    with pytest.raises(G.GoldenFixtureError, match=r"network\.pt: missing; regenerate it with python tools/record_upstream_goldens\.py"):
        G.load_fixture("network", tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other_format", "other_name"])
def test_corrupt_fixture_names_file_and_script(tmp_path, damage):
    path = G.save_fixture("schedule", {"val_tokens": 1}, tmp_path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(b"not a fixture at all")
    elif damage == "other_format":
        torch.save({"format": G.FORMAT + 1, "name": "schedule", "payload": {}}, path)
    else:
        G.save_fixture("loader", {}, tmp_path).rename(path)
    with pytest.raises(G.GoldenFixtureError, match=r"schedule\.pt: .*regenerate it with python tools/record_upstream_goldens\.py"):
        G.load_fixture("schedule", tmp_path)


def test_fixture_lacking_a_key_names_file_and_script():
    with pytest.raises(G.GoldenFixtureError, match=r"schedule\.pt lacks 'nope'; regenerate"):
        G.require({}, "nope", "schedule")


def test_fixtures_are_small():
    sizes = {p.name: p.stat().st_size for p in G.FIXTURE_DIR.glob("*.pt")}
    assert set(sizes) == {"network.pt", "init.pt", "schedule.pt", "optimizer.pt", "loader.pt", "mlp.pt"}, sizes
    assert sum(sizes.values()) < 2 * 2**20, sizes

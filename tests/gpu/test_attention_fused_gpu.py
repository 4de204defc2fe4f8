"""The fused attention backends (fa4, cudnn) on a CUDA GPU against the reference backend: outputs
and all three gradients on random packed batches (ragged documents, padding slots, windows
shorter and longer than documents, Q/K width 96 and 128 with V 128), replay inside a CUDA graph,
a compiled call, and the record network on each.

Bounds (bf16 inputs; the reference runs the same bf16 values in fp32): relative Frobenius error
of the output < 1e-2 and of dq, dk, dv < 2e-2 -- several times what bf16 rounding of the output
and gradients alone gives (~3e-3), far below what a wrong mask or offset gives (> 0.3).

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_attention_fused_gpu.py``.
A backend whose package is not installed (``nvidia-cudnn-frontend``, ``flash-attn-4``) is skipped;
one installed but broken fails.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from speedrun.attention import backend_problem, get_backend, resolve_backend  # noqa: E402
from speedrun.attention.reference import reference_attention  # noqa: E402

OUT_TOL, GRAD_TOL = 1e-2, 2e-2
FUSED = ("fa4", "cudnn")  # in the order ``auto`` tries them


@pytest.fixture(params=FUSED)
def backend(request) -> str:
    """A fused backend's name; skipped where its package is not installed."""
    problem = backend_problem(request.param, torch.device("cuda"))
    if problem is not None and "not installed" in problem:
        pytest.skip(problem)
    return request.param


def test_backend_is_usable_here(backend):
    """Installed, so it must pass its own self-check (and ``auto`` picks fa4 first, then cudnn)."""
    assert backend_problem(backend, torch.device("cuda")) is None
    first = next(b for b in FUSED if backend_problem(b, torch.device("cuda")) is None)
    assert resolve_backend("auto", "cuda") == first


def _docs(T: int, seed: int) -> torch.Tensor:
    """cu_seqlens with ragged documents (1-token ones, some long), then 3 empty padding slots."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(T - 1, generator=g)[:12] + 1
    starts = sorted(set(cuts.tolist()) | {1, T - 1})  # a 1-token first and last document
    return torch.tensor([0, *starts, T, T, T, T], dtype=torch.int32, device="cuda")


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """Relative Frobenius error; ``floor``: the smallest denominator (a gradient that is exactly
    zero, dQ and dK at window 0, is compared on the scale of the others, not of its rounding noise)."""
    return ((a.float() - b.float()).norm() / max(b.float().norm().item(), floor)).item()


def _compare(backend, T, H, dqk, dv, window, seed, scale=None):
    cu = _docs(T, seed)
    max_len = int((cu[1:] - cu[:-1]).max())
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, dqk, device="cuda", generator=g).bfloat16()
    k = torch.randn(T, H, dqk, device="cuda", generator=g).bfloat16()
    v = torch.randn(T, H, dv, device="cuda", generator=g).bfloat16()
    dy = torch.randn(T, H, dv, device="cuda", generator=g).bfloat16()
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    y = get_backend(backend, "cuda")(*xs, cu, max_len + 7, window=window, scale=scale)
    y.backward(dy)
    rs = [t.float().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*rs, cu, max_len, window=window, scale=scale)
    ref.backward(dy.float())
    assert y.dtype == torch.bfloat16 and y.shape == (T, H, dv)
    floor = 1e-3 * rs[2].grad.norm().item()
    errs = {"out": _rel(y, ref), "dq": _rel(xs[0].grad, rs[0].grad, floor), "dk": _rel(xs[1].grad, rs[1].grad, floor),
            "dv": _rel(xs[2].grad, rs[2].grad)}
    assert errs["out"] < OUT_TOL, errs
    assert max(errs["dq"], errs["dk"], errs["dv"]) < GRAD_TOL, errs
    for t in (y, *(x.grad for x in xs)):
        assert torch.isfinite(t).all()
    return errs


@pytest.mark.parametrize("dqk", [96, 128])
@pytest.mark.parametrize("window", [0, 37, 640, 5000, None])
def test_matches_reference(backend, dqk, window):
    # T not a multiple of 64; windows 0 (the diagonal only) and 37 are shorter than most
    # documents, 640 is shorter than some, 5000 and None longer than all of them
    _compare(backend, 3001, 6, dqk, 128, window, seed=dqk + (window or 1), scale=0.12 if window == 640 else None)


def test_paired_head_layout(backend):
    """The record's paired layers: 2T positions of 3 heads, window in doubled positions."""
    _compare(backend, 2 * 2048, 3, 96, 128, 640, seed=5, scale=0.12)


def test_fp32_inputs_are_cast_and_returned_in_fp32(backend):
    T, H = 256, 2
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(T, H, 128, device="cuda") for _ in range(3))
    y = get_backend(backend, "cuda")(q, k, v, cu, 156, window=64, scale=0.1)
    ref = reference_attention(q, k, v, cu, 156, window=64, scale=0.1)
    assert y.dtype == torch.float32 and _rel(y, ref) < OUT_TOL


def test_graphs_are_built_once_and_reused():
    """cudnn only: its graphs are built per shape key, then only executed."""
    if backend_problem("cudnn", torch.device("cuda")) is not None:
        pytest.skip(backend_problem("cudnn", torch.device("cuda")))
    from speedrun.attention.cudnn import default_runner

    fn = get_backend("cudnn", "cuda")
    T, H = 512, 2
    q, k, v = (torch.randn(T, H, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 100, 300, 512, 512], dtype=torch.int32, device="cuda")
    fn(q, k, v, cu, 256, window=64, scale=0.1).sum().backward()
    builds = default_runner().builds
    for lengths in ([0, 10, 400, 512, 512], [0, 256, 257, 300, 512]):  # other documents, same slots
        fn(q, k, v, torch.tensor(lengths, dtype=torch.int32, device="cuda"), 256, window=64, scale=0.1).sum().backward()
    assert default_runner().builds == builds


def test_replays_inside_a_cuda_graph(backend):
    """Forward + backward captured once, replayed on new values (q, k, v, dy and the document
    starts copied into the static inputs): equal to eager calls on those values."""
    fn = get_backend(backend, "cuda")
    T, H, dqk, dv, W = 2048, 6, 96, 128, 640
    g = torch.Generator(device="cuda").manual_seed(0)

    def fresh():
        return [torch.randn(T, H, d, device="cuda", generator=g).bfloat16() for d in (dqk, dqk, dv, dv)]

    sq, sk, sv = (t.requires_grad_() for t in fresh()[:3])
    sdy = torch.randn(T, H, dv, device="cuda", generator=g).bfloat16()
    scu = torch.tensor([0, 300, 1000, 1001, T, T], dtype=torch.int32, device="cuda")

    def step():
        for t in (sq, sk, sv):
            t.grad = None
        y = fn(sq, sk, sv, scu, 1200, window=W, scale=0.1)
        y.backward(sdy)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warmup builds the graphs outside the capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = step()
    for cu_new in ([0, 300, 1000, 1001, T, T], [0, 5, 1100, 1800, 2000, T]):
        q, k, v, dy = fresh()
        with torch.no_grad():
            for dst, src in ((sq, q), (sk, k), (sv, v), (sdy, dy)):
                dst.copy_(src)
            scu.copy_(torch.tensor(cu_new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        ye = fn(*xs, scu.clone(), 1200, window=W, scale=0.1)
        ye.backward(dy)
        assert _rel(ys, ye) < 1e-4  # the same kernels on the same values
        for a, b in zip((sq.grad, sk.grad, sv.grad), (x.grad for x in xs)):
            assert _rel(a, b) < 1e-3  # the backward's dQ accumulation order is not fixed


def test_runs_inside_torch_compile(backend):
    """The backend inside a compiled function (fullgraph: no graph breaks), forward and backward."""
    fn = get_backend(backend, "cuda")
    T, H = 1024, 4
    cu = torch.tensor([0, 200, 700, T, T], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.randn(T, H, 96, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(T, H, 128, device="cuda", generator=g).bfloat16().requires_grad_()

    def f(q, k, v):
        y = fn(q * 1.5, torch.nn.functional.rms_norm(k, (96,)), v, cu, 600, window=128, scale=0.1)
        return (y.float() ** 2).mean()

    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True)(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = f(q, k, v)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())
    for a, t in zip(grads, (q, k, v)):
        assert _rel(a, t.grad) < 1e-2


@pytest.mark.parametrize("qk", [96, 128])
def test_record_network_matches_the_reference_backend(backend, qk):
    """The record network (paired-head layers, windows, Q/K 96 or 128 with V 128) with a fused
    backend: loss and every parameter gradient as with the reference backend (bf16 model)."""
    from types import SimpleNamespace

    from speedrun.config import ModelConfig
    from speedrun.model.interface import ForwardArgs
    from speedrun.model.record import RecordGPT

    base = dict(vocab_size=257, num_layers=6, model_dim=256, num_heads=2, qk_head_dim=qk, v_head_dim=128,
                architecture="record")
    args = ForwardArgs(window_short=128, window_long=384, mtp_weights=(1.0, 0.5), prefix_weight=0.0)
    g = torch.Generator().manual_seed(3)
    T = 1024
    batch = SimpleNamespace(inputs=torch.randint(0, 257, (T,), generator=g, dtype=torch.int32).cuda(),
                            targets=torch.randint(0, 257, (T,), generator=g).cuda(),
                            cu_seqlens=torch.tensor([0, 300, 301, 900, T, T, T], dtype=torch.int32).cuda(),
                            max_seqlen=700, bigram=None)
    out = {}
    for name in ("reference", backend):
        torch.manual_seed(0)
        m = RecordGPT(ModelConfig(**base, attention_backend=name)).cuda().bfloat16()
        loss = m.loss(batch, args)
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
        out[name] = (loss.item(), grads)
    (l_ref, g_ref), (l_cu, g_cu) = out["reference"], out[backend]
    assert abs(l_cu - l_ref) <= 1e-2 * abs(l_ref), (l_cu, l_ref)
    assert _rel(g_cu, g_ref) < 5e-2

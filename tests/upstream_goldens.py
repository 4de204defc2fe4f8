"""Golden values from upstream f411b3d's own code: the fixture files, their recipes and their reader.

``tools/record_upstream_goldens.py UPSTREAM_DIR`` runs upstream's code (through
``tests/upstream_model.py``) and writes the files of :data:`FIXTURE_DIR`;
``tests/test_upstream_goldens.py`` compares our code against them on every run, without upstream's
source.  Everything both sides need to rebuild the same inputs lives here: the shapes
(:data:`SHAPES`), the weight recipe (:func:`recipe_tensor`), the synthetic shards
(:func:`synthetic_shards`), the gradient sketch (:func:`sketch`) and the mapping between upstream's
parameter names and layout and ours (:func:`ours_from_upstream`).

Shapes: the network (losses, gradients) is upstream's at the record's topology and widths (11
layers, 6 heads of 128, width 768: upstream's DC kernel takes no other) with a padded vocabulary of
256 (bigram table 1,920 x 768, sign table 512 x 768), on 512 tokens in four documents (longer and
shorter than the short window).  Initialisation and the optimizer run at width 96 (heads of 16,
:data:`NARROW`), where every parameter group keeps its role and the stored samples stay small.

Gradients of the large tensors are stored as count sketches (:func:`sketch`): a fixed random
signed bucketing of the flattened tensor into :data:`SKETCH_BUCKETS` sums.  It is linear and keeps
the squared norm of any difference in expectation, so ``|S(a) - S(b)| / |S(b)|`` estimates the
relative error ``|a - b| / |b|`` the live tests bound; a wrong element lands whole in one bucket.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "upstream_f411b3d"
REGENERATE = "python tools/record_upstream_goldens.py UPSTREAM_DIR (UPSTREAM_DIR: upstream f411b3d's train_gpt.py, triton_kernels.py, dc_triton_kernels.py)"
FORMAT = 1
UPSTREAM_COMMIT = "f411b3d346aa52d3504324ca93c230fd84c6c07f"
# PR #344's model (the candidate's counterpart): its own fixture folder, same reader
PR344_DIR = Path(__file__).resolve().parent / "fixtures" / "upstream_pr344"
PR344_REGENERATE = "python tools/record_upstream_goldens.py UPSTREAM_DIR --pr344 (UPSTREAM_DIR: PR #344's (c4c209d) three files)"
PR344_COMMIT = "c4c209d1a4715f1835710936e846344dc6287651"

# the network (eval losses, gradients): the record's widths (upstream's DC kernel takes only 6 heads
# of 128), a small vocabulary
SHAPES = SimpleNamespace(
    num_layers=11, num_heads=6, head_dim=128, model_dim=768, vocab=256, bigram_vocab=256 * 15 // 2,
    sign_rows=512, docs=(150, 97, 137, 128), max_seq_len=1024,
)
# initialisation and optimizer steps: the record's topology at width 96 (heads of 16)
NARROW = SimpleNamespace(**{**vars(SHAPES), "head_dim": 16, "model_dim": 96})
# eval losses and gradients at these (short, long) windows; the second case first grows YaRN twice
FORWARD_CASES = ({"seed": 0, "windows": (64, 192), "yarn": ()},
                 {"seed": 1, "windows": (128, 384), "yarn": ((128, 256), (256, 384))})
GRAD_SEED = 3
HEAD_ROWS = 64  # rows of the gradient case whose head inputs and gradients the fixture keeps
# one MLP layer (upstream's own kernel, bf16 and the record's FP8 forward): rows, width, hidden width
MLP_SHAPE = SimpleNamespace(rows=64, model_dim=768, hidden=3072)
SMALL = 16384  # tensors up to this many elements are stored whole, larger ones by recipe / sketch
SKETCH_BUCKETS = 2048
# our parameter name -> upstream's, where they differ
UPSTREAM_NAMES = {"lm_head": "lm_head.weight", "embed": "embed.weight", "smear_gate": "smear_gate.weight",
                  "bigram_embed": "bigram_embed.weight", "mudd_gate_scale": "_mudd_gate_scale"}
SCHEDULES = ((1270, 15), (45, 2), (301, 0))
OPTIMIZER_STEPS = tuple(range(844, 852))  # around the record's untie
ADAM_SAMPLES = 1024


class GoldenFixtureError(RuntimeError):
    """A fixture file is missing, unreadable or from another recipe."""


def fixture_path(name: str, folder: Path | None = None) -> Path:
    return (folder or FIXTURE_DIR) / f"{name}.pt"


def _regenerate(folder: Path | None) -> str:
    return PR344_REGENERATE if folder == PR344_DIR else REGENERATE


def save_fixture(name: str, payload: dict, folder: Path | None = None, *, commit: str = UPSTREAM_COMMIT) -> Path:
    """Write ``payload`` (tensors, numbers, strings, lists, dicts) with a format tag and the upstream
    commit it was recorded from."""
    path = fixture_path(name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "upstream_commit": commit, "name": name, "payload": payload}
    torch.save(body, path)
    return path


def load_fixture(name: str, folder: Path | None = None) -> dict:
    """The payload of fixture ``name``; :class:`GoldenFixtureError` naming the file and the script
    that regenerates it when the file is missing, unreadable, or of another format or name."""
    path = fixture_path(name, folder)

    def fail(problem: str) -> GoldenFixtureError:
        return GoldenFixtureError(f"golden fixture {path}: {problem}; regenerate it with {_regenerate(folder)}")

    if not path.is_file():
        raise fail("missing")
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a pickle that weights_only refuses, ...
        raise fail(f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("name") != name \
            or not isinstance(body.get("payload"), dict):
        raise fail(f"not a format-{FORMAT} fixture named {name!r}")
    return body["payload"]


def require(payload: dict, key: str, name: str, folder: Path | None = None):
    """``payload[key]``, or :class:`GoldenFixtureError` naming the fixture."""
    if key not in payload:
        raise GoldenFixtureError(f"golden fixture {fixture_path(name, folder)} lacks {key!r}; "
                                 f"regenerate it with {_regenerate(folder)}")
    return payload[key]


# ----------------------------------------------------------------------------------------------
# Recipes: deterministic tensors from a seed and a name (no upstream code needed)


def _seed_of(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def recipe_tensor(name: str, shape, seed: int, scale: float) -> torch.Tensor:
    """``randn(shape) * scale`` in fp32 from a generator seeded by (seed, name)."""
    g = torch.Generator().manual_seed(_seed_of(seed, name))
    return torch.randn(tuple(shape), generator=g) * scale


def perturb_scale(name: str, shape, model_dim: int) -> float:
    """Matrices by their fan-in (activations stay O(1)), vectors and gates by a fixed amount; the
    lm_head (D, V) by 3/sqrt(D) so that the logits spread."""
    if name == "lm_head.weight":
        return 3 * model_dim**-0.5
    return 0.02 if len(shape) < 2 else 0.5 * shape[-1] ** -0.5


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape included): detects a recipe that drew other values."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sketch(t: torch.Tensor, name: str, buckets: int = SKETCH_BUCKETS) -> torch.Tensor:
    """(buckets,) fp64 count sketch of ``t`` (flattened): element i adds ``sign_i * t_i`` to bucket
    ``h_i``, with ``h`` and ``sign`` drawn from a generator seeded by ``name``."""
    flat = t.detach().reshape(-1).double()
    g = torch.Generator().manual_seed(_seed_of(7, name))
    h = torch.randint(0, buckets, (flat.numel(),), generator=g)
    sign = torch.randint(0, 2, (flat.numel(),), generator=g).double() * 2 - 1
    return torch.zeros(buckets, dtype=torch.float64).index_add_(0, h, sign * flat)


def compact(t: torch.Tensor, name: str) -> dict:
    """A tensor whole when small, else its sketch and norm."""
    if t.numel() <= SMALL:
        return {"full": t.detach().clone()}
    return {"sketch": sketch(t, name).float(), "norm": t.detach().double().norm().item(), "shape": list(t.shape)}


def relative_error(mine: torch.Tensor, want: dict, name: str) -> float:
    """``|mine - want| / |want|`` from a :func:`compact` record (estimated through the sketch)."""
    if "full" in want:
        ref = want["full"].double()
        return ((mine.detach().double() - ref).norm() / ref.norm()).item()
    if mine.numel() != torch.Size(want["shape"]).numel():
        raise AssertionError(f"{name}: {tuple(mine.shape)} against the recorded {want['shape']}")
    s, ref = sketch(mine, name), want["sketch"].double()
    return ((s - ref).norm() / ref.norm()).item()


def synthetic_shards(folder: Path, n_shards=2, docs=400, seed=0) -> list[Path]:
    """Shards of documents that start with BOS (50256), lengths 1..1500 (some above the caps)."""
    from speedrun.data.shards import write_shard

    g = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(n_shards):
        lens = torch.randint(1, 400, (docs,), generator=g)
        lens[torch.randperm(docs, generator=g)[: docs // 10]] += 1100
        toks = torch.randint(0, 50000, (int(lens.sum()),), generator=g)
        toks[torch.cumsum(lens, 0) - lens] = 50256
        paths.append(write_shard(Path(folder) / f"syn_train_{i:06d}.bin", toks.tolist()))
    return paths


def pack_signs(t: torch.Tensor) -> dict:
    """A +-1 table as bits (8 per byte)."""
    bits = (t.reshape(-1) > 0).to(torch.uint8)
    pad = (-bits.numel()) % 8
    bits = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return {"bits": (bits * weights).sum(1).to(torch.uint8), "shape": list(t.shape)}


def unpack_signs(packed: dict) -> torch.Tensor:
    """fp32 +-1 table from :func:`pack_signs`."""
    b = packed["bits"].long()[:, None] >> torch.arange(8)
    bits = (b & 1).reshape(-1)
    n = 1
    for d in packed["shape"]:
        n *= d
    return (bits[:n].float() * 2 - 1).view(packed["shape"])


def head_rows(n: int) -> torch.Tensor:
    """The sorted rows (of ``n``) whose loss-head inputs the ``network`` fixture keeps."""
    g = torch.Generator().manual_seed(_seed_of(13, "head"))
    return torch.randperm(n, generator=g)[:HEAD_ROWS].sort().values


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def network_params(payload: dict, folder: Path | None = None) -> dict[str, torch.Tensor]:
    """Upstream's parameters (upstream names, fp32) of the ``network`` fixture (of ``folder``):
    small ones stored, large ones redrawn from their recipe and checked against the recording's
    digest."""
    params = {}
    for name, w in payload["weights"].items():
        if "full" in w:
            params[name] = w["full"].float()
            continue
        seed, scale = w["recipe"]
        t = recipe_tensor(name, w["shape"], seed, scale)
        if digest(t) != w["digest"]:
            raise GoldenFixtureError(
                f"{fixture_path('network', folder)}: the recipe for {name} draws other values than at recording "
                f"(torch's generator changed?); regenerate it with {_regenerate(folder)}")
        params[name] = t
    return params


# ----------------------------------------------------------------------------------------------
# The network: upstream's parameters (by upstream name) -> our RecordGPT


def our_config(s=SHAPES):
    from speedrun.config import ModelConfig

    return ModelConfig(vocab_size=s.vocab, num_layers=s.num_layers, model_dim=s.model_dim, num_heads=s.num_heads,
                       qk_head_dim=s.head_dim, v_head_dim=s.head_dim, architecture="record")


def our_arch(s=SHAPES):
    from speedrun.model.record import RecordArchConfig

    return RecordArchConfig(pad_world_size=1, bigram_sign_rows=s.sign_rows)


@torch.no_grad()
def ours_from_upstream(params: dict[str, torch.Tensor], sign_table: torch.Tensor, s=SHAPES, model_cfg=None,
                       arch=None):
    """Our ``RecordGPT`` (fp32, eval mode) holding upstream's parameters ``params`` (upstream names
    and layout: the MLP bank padded to 12 layers, RoPE rotating the other way)."""
    from speedrun.model.record import RecordGPT

    ours = RecordGPT(model_cfg or our_config(s), arch or our_arch(s))
    left = dict(params)
    for name, p in ours.named_parameters():
        src = left.pop(UPSTREAM_NAMES.get(name, name))
        if name == "mlp_bank":  # upstream pads to 12 layers for 8 ranks; the padding layer is never read
            src = src[: p.shape[0]]
        if src.shape != p.shape:
            raise GoldenFixtureError(f"{name}: upstream shape {tuple(src.shape)} vs ours {tuple(p.shape)}")
        p.copy_(src)
    if left:
        raise GoldenFixtureError(f"upstream parameters without a counterpart: {sorted(left)}")
    flip_rotating_rows(ours.qk_bank, ours)
    ours.bigram_sign_table.copy_(sign_table)
    return ours.float().eval()


def candidate_config(s=SHAPES):
    """:func:`our_config` with the candidate preset's model semantics (its Q/K width and softmax
    scale rule): PR #344's model at :data:`SHAPES`."""
    from speedrun.config import preset

    cand = preset("candidate").model
    cfg = our_config(s)
    cfg.qk_head_dim, cfg.attn_scale = cand.qk_head_dim, cand.attn_scale
    return cfg


PR344_ATTN_LAYERS = SHAPES.num_layers - 1  # layer 6 has no attention, in the record as in PR #344


def pr344_to_f411b3d_layout(params: dict[str, torch.Tensor], num_attn_layers: int = PR344_ATTN_LAYERS
                            ) -> dict[str, torch.Tensor]:
    """PR #344's parameters (or gradients) in f411b3d's layout, which ours follows: PR #344 stores
    each attention layer's O transposed in the V/O bank (``y @ o_w``; f411b3d: ``F.linear(y, O)``)."""
    o = slice(1, 2 * num_attn_layers, 2)
    vo = params["vo_bank"].clone()
    vo[o] = params["vo_bank"][o].transpose(-1, -2)  # read from the original: a view of vo would alias
    return {**params, "vo_bank": vo}


def grad_case_backward(ours, payload: dict) -> None:
    """Backpropagate the mean evaluation loss of the ``network`` fixture's gradient case through
    ``ours`` (our model built from the fixture's weights)."""
    from speedrun.model.interface import ForwardArgs

    ws, wl = payload["grad_windows"]
    batch = batch_of(SHAPES.docs, SHAPES.vocab, payload["grad_seed"], payload["bigram_mod"])
    ours.per_token_loss(batch, ForwardArgs(window_short=ws, window_long=wl)).mean().backward()


def gradient_errors(ours, grads: dict) -> dict[str, float | None]:
    """Each of our parameters' relative gradient error against the fixture's ``grads`` (through
    the sketch for large ones; None where ours has no gradient)."""
    return {name: None if p.grad is None else relative_error(p.grad, grads[name], name)
            for name, p in ours.named_parameters()}


def flip_rotating_rows(qk_bank: torch.Tensor, ours) -> None:
    """In place: negate the Q/K bank rows of the second dim of every rotating pair (see above)."""
    hd = ours.qk_dim
    odd = torch.zeros(hd, dtype=torch.bool)
    odd[1: ours.yarn.rope_dims: 2] = True
    qk_bank.view(-1, hd, qk_bank.shape[-1])[:, odd] *= -1


def batch_of(doc_lens, vocab: int, seed: int, bigram_mod: int):
    """Our batch (inputs int32, targets int64, cu_seqlens int32, bigram ids) of random tokens."""
    from speedrun.data.loader import bigram_hash

    g = torch.Generator().manual_seed(seed)
    T = sum(doc_lens)
    tokens = torch.randint(0, vocab, (T + 1,), generator=g)
    cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()], dtype=torch.int32)
    inputs, targets = tokens[:-1].to(torch.int32), tokens[1:].long()
    return SimpleNamespace(inputs=inputs, targets=targets, cu_seqlens=cu, max_seqlen=max(doc_lens),
                           num_docs=len(doc_lens), bigram=bigram_hash(inputs, bigram_mod))


def upstream_batch(batch, get_bigram_hash):
    """Upstream's forward arguments for :func:`batch_of`'s batch."""
    return batch.inputs.long(), batch.targets, batch.cu_seqlens, get_bigram_hash(batch.inputs)


# ----------------------------------------------------------------------------------------------
# The optimizer: record-shaped parameter groups of width 96 with recipe weights and gradients

BANKS = ("qk_bank", "vo_bank", "mlp_bank")


def optimizer_model():
    """Our ``RecordGPT`` at :data:`SHAPES` in the record's dtypes (bf16, four scalar tables fp32)
    holding recipe weights (embed tied to lm_head, as at the start of a run)."""
    from speedrun.model.record import RecordGPT

    model = RecordGPT(our_config(NARROW), our_arch(NARROW))
    model.cast_to_record_dtypes(torch.bfloat16)
    with torch.no_grad():
        for label, p in model.parameter_groups().items():
            scale = 0.02 if p.dim() < 2 else 0.5 * p.shape[-1] ** -0.5
            p.copy_(recipe_tensor(f"start/{label}", p.shape, 0, scale).to(p.dtype))
    model.sync_embed_from_lm_head()
    return model


def optimizer_grad(step: int, label: str, like: torch.Tensor) -> torch.Tensor:
    """The gradient fed at ``step`` to ``label`` (accumulated over steps while Adam waits)."""
    return (recipe_tensor(f"grad/{step}/{label}", like.shape, 0, 0.01)).to(like.dtype)


def optimizer_inputs():
    """(starting tensors by label, ``grads_of(step, label)``) for the recorder."""
    start = {label: p.detach().clone() for label, p in optimizer_model().parameter_groups().items()}
    return start, lambda step, label: optimizer_grad(step, label, start[label])


def master_weights(p: torch.Tensor, mantissa: torch.Tensor | None) -> torch.Tensor:
    """fp32 master of a bf16 weight and its 16-bit mantissa buffer (either signedness)."""
    from speedrun.optim.normuon import join_bf16

    if mantissa is None:
        return p.detach().float()
    return join_bf16(p.detach().reshape(mantissa.shape), mantissa.view(torch.int16))


def adam_sample(label: str, numel: int) -> torch.Tensor:
    """The flat indices of an Adam-updated tensor whose values the fixture keeps (all when small)."""
    if numel <= ADAM_SAMPLES:
        return torch.arange(numel)
    g = torch.Generator().manual_seed(_seed_of(11, label))
    return torch.randperm(numel, generator=g)[:ADAM_SAMPLES].sort().values


# ----------------------------------------------------------------------------------------------
# The loader: batches of the synthetic shards

LOADER_SHAPES = ((2048, 512),) * 4 + ((4096, 1024),) * 4  # (tokens, max_seq_len): a stage change
VAL_BATCHES = 3


def _to16(t: torch.Tensor) -> torch.Tensor:
    """Token ids (0 <= id < 2**16) as int16, offset by 2**15 (compact; weights_only-loadable)."""
    t = t.long()
    assert int(t.min()) >= 0 and int(t.max()) < 2**16
    return (t - 2**15).to(torch.int16)


def from16(t: torch.Tensor) -> torch.Tensor:
    return t.long() + 2**15


def pack_batch(inputs, targets, cu_seqlens, bigram) -> dict:
    """One batch, compactly: token and bigram ids as offset int16, the distinct document edges."""
    return {"inputs": _to16(inputs), "targets": _to16(targets), "bigram": _to16(bigram),
            "edges": torch.tensor(torch.unique_consecutive(cu_seqlens.long()).tolist(), dtype=torch.int32)}


# ----------------------------------------------------------------------------------------------
# One MLP layer: the inputs both sides draw, and our MLP on them


def mlp_inputs(m=MLP_SHAPE) -> dict[str, torch.Tensor]:
    """bf16 ``x`` (rows, D) with unit RMS rows (the normed input an MLP gets), ``w1`` (H, D) and
    ``w2`` (H, D) at the scale of upstream's init (c_fc's std 0.5 / sqrt(D), c_proj by its fan-in),
    ``g`` (rows, D) a unit-scale output gradient; drawn from recipes, so the fixture holds only
    upstream's outputs."""
    x = recipe_tensor("mlp.x", (m.rows, m.model_dim), 0, 1.0)
    x = x / x.square().mean(-1, keepdim=True).sqrt()
    return {"x": x.bfloat16(),
            "w1": recipe_tensor("mlp.w1", (m.hidden, m.model_dim), 0, 0.5 * m.model_dim**-0.5).bfloat16(),
            "w2": recipe_tensor("mlp.w2", (m.hidden, m.model_dim), 0, 0.5 * m.hidden**-0.5).bfloat16(),
            "g": recipe_tensor("mlp.g", (m.rows, m.model_dim), 0, 1.0).bfloat16()}


def our_mlp(inputs: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Our :func:`~speedrun.kernels.mlp.relu2_mlp` in ``mode`` (``bf16``; ``fp8_fwd``, the
    record's; ``fp8_full``, the candidate's) on :func:`mlp_inputs`, weights quantised as the
    presets' hook does without a cache (both layouts of each from one quantisation), a fresh
    scale state (which calibrates on the call): fp32 ``y``, ``dx``, ``dw1`` (H, D), ``dw2`` in
    upstream's (H, D) layout."""
    from speedrun.kernels.fp8_cache import FP8Weight, quantize_current
    from speedrun.kernels.mlp import relu2_mlp

    x = inputs["x"].clone().requires_grad_()
    w1 = inputs["w1"].clone().requires_grad_()
    w2 = inputs["w2"].clone().requires_grad_()  # (H, D); the MLP takes its (D, H) view
    cache = None
    if mode != "bf16":
        cache = (FP8Weight(*quantize_current(w1.detach())), FP8Weight(*quantize_current(w2.detach())).t())
    y = relu2_mlp(x, w1, w2.t(), mode=mode, cache=cache)
    y.backward(inputs["g"])
    return {"y": y.detach().float(), "dx": x.grad.float(), "dw1": w1.grad.float(), "dw2": w2.grad.float()}

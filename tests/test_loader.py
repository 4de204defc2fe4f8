"""Loader: BOS alignment, cut rules, fixed-size cu_seqlens, world-size equivalence, resume, val."""

from __future__ import annotations

import dataclasses

import math
import threading
import warnings

import numpy as np
import pytest
import torch

from speedrun.data.loader import (
    TrainLoader,
    ValLoader,
    _fit_segments,
    batch_in,
    batch_to,
    bigram_hash,
    default_max_docs,
    default_val_max_docs,
    min_max_docs,
)
from speedrun.data.shards import read_shard, write_shard
from speedrun.errors import DataError

BOS = 256


def _docs(rng, n, lo=1, hi=400):
    """n documents as arrays starting with BOS; content ids in [0, 256)."""
    return [np.concatenate(([BOS], rng.integers(0, BOS, int(rng.integers(lo, hi))))) for _ in range(n)]


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(1)
    docs_a, docs_b = _docs(rng, 150), _docs(rng, 40)
    a = write_shard(tmp_path / "a.bin", np.concatenate(docs_a))
    b = write_shard(tmp_path / "b.bin", np.concatenate(docs_b))
    return [a, b], docs_a + docs_b


def _check_batch(b, T, L, max_docs, bos=BOS):
    assert b.inputs.dtype == torch.int32 and b.inputs.shape == (T,)
    assert b.targets.dtype == torch.int64 and b.targets.shape == (T,)
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.shape == (max_docs + 1,)
    cu = b.cu_seqlens.long()
    assert cu[0] == 0 and (cu[b.num_docs:] == T).all() and (torch.diff(cu) >= 0).all()
    assert (torch.diff(cu[: b.num_docs + 1]) > 0).all()
    assert (torch.diff(cu) <= b.max_seqlen).all()
    assert b.inputs[0] == bos


def _expected_chunks(docs, T, L, n):
    """Reference: the chunk rule written the slow, obvious way (single rank, cycling docs)."""
    out, i = [], 0
    for _ in range(n):
        chunk, starts = [], []
        while len(chunk) < T + 1:
            d = docs[i % len(docs)][:L]
            i += 1
            starts.append(len(chunk))
            chunk.extend(d[: T + 1 - len(chunk)].tolist())
        out.append((chunk, [s for s in starts if s < T]))
    return out


@pytest.mark.parametrize("prefetch", [False, True])
def test_chunks_follow_the_rule(shards, prefetch):
    files, docs = shards
    T, L = 500, 120
    with TrainLoader(files, T, L, bos_id=BOS, vocab_size=257, prefetch=prefetch) as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [loader.next_batch() for _ in range(120)]  # > two passes: cycles twice
        assert loader.epochs_completed >= 2
        assert len([w for w in caught if "exhausted" in str(w.message)]) == 1  # said once
    for b, (chunk, starts) in zip(got, _expected_chunks(docs, T, L, 120)):
        _check_batch(b, T, L, default_max_docs(T, L))
        assert b.inputs.tolist() == chunk[:-1]
        assert b.targets.tolist() == chunk[1:]
        assert b.cu_seqlens[: b.num_docs].tolist() == starts
        assert b.max_seqlen == L


def test_doc_cut_at_max_seq_len(tmp_path):
    long_doc = np.concatenate(([BOS], np.arange(1000) % 256))
    short = np.array([BOS, 7, 8, 9])
    f = write_shard(tmp_path / "s.bin", np.concatenate([long_doc, short, long_doc]))
    loader = TrainLoader([f], 20, 8, bos_id=BOS, prefetch=False)
    with pytest.warns(RuntimeWarning, match="exhausted"):  # the chunk wraps around to the first document
        b = loader.next_batch()
    # doc 1: 8 tokens (tail of 993 skipped), doc 2: 4 tokens, doc 3: 8 tokens, doc 1 again: 1 token
    assert b.cu_seqlens[: b.num_docs + 1].tolist() == [0, 8, 12, 20]
    assert b.inputs[:12].tolist() == [BOS, 0, 1, 2, 3, 4, 5, 6, BOS, 7, 8, 9]
    assert b.targets[-1].item() == BOS  # the 21st token: start of the next (cycled) document
    b2 = loader.next_batch()
    assert b2.inputs[0] == BOS  # starts at the next document, the cut remainder is skipped
    loader.close()


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_world_size_equivalence(shards, world_size):
    files, _ = shards
    T, L = 256, 100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        single = TrainLoader(files, T, L, bos_id=BOS, prefetch=False)
        ref = [single.next_batch() for _ in range(6 * world_size)]
        for r in range(world_size):
            loader = TrainLoader(files, T, L, rank=r, world_size=world_size, bos_id=BOS, prefetch=(r % 2 == 0))
            for k in range(6):
                b, want = loader.next_batch(), ref[k * world_size + r]
                assert torch.equal(b.inputs, want.inputs) and torch.equal(b.targets, want.targets)
                assert torch.equal(b.cu_seqlens, want.cu_seqlens)
            loader.close()


@pytest.mark.parametrize("world_size,merge", [(1, 2), (1, 4), (2, 2), (3, 3)])
def test_merged_batches_are_consecutive_chunks_end_to_end(shards, world_size, merge):
    """A merged batch is this rank's next ``merge`` unmerged batches laid end to end: the same
    tokens, segment starts shifted by each chunk's offset, bigram ids per chunk, padding to
    ``merge * max_docs + 1``; ranks interleave per micro-step as without merging."""
    files, _ = shards
    T, L, max_docs = 200, 64, 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for r in range(world_size):
            plain = TrainLoader(files, T, L, rank=r, world_size=world_size, bos_id=BOS, max_docs=max_docs,
                                prefetch=False, bigram_mod=97)
            merged = TrainLoader(files, T, L, rank=r, world_size=world_size, bos_id=BOS, max_docs=max_docs,
                                 prefetch=(r % 2 == 0), bigram_mod=97, merge=merge)
            for _ in range(5):
                parts = [plain.next_batch() for _ in range(merge)]
                b = merged.next_batch()
                _check_batch(b, merge * T, L, merge * max_docs)
                assert torch.equal(b.inputs, torch.cat([p.inputs for p in parts]))
                assert torch.equal(b.targets, torch.cat([p.targets for p in parts]))
                assert torch.equal(b.bigram, torch.cat([p.bigram for p in parts]))
                starts = torch.cat([p.cu_seqlens[: p.num_docs] + j * T for j, p in enumerate(parts)])
                assert b.num_docs == sum(p.num_docs for p in parts)
                assert torch.equal(b.cu_seqlens[: b.num_docs], starts)
                assert b.max_seqlen == L
            assert merged.state_dict()["merge"] == merge
            assert (merged.merged_batches > 0) == (plain.merged_batches > 0)
            plain.close(), merged.close()


def test_merged_loader_resumes_and_changes_shape(shards):
    files, _ = shards
    a = TrainLoader(files, 128, 64, world_size=2, rank=0, bos_id=BOS, prefetch=True, merge=2)
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(4)]
    b = TrainLoader(files, 128, 64, world_size=2, rank=0, bos_id=BOS, prefetch=False)  # merge 1 until loaded
    b.load_state_dict(state)
    assert b.merge == 2
    for want in rest:
        got = b.next_batch()
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.cu_seqlens, want.cu_seqlens)
    b.set_shape(256, 64, merge=1)  # a stage transition back to unmerged batches
    assert b.next_batch().inputs.shape == (256,)
    legacy = dict(state)
    del legacy["merge"]  # a state saved before merging existed
    b.load_state_dict(legacy)
    assert b.merge == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="merge"):
            b.set_shape(128, 64, merge=bad)
    a.close(), b.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_state_dict_resume(shards, prefetch):
    files, _ = shards
    a = TrainLoader(files, 300, 64, world_size=2, rank=1, bos_id=BOS, prefetch=prefetch)
    for _ in range(7):
        a.next_batch()
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(10)]
    b = TrainLoader(files, 300, 64, world_size=2, rank=1, bos_id=BOS, prefetch=prefetch)
    b.next_batch()  # a different position, and a prefetched batch, to be discarded
    b.build_ahead()
    b.load_state_dict(state)
    assert b.state_dict() == state
    for want in rest:
        got = b.next_batch()
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.cu_seqlens, want.cu_seqlens)
    a.close(), b.close()


@pytest.mark.parametrize("ahead", [2, 5])
def test_batches_built_further_ahead_are_the_same_batches(shards, ahead):
    """With several batches pending on the builder thread the stream is the one built on demand,
    through shape changes (stage transitions), a resume from a saved state (both discard what is
    pending) and the wrap-around into a new epoch; a bad depth is refused."""
    files, _ = shards

    def take(loader, n):
        got = []
        for _ in range(n):
            b = loader.next_batch()
            got.append((b.inputs.clone(), b.cu_seqlens.clone(), b.num_docs))
            loader.build_ahead()  # as a training step does once its work is issued
        return got

    def run(loader):
        got = take(loader, 3)
        loader.set_shape(96, 32, merge=2)
        got += take(loader, 4)
        state = loader.state_dict()
        got += take(loader, 2)
        loader.load_state_dict(state)  # back two batches, pending ones dropped
        got += take(loader, 30)  # past the end of the data: a new epoch
        loader.set_shape(128, 64)
        return got + take(loader, 3)

    with TrainLoader(files, 128, 64, world_size=2, rank=1, bos_id=BOS, prefetch=False) as plain:
        want = run(plain)
        assert plain.epochs_completed >= 1
    with TrainLoader(files, 128, 64, world_size=2, rank=1, bos_id=BOS, prefetch=True,
                     prefetch_batches=ahead) as deep:
        on_demand = []  # batches the asking thread built itself: the first after each move only
        produce = deep._produce

        def counted(*a):
            on_demand.append(threading.current_thread() is threading.main_thread())
            return produce(*a)

        deep._produce = counted
        got = run(deep)
        assert 0 < len(deep._pending) <= ahead
    assert sum(on_demand) == 4, on_demand  # the first batch, two shape changes, the resume
    assert len(got) == len(want)
    for (gi, gc, gn), (wi, wc, wn) in zip(got, want):
        assert torch.equal(gi, wi) and torch.equal(gc, wc) and gn == wn
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch_batches"):
            TrainLoader(files, 128, 64, bos_id=BOS, prefetch=False, prefetch_batches=bad)


def test_state_dict_rejects_other_files(shards):
    files, _ = shards
    state = TrainLoader(files, 64, 32, bos_id=BOS, prefetch=False).state_dict()
    other = TrainLoader(files[:1], 64, 32, bos_id=BOS, prefetch=False)
    with pytest.raises(DataError, match="same files"):
        other.load_state_dict(state)


def test_set_shape(shards):
    files, docs = shards
    loader = TrainLoader(files, 128, 32, bos_id=BOS, prefetch=True)
    loader.next_batch()
    loader.set_shape(512, 64, max_docs=40)
    b = loader.next_batch()
    _check_batch(b, 512, 64, 40)
    assert b.max_seqlen == 64 and loader.state_dict()["tokens_per_rank"] == 512
    with pytest.raises(ValueError, match="too small"):
        loader.set_shape(512, 64, max_docs=3)
    loader.close()


def test_too_many_docs_are_merged_not_dropped(tmp_path):
    # 3-token documents: T = 64 holds ~22 of them, far more than max_docs = 8
    f = write_shard(tmp_path / "s.bin", np.tile([BOS, 1, 2], 100))
    loader = TrainLoader([f], 64, 16, bos_id=BOS, max_docs=8, prefetch=False)
    with pytest.warns(RuntimeWarning, match="merged"):
        b = loader.next_batch()
    assert b.num_docs == 8 and loader.merged_batches == 1
    cu = b.cu_seqlens.long()
    assert cu[-1] == 64 and (torch.diff(cu) <= 16).all()
    assert b.inputs.tolist() == np.tile([BOS, 1, 2], 22)[:64].tolist()  # every token still there


def test_fit_segments_bound():
    rng = np.random.default_rng(0)
    for _ in range(200):
        T, L = int(rng.integers(10, 500)), int(rng.integers(1, 60))
        cuts = np.unique(np.concatenate(([0], rng.integers(1, T, int(rng.integers(0, T))))))
        lens = np.diff(np.append(cuts, T))
        if lens.max() > L:  # train segments are capped at L by construction
            continue
        bounds = np.append(cuts, T)
        out = _fit_segments(bounds, min_max_docs(T, L), L)
        assert len(out) - 1 <= min_max_docs(T, L) and out[0] == 0 and out[-1] == T
        assert np.diff(out).max() <= L and set(out.tolist()) <= set(bounds.tolist())


def test_default_max_docs():
    assert default_max_docs(16384, 896) == 64
    assert default_max_docs(32768, 2048) == 96
    assert default_max_docs(49152, 2048) == 128
    assert default_max_docs(4096, 256) == 128
    assert default_max_docs(16, 8) == 16 and default_max_docs(200, 64) == 128
    assert default_max_docs(16384, 64) == 512  # a small cap needs more room than the table
    assert default_val_max_docs(262144) == 896
    for T in (100, 1000, 5000, 49152):
        for L in (1, 8, 256, 2048):
            assert default_max_docs(T, L) >= min_max_docs(T, L) == 2 * math.ceil(T / L)


def test_bad_shards(tmp_path):
    no_bos = write_shard(tmp_path / "nobos.bin", np.arange(100) % 200)
    with pytest.raises(DataError, match="nobos.bin.*no BOS"):
        TrainLoader([no_bos], 16, 8, bos_id=BOS)
    big = write_shard(tmp_path / "big.bin", [BOS, 1, 300, 2] * 10)
    with pytest.raises(DataError, match="big.bin.*300 >= vocab size 257"):
        TrainLoader([big], 16, 8, bos_id=BOS, vocab_size=257)
    with pytest.raises(DataError, match="no training files"):
        TrainLoader([], 16, 8, bos_id=BOS)
    with pytest.raises(DataError, match="does not exist"):
        TrainLoader([tmp_path / "missing.bin"], 16, 8, bos_id=BOS)
    ok = write_shard(tmp_path / "ok.bin", [BOS, 1, 2] * 10)
    bad2 = write_shard(tmp_path / "late.bin", [BOS, 1, 999] * 10)
    loader = TrainLoader([ok, bad2], 16, 8, bos_id=BOS, vocab_size=257, prefetch=True)
    with pytest.raises(DataError, match="late.bin"):  # the second shard fails when first needed
        for _ in range(10):
            loader.next_batch()
    loader.close()


def test_tokens_before_first_bos_are_skipped(tmp_path):
    f = write_shard(tmp_path / "s.bin", [5, 6, 7, BOS, 1, 2, 3, BOS, 4])
    with pytest.warns(RuntimeWarning, match="exhausted"):
        b = TrainLoader([f], 5, 8, bos_id=BOS, prefetch=False).next_batch()
    assert b.inputs.tolist() == [BOS, 1, 2, 3, BOS] and b.targets.tolist() == [1, 2, 3, BOS, 4]


def test_bigram_hash():
    x = torch.tensor([5, 50256, 17, 0, 65535])
    mod = 377279
    out = bigram_hash(x, mod)
    assert out.dtype == torch.int32 and out[0] == mod
    # position 1 pairs with mod, not x[0]: upstream overwrites out[0] before it reads it
    assert out[1] == (36313 * int(x[1]) ^ 27191 * mod) % mod != (36313 * int(x[1]) ^ 27191 * int(x[0])) % mod
    for t in range(2, 5):
        assert out[t] == (36313 * int(x[t]) ^ 27191 * int(x[t - 1])) % mod
    assert (out[1:] < mod).all() and (out >= 0).all()


def test_batches_carry_bigram(shards):
    files, _ = shards
    b = TrainLoader(files, 64, 32, bos_id=BOS, bigram_mod=1000, prefetch=False).next_batch()
    assert torch.equal(b.bigram, bigram_hash(b.inputs, 1000))
    assert b.bigram_rows is None  # masks only when asked (a run with the sparse exchange)
    plain = TrainLoader(files, 64, 32, bos_id=BOS, prefetch=False).next_batch()
    assert plain.bigram is None and plain.bigram_rows is None
    with pytest.raises(ValueError, match="needs bigram_mod"):
        TrainLoader(files, 64, 32, bos_id=BOS, prefetch=False, bigram_rows=True)


@pytest.mark.parametrize("bigram_mod", [None, 97])
@pytest.mark.parametrize("merge", [1, 3])
def test_a_batch_is_one_buffer_and_moves_with_one_copy(shards, merge, bigram_mod):
    """Every tensor of a batch (training and validation) is a view of its one int32 buffer
    (``packed``), each on a 16-byte boundary, none overlapping another; ``batch_in`` lays another
    buffer out the same way, so copying ``packed`` alone carries a whole batch (what a CUDA graph's
    static inputs take), and a buffer of another shape is refused."""
    files, _ = shards
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = TrainLoader(files, 60, 32, bos_id=BOS, bigram_mod=bigram_mod, merge=merge, prefetch=False)
        batches = [loader.next_batch() for _ in range(3)]
    batches.append(ValLoader(files, 254, 64, bos_id=BOS, bigram_mod=bigram_mod).batch(1))
    names = ("inputs", "targets", "cu_seqlens", "bigram")
    for b in batches:
        fields = [getattr(b, n) for n in names if getattr(b, n) is not None]
        assert len(fields) == (4 if bigram_mod else 3)
        base, end = b.packed.data_ptr(), b.packed.data_ptr() + b.packed.nbytes
        spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in fields)
        assert all(base <= lo and hi <= end and (lo - base) % 16 == 0 for lo, hi in spans)
        assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:]))
        assert all(t.untyped_storage().data_ptr() == b.packed.untyped_storage().data_ptr() for t in fields)
        static = batch_in(torch.full_like(b.packed, -7), b)
        assert static.packed is not b.packed and static.bigram_rows is None
        static.packed.copy_(b.packed)
        for n in names:
            want, got = getattr(b, n), getattr(static, n)
            assert (got is None) == (want is None)
            if want is not None:
                assert got.dtype == want.dtype and torch.equal(got, want)
                assert got.untyped_storage().data_ptr() == static.packed.untyped_storage().data_ptr()
        with pytest.raises(ValueError, match="packed shape"):
            batch_in(torch.zeros(b.packed.numel() + 4, dtype=torch.int32), b)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("merge", [1, 3])
def test_batches_carry_a_host_mask_of_their_bigram_rows(shards, merge, prefetch):
    """Asked for (``bigram_rows=True``), every training batch carries on the host a bool mask of
    the bigram-table rows (``mod + 1`` of them) its ids look up: exactly those, the ids the device
    got, built here or on the builder thread alike.  The meta device stands in for a GPU: the
    tensors move there, so the masks are compared with a CPU loader's ids."""
    files, _ = shards
    mod = 97
    kw = dict(bos_id=BOS, bigram_mod=mod, merge=merge)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with TrainLoader(files, 64, 32, prefetch=False, **kw) as on_cpu, \
                TrainLoader(files, 64, 32, device="meta", prefetch=prefetch, bigram_rows=True, **kw) as moved:
            pairs = []
            for _ in range(6):
                pairs.append((on_cpu.next_batch(), moved.next_batch()))
                moved.build_ahead()
    for want, got in pairs:
        assert got.bigram.device.type == "meta" and got.bigram.shape == want.bigram.shape
        rows = got.bigram_rows
        assert isinstance(rows, np.ndarray) and rows.dtype == np.bool_ and rows.shape == (mod + 1,)
        assert np.flatnonzero(rows).tolist() == sorted(set(want.bigram.tolist()))
    assert ValLoader(files, 256, 64, bos_id=BOS, bigram_mod=mod, device="meta").batch(1).bigram_rows is None


def test_batches_fetched_on_the_host_move_with_one_copy(shards):
    """``next_batch(on_host=True)`` leaves a loader's batch in host memory, the same values as the
    batch it would have moved; ``batch_to`` moves a packed batch by one copy of its buffer, the
    tensors laid out as before and the bigram row mask kept, returns a batch already there as it
    is, and moves a batch made field by field field by field.  The meta device stands in for a GPU."""
    files, _ = shards
    kw = dict(bos_id=BOS, bigram_mod=97, bigram_rows=True, prefetch=False)
    with TrainLoader(files, 64, 32, **kw) as on_cpu, TrainLoader(files, 64, 32, device="meta", **kw) as moved:
        for _ in range(3):
            want, got = on_cpu.next_batch(), moved.next_batch(on_host=True)
            assert got.packed.device.type == "cpu" and got.packed.shape == want.packed.shape
            for f in ("inputs", "targets", "cu_seqlens", "bigram"):
                assert torch.equal(getattr(got, f), getattr(want, f)), f
            assert np.array_equal(got.bigram_rows, want.bigram_rows)
            there = batch_to(got, "meta")
            assert there.packed.device.type == "meta" and there.packed.shape == got.packed.shape
            assert there.bigram_rows is got.bigram_rows and there.num_docs == got.num_docs
            for f in ("inputs", "targets", "cu_seqlens", "bigram"):
                h, d = getattr(got, f), getattr(there, f)
                assert d.device.type == "meta" and d.shape == h.shape and d.dtype == h.dtype
                assert h.data_ptr() - got.packed.data_ptr() == d.data_ptr() - there.packed.data_ptr()
            assert batch_to(there, "meta") is there and batch_to(got, "cpu") is got
        loose = dataclasses.replace(on_cpu.next_batch(), packed=None)
        far = batch_to(loose, "meta")
        assert far.packed is None and far.inputs.device.type == "meta" and far.bigram.shape == loose.bigram.shape


def test_val_loader(tmp_path):
    rng = np.random.default_rng(3)
    stream = np.concatenate(_docs(rng, 80))
    half = len(stream) // 2
    files = [write_shard(tmp_path / "v0.bin", stream[:half]), write_shard(tmp_path / "v1.bin", stream[half:])]
    T, W = 200, 3
    for r in range(W):
        val = ValLoader(files, 2000, T, rank=r, world_size=W, bos_id=BOS, vocab_size=257, bigram_mod=97)
        assert len(val) == 2000 // (T * W) == 3
        batches = list(val)
        assert len(batches) == 3
        for s, b in enumerate(batches):
            start = s * T * W + r * T
            assert b.inputs.tolist() == stream[start: start + T].tolist()  # contiguous, across files
            assert b.targets.tolist() == stream[start + 1: start + T + 1].tolist()
            bos = [i for i in range(1, T) if stream[start + i] == BOS]
            assert b.cu_seqlens[: b.num_docs + 1].tolist() == [0, *bos, T]
            assert b.cu_seqlens.shape == (default_val_max_docs(T) + 1,) and b.max_seqlen == T
            assert torch.equal(b.bigram, bigram_hash(b.inputs, 97))


def test_val_loader_errors(tmp_path):
    f = write_shard(tmp_path / "v.bin", [BOS, 1, 2, 3] * 25)
    with pytest.raises(DataError, match="need 101"):
        ValLoader([f], 100, 50, world_size=2, bos_id=BOS)
    with pytest.raises(DataError, match="less than one validation step"):
        ValLoader([f], 10, 50, bos_id=BOS)
    with pytest.raises(DataError, match="vocab size 3"):
        ValLoader([f], 50, 50, bos_id=BOS, vocab_size=3)
    assert len(ValLoader([f], 99, 33, bos_id=BOS)) == 3
    nobos = write_shard(tmp_path / "nobos.bin", [1, 2, 3] * 40)
    with pytest.raises(DataError, match="nobos.bin.*no BOS"):
        ValLoader([nobos], 60, 60, bos_id=BOS)


def test_on_webmix(webmix_dir):
    train = webmix_dir / "webmix_train_000000.bin"
    loader = TrainLoader([train], 16384, 896, world_size=8, rank=5, bos_id=50256, vocab_size=50257)
    warnings.simplefilter("ignore", RuntimeWarning)  # webmix documents are short: merging happens
    for _ in range(3):
        _check_batch(loader.next_batch(), 16384, 896, 64, bos=50256)
    loader.close()
    val = ValLoader([webmix_dir / "webmix_val_000000.bin"], 2 * 262144, 262144, bos_id=50256, vocab_size=50257)
    b = next(iter(val))
    assert b.cu_seqlens.shape == (897,) and b.num_docs > 10
    assert read_shard(train)[0] == 50256

"""Training and validation batches from token shards (record recipe §5).

Training (:class:`TrainLoader`) reads one document stream: the documents of the shards in the
given order (a document is a BOS token and everything up to the next BOS or the shard end;
documents never span shards), cycling back to the first shard when the last is used up.

Each micro-step, rank ``r`` of ``W`` gets one *chunk* of exactly ``T + 1`` tokens
(``T = tokens_per_rank``) made of whole consecutive documents:

* every chunk starts at a BOS;
* every document contributes at most ``max_seq_len`` tokens (its tail is skipped, not carried);
* the last document is cut so the chunk holds exactly ``T + 1`` tokens; the rest of that document
  is skipped and the next chunk starts at the next document;
* ``inputs = chunk[:-1]``, ``targets = chunk[1:]``;
* the chunks of one step are consecutive in the stream, rank order: rank ``r``'s ``k``-th batch
  under ``W`` ranks is the ``(k*W + r)``-th batch of a single rank, so 8 ranks x 1 micro-step and
  1 rank x 8 micro-steps see the same tokens.

``cu_seqlens`` holds the document starts in ``[0, T)`` and then ``T``, padded with ``T`` (empty
documents) to a fixed length ``max_docs + 1`` so compiled shapes stay static.

Merged micro-batches (``merge = m > 1``): one batch is this rank's next ``m`` chunks, built by the
rules above (so the tokens, the document cuts and the segments are those of ``m`` unmerged
batches), laid end to end: ``m * T`` inputs and targets, each chunk's segments shifted by its
offset (a chunk edge is always a segment edge), ``cu_seqlens`` padded to ``m * max_docs + 1``,
bigram ids computed per chunk.  Under ``W`` ranks the stream advances ``W * m`` chunks per batch,
rank ``r`` taking chunk ``r`` of each group of ``W``: the batches of ``m`` unmerged micro-steps.
A training step that accumulates fewer, merged micro-batches therefore sees the same tokens.

Too many documents: a chunk of many very short documents can have more than ``max_docs`` of
them.  Then neighbouring documents are merged into one attention segment (right to left, never
making a segment longer than ``max_seq_len``) until ``max_docs`` segments remain.  No token is
dropped and ``max_seqlen`` stays a true bound; attention inside a merged segment crosses the
merged documents' boundaries (as in training without document masking).  The loader warns once
and counts such batches in ``merged_batches``.  Greedy merging under the cap always reaches
``2 * ceil(T / max_seq_len)`` segments or fewer, so ``max_docs`` below that is refused, and
:func:`default_max_docs` (the record's table, else ``ceil(T/300/128)*128``) is never below it.

Validation (:class:`ValLoader`) reads contiguous, not BOS-aligned, slices of the validation
stream (the files concatenated): step ``s`` covers ``[s*T*W, (s+1)*T*W)`` and rank ``r`` takes
``[s*T*W + r*T, ... + T)`` plus one token for the last target.  Documents are whole (no length
cap), cut only at batch edges; ``cu_seqlens`` are the BOS positions and ``max_seqlen = T``.

All arrays are built on the CPU with numpy, into one buffer per batch (the tensors are views of it:
``Batch.packed``); with a CUDA ``device`` it is pinned and copied with ``non_blocking=True``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from speedrun.data.shards import check_vocab, load_shard, read_header, read_shard
from speedrun.errors import DataError

log = logging.getLogger(__name__)

# Record: TRAIN_MAX_NUM_DOCS keyed by tokens per rank (recipe §5).
_RECORD_MAX_DOCS = {16384: 64, 32768: 96, 49152: 128}
_STATE_FORMAT = "speedrun.TrainLoader/1"


@dataclass
class Batch:
    """One micro-batch for one rank.

    inputs: (T,) int32 token ids.  targets: (T,) int64, ``targets[i]`` is the token after
    ``inputs[i]``.  cu_seqlens: (max_docs + 1,) int32 segment starts in [0, T), then T, padded
    with T.  max_seqlen: upper bound on a segment length (tokens).  num_docs: real segments
    (unpadded ``len(cu_seqlens) - 1``).  bigram: (T,) int32 bigram-hash ids or None.
    bigram_rows: a (bigram_mod + 1,) bool numpy mask on the host of the bigram-table rows that
    ``bigram`` looks up, from a loader asked for it (``TrainLoader(bigram_rows=True)``, a run with
    the sparse bigram exchange), else None.  It is built with the batch, on the builder thread, so
    the step's thread marks the rows for the exchange with one OR of masks (instead of a scatter
    of every id) and never reads the device.
    packed: the one (W,) int32 buffer the four tensors above are views of (on their device), so a
    batch moves with one copy (None for a batch made otherwise); see :func:`batch_in`.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_docs: int
    bigram: torch.Tensor | None = None
    bigram_rows: np.ndarray | None = None
    packed: torch.Tensor | None = None


def min_max_docs(tokens_per_rank: int, max_seq_len: int) -> int:
    """Smallest ``max_docs`` the merge rule can always honour: ``2 * ceil(T / max_seq_len)``."""
    return 2 * math.ceil(tokens_per_rank / max_seq_len)


def default_max_docs(tokens_per_rank: int, max_seq_len: int) -> int:
    """Fixed ``cu_seqlens`` length - 1 for training batches.

    The record's table ``{16384: 64, 32768: 96, 49152: 128}`` where it applies, else
    ``max(ceil((T // 300) / 128) * 128, min(T, 128))`` (room for documents averaging 300 tokens),
    and never below :func:`min_max_docs`.  Batches with more documents merge neighbours (see the module doc).
    """
    if tokens_per_rank in _RECORD_MAX_DOCS:
        base = _RECORD_MAX_DOCS[tokens_per_rank]
    else:
        # min(T, 128): a batch of T tokens holds at most T documents, so small batches never merge
        base = max(math.ceil((tokens_per_rank // 300) / 128) * 128, min(tokens_per_rank, 128))
    return max(base, min_max_docs(tokens_per_rank, max_seq_len))


def default_val_max_docs(tokens_per_rank: int) -> int:
    """``ceil((T // 300) / 128) * 128``, at least 128 (the record's 896 for T = 262,144)."""
    return max(128, math.ceil((tokens_per_rank // 300) / 128) * 128)


def bigram_hash(inputs: torch.Tensor, mod: int) -> torch.Tensor:
    """Bigram-hash ids (recipe §1.4): ``out[0] = mod``, ``out[t] = (36313*x[t] ^ 27191*p[t]) % mod``
    with ``p[t] = x[t-1]``, except ``p[1] = mod``: upstream f411b3d hashes in place, writing
    ``out[0] = mod`` before it reads the previous tokens, so position 1 pairs with ``mod``, not with
    ``x[0]`` (checked against upstream's own function in ``tests/test_upstream_equivalence.py``).

    inputs: (T,) integer token ids.  Returns (T,) int32 in ``[0, mod]``, so the embedding table
    has ``mod + 1`` rows (the record: 377,280 rows, ``mod = 377279``).  Computed in int64.
    """
    if inputs.dim() != 1:
        raise ValueError(f"bigram_hash expects a 1-D tensor of token ids, got shape {tuple(inputs.shape)}")
    if mod <= 0:
        raise ValueError(f"bigram_hash modulus must be positive, got {mod}")
    x = inputs.to(torch.int64)
    out = torch.empty_like(x)
    if x.numel():
        prev = x[:-1].clone()
        prev[:1] = mod
        out[0] = mod
        out[1:] = torch.bitwise_xor(36313 * x[1:], 27191 * prev) % mod
    return out.to(torch.int32)


def _bigram_np(chunk: np.ndarray, mod: int) -> np.ndarray:
    x = chunk.astype(np.int64)
    out = np.empty(x.shape, dtype=np.int64)
    if x.size:
        prev = x[:-1].copy()
        prev[:1] = mod  # as bigram_hash
        out[0] = mod
        np.remainder(np.bitwise_xor(36313 * x[1:], 27191 * prev), mod, out=out[1:])
    return out.astype(np.int32)


def _fit_segments(bounds: np.ndarray, max_docs: int, cap: int) -> np.ndarray:
    """Merge neighbouring segments (right to left, merged length <= cap) until at most ``max_docs``.

    bounds: (n+1,) int64 segment edges from 0 to T.  Returns the kept edges.
    """
    n = len(bounds) - 1
    excess = n - max_docs
    if excess <= 0:
        return bounds
    keep = np.ones(len(bounds), dtype=bool)
    cur_end = int(bounds[n])
    for k in range(n - 1, 0, -1):
        if excess > 0 and cur_end - int(bounds[k - 1]) <= cap:
            keep[k] = False  # drop edge k: segment k-1 joins the current one
            excess -= 1
        else:
            cur_end = int(bounds[k])
    out = bounds[keep]
    if len(out) - 1 > max_docs:  # unreachable when max_docs >= min_max_docs (see module doc)
        raise DataError(f"cannot fit {n} documents into max_docs={max_docs} segments of at most {cap} tokens")
    return out


# A batch's tensors lie in one int32 buffer (targets as int64 words, then inputs, cu_seqlens and
# the bigram ids), each starting on a 16-byte boundary: one pinned allocation and one host-to-device
# copy per batch instead of one per tensor, and a graph's static inputs refilled by one copy too.
_ALIGN_WORDS = 4


def _packed_layout(n_tokens: int, n_cu: int, bigram: bool) -> tuple[dict[str, tuple[int, int]], int]:
    """({field: (first int32 word, words)}, total words) of a packed batch."""
    layout, at = {}, 0
    for name, words in (("targets", 2 * n_tokens), ("inputs", n_tokens), ("cu_seqlens", n_cu),
                        ("bigram", n_tokens if bigram else 0)):
        if words:
            layout[name] = (at, words)
            at += -(-words // _ALIGN_WORDS) * _ALIGN_WORDS
    return layout, at


def _views(buffer: torch.Tensor, layout: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor | None]:
    out = {name: None for name in ("inputs", "targets", "cu_seqlens", "bigram")}
    for name, (at, words) in layout.items():
        view = buffer[at:at + words]
        out[name] = view.view(torch.int64) if name == "targets" else view
    return out


def _host_arrays(chunks: list[np.ndarray], bounds: list[np.ndarray], max_docs: int, bigram_mod: int | None,
                 pin: bool) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
    """The packed CPU buffer (pinned if ``pin``) of a batch of ``m = len(chunks)`` chunks laid end
    to end, and its layout (:func:`_packed_layout`).  chunks: (T+1,) uint16 tokens each; bounds:
    each chunk's (n+1,) segment edges in [0, T] after fitting to ``max_docs``; ``cu_seqlens``
    gets ``m * max_docs + 1`` entries."""
    T = len(chunks[0]) - 1
    m = len(chunks)
    layout, words = _packed_layout(m * T, m * max_docs + 1, bigram_mod is not None)
    buffer = torch.empty(words, dtype=torch.int32, pin_memory=pin)
    host = {k: None if t is None else t.numpy() for k, t in _views(buffer, layout).items()}
    starts = np.concatenate([b[:-1] + j * T for j, b in enumerate(bounds)])
    host["cu_seqlens"][:] = m * T
    host["cu_seqlens"][: len(starts)] = starts
    for j, c in enumerate(chunks):
        host["inputs"][j * T:(j + 1) * T] = c[:-1]
        host["targets"][j * T:(j + 1) * T] = c[1:]
        if bigram_mod is not None:
            host["bigram"][j * T:(j + 1) * T] = _bigram_np(c[:-1], bigram_mod)
    return buffer, layout


def _row_mask(buffer: torch.Tensor, layout: dict[str, tuple[int, int]], bigram_mod: int) -> np.ndarray:
    """(bigram_mod + 1,) bool: the rows a packed host batch's bigram ids look up."""
    at, words = layout["bigram"]
    rows = np.zeros(bigram_mod + 1, dtype=np.bool_)
    rows[buffer[at:at + words].numpy()] = True
    return rows


def _host_batch(host: tuple[torch.Tensor, dict[str, tuple[int, int]]], num_docs: int, max_seqlen: int,
                bigram_rows: np.ndarray | None = None) -> Batch:
    """The batch whose tensors are views of the packed host buffer ``host`` (buffer, layout)."""
    buffer, layout = host
    out = _views(buffer, layout)
    return Batch(out["inputs"], out["targets"], out["cu_seqlens"], int(max_seqlen), int(num_docs), out["bigram"],
                 bigram_rows=bigram_rows, packed=buffer)


def _laid_out_as(buffer: torch.Tensor, like: Batch) -> dict[str, torch.Tensor | None]:
    """``like``'s four tensors as views of ``buffer`` (shaped as ``like.packed``) at the same places."""
    if like.packed is None or buffer.shape != like.packed.shape or buffer.dtype != like.packed.dtype:
        raise ValueError("batch_in / batch_to: need a packed batch and a buffer of its packed shape and dtype")
    base = like.packed.data_ptr()
    fields = {}
    for name in ("inputs", "targets", "cu_seqlens", "bigram"):
        t = getattr(like, name)
        if t is not None:
            at, words = (t.data_ptr() - base) // 4, t.numel() * t.element_size() // 4
            t = buffer[at:at + words].view(t.dtype)
        fields[name] = t
    return fields


def batch_in(buffer: torch.Tensor, like: Batch) -> Batch:
    """A batch shaped as ``like`` (a packed one) whose tensors are views of ``buffer`` (shaped as
    ``like.packed``) at the same places; no bigram row mask.  What a CUDA graph's
    static micro-batch is: one copy of another batch's ``packed`` refills all of it."""
    return dataclasses.replace(like, **_laid_out_as(buffer, like), bigram_rows=None, packed=buffer)


def batch_to(batch: Batch, device: str | torch.device) -> Batch:
    """``batch`` on ``device``: a packed batch by one copy of its buffer (asynchronous from pinned
    host memory to a GPU), the views laid out as before; the host's bigram row mask kept.  The
    batch itself when it is there already."""
    device = torch.device(device)
    if batch.inputs.device.type == device.type:
        return batch
    if batch.packed is None:
        move = {f: None if getattr(batch, f) is None else getattr(batch, f).to(device)
                for f in ("inputs", "targets", "cu_seqlens", "bigram")}
        return dataclasses.replace(batch, **move)
    packed = batch.packed.to(device, non_blocking=device.type == "cuda")  # pinned then
    return dataclasses.replace(batch, **_laid_out_as(packed, batch), packed=packed)


def _check_files(files, what: str) -> list[Path]:
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError(f"no {what} files given (an empty list or a glob that matched nothing)")
    for p in paths:
        read_header(p)  # exists, is a file, header and size consistent
    return paths


# ----------------------------------------------------------------------------------------------
# Training


class _Shard:
    """A shard in memory with its document index.  starts/lens: (D,) int64 BOS positions and
    uncapped document lengths."""

    def __init__(self, path: Path, bos_id: int, vocab_size: int | None):
        self.path = path
        self.tokens = load_shard(path, vocab_size)
        self.starts = np.flatnonzero(self.tokens == bos_id).astype(np.int64)
        if len(self.starts) == 0:
            raise DataError(
                f"{path}: no BOS token ({bos_id}) in {len(self.tokens):,} tokens; every document must start "
                f"with BOS (wrong tokenizer or bos_id?)"
            )
        if self.starts[0] != 0:
            log.warning("%s: %d tokens before the first BOS are skipped", path, int(self.starts[0]))
        self.lens = np.diff(np.append(self.starts, len(self.tokens)))
        self._cum: dict[int, np.ndarray] = {}

    @property
    def num_docs(self) -> int:
        return len(self.starts)

    def capped(self, max_seq_len: int) -> np.ndarray:
        return np.minimum(self.lens, max_seq_len)

    def cum(self, max_seq_len: int) -> np.ndarray:
        """(D+1,) int64 exclusive prefix sums of the capped document lengths."""
        c = self._cum.get(max_seq_len)
        if c is None:
            c = np.zeros(self.num_docs + 1, dtype=np.int64)
            np.cumsum(self.capped(max_seq_len), out=c[1:])
            self._cum = {max_seq_len: c}  # one cap at a time: stages change it rarely
        return c


class _ShardStore:
    """Loads shards on a background thread; keeps the most recent few in memory."""

    def __init__(self, files: list[Path], bos_id: int, vocab_size: int | None, background: bool):
        self.files, self.bos_id, self.vocab_size = files, bos_id, vocab_size
        self._lock = threading.Lock()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._order: list[int] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="speedrun-shard") if background else None

    def _load(self, i: int) -> _Shard:
        return _Shard(self.files[i], self.bos_id, self.vocab_size)

    def _future(self, i: int) -> concurrent.futures.Future:
        with self._lock:
            fut = self._futures.get(i)
            if fut is None:
                if self._pool is not None:
                    fut = self._pool.submit(self._load, i)
                else:
                    fut = concurrent.futures.Future()
                    try:
                        fut.set_result(self._load(i))
                    except BaseException as e:
                        fut.set_exception(e)
                self._futures[i] = fut
            if i in self._order:
                self._order.remove(i)
            self._order.append(i)
            while len(self._order) > 3:  # current, next, and one being planned across
                self._futures.pop(self._order.pop(0), None)
            return fut

    def get(self, i: int) -> _Shard:
        fut = self._future(i)
        try:
            return fut.result()
        except BaseException:
            with self._lock:
                self._futures.pop(i, None)  # let a later call retry (e.g. file fixed)
            raise

    def prefetch(self, i: int) -> None:
        if self._pool is not None:
            self._future(i)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._lock:
            self._futures.clear()


@dataclass(frozen=True)
class _Pos:
    epoch: int
    shard: int
    doc: int


class TrainLoader:
    """BOS-aligned training batches for one rank (see the module doc for the exact rules).

    files: shards in stream order.  tokens_per_rank: T, input tokens per chunk (an unmerged
    micro-batch).  max_seq_len: document cap in tokens.  bos_id: the BOS token.  vocab_size: if
    given, every shard is checked to have ids < vocab_size.  max_docs: fixed ``cu_seqlens``
    length - 1 per chunk (default :func:`default_max_docs`).  merge: chunks per batch (see the
    module doc); batches then hold ``merge * T`` tokens.  prefetch: load the next shard on a
    background thread, and build batches ahead on another when asked (:meth:`build_ahead`; iterating
    the loader asks after every batch).  prefetch_batches: how many batches :meth:`build_ahead` keeps
    pending (a training step's micro-batch count: a step then takes its batches ready-made).
    device: where batches are returned.  bigram_mod: if given, batches carry
    ``bigram_hash(inputs, bigram_mod)``.  bigram_rows: batches also carry the mask of the bigram
    rows they look up (:attr:`Batch.bigram_rows`; needs ``bigram_mod``).
    """

    def __init__(self, files: list[Path], tokens_per_rank: int, max_seq_len: int, *, rank: int = 0,
                 world_size: int = 1, bos_id: int, vocab_size: int | None = None, max_docs: int | None = None,
                 prefetch: bool = True, device: str | torch.device = "cpu", bigram_mod: int | None = None,
                 merge: int = 1, prefetch_batches: int = 1, bigram_rows: bool = False):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if bigram_mod is not None and bigram_mod <= 0:
            raise ValueError(f"bigram_mod must be positive, got {bigram_mod}")
        if bigram_rows and bigram_mod is None:
            raise ValueError("bigram_rows (masks of the bigram rows a batch looks up) needs bigram_mod")
        if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) or prefetch_batches < 1:
            raise ValueError(f"prefetch_batches must be a positive int, got {prefetch_batches!r}")
        self.files = _check_files(files, "training")
        self.rank, self.world_size = rank, world_size
        self.bos_id, self.vocab_size = int(bos_id), vocab_size
        self.device = torch.device(device)
        self.bigram_mod = bigram_mod
        self.bigram_rows = bool(bigram_rows)
        self.prefetch = prefetch
        self.prefetch_batches = prefetch_batches
        self.merged_batches = 0  # batches whose documents had to be merged to fit max_docs
        self.epochs_completed = 0
        self._warned_cycle = False
        self._warned_merge = False
        self._store = _ShardStore(self.files, self.bos_id, vocab_size, background=prefetch)
        self._store.get(0)  # fail now on a bad first shard, not at the first step
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="speedrun-batch") if prefetch else None
        # batches being built, in stream order: (shape, future of (start position, _produce's result))
        self._pending: collections.deque[tuple[tuple, concurrent.futures.Future]] = collections.deque()
        self._pos = _Pos(0, 0, 0)
        self.set_shape(tokens_per_rank, max_seq_len, max_docs, merge)

    # -- shape and state ------------------------------------------------------------------------

    def set_shape(self, tokens_per_rank: int, max_seq_len: int, max_docs: int | None = None, merge: int = 1) -> None:
        """Change T, the document cap, ``max_docs`` and ``merge`` from the next batch on (stage
        transitions)."""
        if tokens_per_rank < 1 or max_seq_len < 1:
            raise ValueError(f"tokens_per_rank ({tokens_per_rank}) and max_seq_len ({max_seq_len}) must be positive")
        if isinstance(merge, bool) or not isinstance(merge, int) or merge < 1:
            raise ValueError(f"merge (chunks per batch) must be a positive int, got {merge!r}")
        lo = min_max_docs(tokens_per_rank, max_seq_len)
        if max_docs is None:
            max_docs = default_max_docs(tokens_per_rank, max_seq_len)
        elif max_docs < lo:
            raise ValueError(
                f"max_docs={max_docs} is too small for tokens_per_rank={tokens_per_rank}, max_seq_len={max_seq_len}: "
                f"need at least 2*ceil(T/max_seq_len) = {lo} so over-full batches can always be merged"
            )
        self._discard_pending()
        self.tokens_per_rank, self.max_seq_len, self.max_docs = int(tokens_per_rank), int(max_seq_len), int(max_docs)
        self.merge = merge

    def state_dict(self) -> dict:
        """Position of the next batch :meth:`next_batch` returns (prefetched ones don't count)."""
        return {
            "format": _STATE_FORMAT,
            "epoch": self._pos.epoch,
            "shard": self._pos.shard,
            "doc": self._pos.doc,
            "files": [p.name for p in self.files],
            "tokens_per_rank": self.tokens_per_rank,
            "max_seq_len": self.max_seq_len,
            "max_docs": self.max_docs,
            "merge": self.merge,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at a :meth:`state_dict` position; the batches that follow are identical."""
        if state.get("format") != _STATE_FORMAT:
            raise DataError(f"not a TrainLoader state (format {state.get('format')!r}, expected {_STATE_FORMAT!r})")
        names = [p.name for p in self.files]
        if list(state["files"]) != names:
            raise DataError(
                f"loader state was saved for training files {state['files'][:3]}... ({len(state['files'])} files) "
                f"but this loader reads {names[:3]}... ({len(names)} files); resume with the same files"
            )
        shard, doc = int(state["shard"]), int(state["doc"])
        if not 0 <= shard < len(self.files) or doc < 0 or doc > self._store.get(shard).num_docs:
            raise DataError(f"loader state position shard={shard} doc={doc} is outside the training files")
        self.set_shape(int(state["tokens_per_rank"]), int(state["max_seq_len"]), int(state["max_docs"]),
                       int(state.get("merge", 1)))
        self._pos = _Pos(int(state["epoch"]), shard, doc)
        self.epochs_completed = self._pos.epoch

    # -- batches ----------------------------------------------------------------------------------

    def next_batch(self, *, on_host: bool = False) -> Batch:
        """The next micro-batch of this rank; advances the stream by ``world_size * merge`` chunks.
        Taken from the batches :meth:`build_ahead` queued when the first of them starts here, else
        built on this thread.  ``on_host``: leave it in host memory (pinned for a CUDA loader),
        for a caller that copies it into buffers of its own (a CUDA graph's static inputs) or
        moves it later (:func:`batch_to`); else it is on the loader's device."""
        shape = self._shape()
        made = None
        if self._pending and self._pending[0][0] == shape:
            start, made = self._pending.popleft()[1].result()
            if start != self._pos:  # not where the stream is (cannot happen: moves discard)
                made = None
        if made is None:
            self._discard_pending()
            made = self._produce(self._pos, *shape)
        batch, next_pos, merged, cycled = made
        self._pos = next_pos
        self._note(merged, cycled)
        return batch if on_host else batch_to(batch, self.device)

    def build_ahead(self) -> None:
        """Queue batches on the builder thread until ``prefetch_batches`` are pending (none without
        ``prefetch``), each starting where the one before it ends, in the current shape.

        The builder's Python holds the interpreter lock in stretches, and a thread that wants the
        lock back may wait for the whole stretch: a builder running while this thread issues work
        delays every step of it.  So building starts only when asked, where this thread is about
        to wait anyway: a training step asks once all its work is issued, after which the loop
        waits for the GPU to finish the step before (:func:`speedrun.train.loop.run_step`)."""
        if self._pool is None:
            return
        shape = self._shape()
        while len(self._pending) < self.prefetch_batches:
            before = self._pending[-1][1] if self._pending else None
            self._pending.append((shape, self._pool.submit(self._produce_after, before, self._pos, shape)))

    def __iter__(self) -> Iterator[Batch]:
        """Batches without end, the next ones built ahead while the caller uses each."""
        while True:
            batch = self.next_batch()
            self.build_ahead()
            yield batch

    def close(self) -> None:
        """Stop the background threads and free the shards; the loader is unusable afterwards."""
        self._discard_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._store.close()

    def __enter__(self) -> "TrainLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _shape(self) -> tuple[int, int, int, int]:
        """What a batch is built for: (tokens per chunk, document cap, max_docs, merge)."""
        return self.tokens_per_rank, self.max_seq_len, self.max_docs, self.merge

    def _produce_after(self, before: concurrent.futures.Future | None, pos: _Pos, shape: tuple):
        """(start, :meth:`_produce`'s result) of the batch after ``before``'s (at ``pos`` if None)."""
        if before is not None:
            _, (_, pos, _, _) = before.result()  # where the batch before ends
        return pos, self._produce(pos, *shape)

    def _discard_pending(self) -> None:
        pending, self._pending = self._pending, collections.deque()
        for _, fut in pending:
            fut.cancel()
        for _, fut in pending:
            if fut.cancelled():
                continue
            try:
                fut.result()  # a few ms at most; errors resurface when the batch is really needed
            except Exception:
                pass

    def _note(self, merged: bool, cycled: bool) -> None:
        if cycled:
            self.epochs_completed = self._pos.epoch
            if not self._warned_cycle:
                self._warned_cycle = True
                msg = (f"training data exhausted: all {len(self.files)} shard(s) read, starting again from "
                       f"{self.files[0].name} (further repeats are not reported)")
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        if merged:
            self.merged_batches += 1
            if not self._warned_merge:
                self._warned_merge = True
                msg = (f"a batch held more than max_docs={self.max_docs} documents; neighbouring short documents "
                       f"were merged into shared attention segments (no tokens dropped; counted in merged_batches)")
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _advance_shard(self, pos: _Pos) -> _Pos:
        if pos.shard + 1 < len(self.files):
            return _Pos(pos.epoch, pos.shard + 1, 0)
        return _Pos(pos.epoch + 1, 0, 0)

    def _plan(self, pos: _Pos, T: int, L: int) -> tuple[list[tuple[_Shard, int, int, int]], _Pos]:
        """Pieces (shard, first doc, end doc, tokens of the last doc) of the chunk starting at pos."""
        need = T + 1
        pieces = []
        while True:
            sh = self._store.get(pos.shard)
            cs = sh.cum(L)
            n = sh.num_docs
            d = min(pos.doc, n)
            avail = int(cs[n] - cs[d])
            if avail >= need:
                j = int(np.searchsorted(cs, cs[d] + need, side="left"))
                tail = need - int(cs[j - 1] - cs[d])
                pieces.append((sh, d, j, tail))
                pos = _Pos(pos.epoch, pos.shard, j)
                if j == n:
                    pos = self._advance_shard(pos)
                break
            if avail > 0:
                pieces.append((sh, d, n, int(min(sh.lens[n - 1], L))))
                need -= avail
            pos = self._advance_shard(pos)
        self._store.prefetch((pos.shard + 1) % len(self.files))
        return pieces, pos

    def _produce(self, pos: _Pos, T: int, L: int, max_docs: int, merge: int):
        """Build this rank's batch of ``merge`` chunks starting at pos, in host memory (pinned for
        a CUDA loader), with its views and bigram row mask: all of it on the builder thread.

        Returns (the batch, next position, whether documents were merged, whether the stream
        wrapped around)."""
        start_epoch = pos.epoch
        chunks, segments = [], []
        for _ in range(merge):
            mine = None
            for r in range(self.world_size):
                pieces, pos = self._plan(pos, T, L)
                if r == self.rank:
                    mine = pieces
            chunk, bounds = self._chunk(mine, T, L)
            chunks.append(chunk)
            segments.append((bounds, _fit_segments(bounds, max_docs, L)))
        host = _host_arrays(chunks, [fitted for _, fitted in segments], max_docs, self.bigram_mod,
                            pin=self.device.type == "cuda")
        rows = _row_mask(*host, self.bigram_mod) if self.bigram_rows else None
        num_docs = sum(len(fitted) - 1 for _, fitted in segments)
        merged = any(len(fitted) != len(bounds) for bounds, fitted in segments)
        return _host_batch(host, num_docs, L, rows), pos, merged, pos.epoch != start_epoch

    @staticmethod
    def _chunk(mine, T: int, L: int) -> tuple[np.ndarray, np.ndarray]:
        """One chunk's (T+1,) tokens and its (n+1,) document edges in [0, T] from its pieces."""
        chunk_parts, len_parts = [], []
        for sh, d0, d1, tail in mine:
            lens = sh.capped(L)[d0:d1].copy()
            lens[-1] = tail
            starts = sh.starts[d0:d1]
            offsets = np.cumsum(lens) - lens
            idx = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - offsets, lens)
            chunk_parts.append(sh.tokens[idx])
            len_parts.append(lens)
        chunk = np.concatenate(chunk_parts)
        lens = np.concatenate(len_parts)
        edges = np.concatenate(([0], np.cumsum(lens)))
        return chunk, np.append(edges[edges < T], T).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# Validation


class ValLoader:
    """Contiguous validation batches (see the module doc): ``len(self)`` batches per pass.

    files: validation shards, read as one concatenated stream.  num_tokens: tokens to evaluate
    (rounded down to a multiple of ``tokens_per_rank * world_size``).
    """

    def __init__(self, files, num_tokens: int, tokens_per_rank: int, *, rank: int = 0, world_size: int = 1,
                 bos_id: int, vocab_size: int | None = None, max_docs: int | None = None,
                 device: str | torch.device = "cpu", bigram_mod: int | None = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if tokens_per_rank < 1:
            raise ValueError(f"tokens_per_rank must be positive, got {tokens_per_rank}")
        self.files = _check_files(files, "validation")
        self.rank, self.world_size, self.tokens_per_rank = rank, world_size, int(tokens_per_rank)
        self.bos_id, self.vocab_size = int(bos_id), vocab_size
        self.max_docs = int(max_docs) if max_docs is not None else default_val_max_docs(self.tokens_per_rank)
        if self.max_docs < 1:
            raise ValueError(f"max_docs must be positive, got {max_docs}")
        self.device = torch.device(device)
        self.bigram_mod = bigram_mod
        step = self.tokens_per_rank * world_size
        self.num_batches = int(num_tokens) // step
        if self.num_batches == 0:
            raise DataError(
                f"val_tokens={num_tokens:,} is less than one validation step of {step:,} tokens "
                f"(tokens_per_rank {tokens_per_rank:,} x {world_size} ranks)"
            )
        need = self.num_batches * step + 1
        self._parts: list[np.ndarray] = []
        have = 0
        for p in self.files:
            if have >= need:
                break
            toks = read_shard(p)
            use = toks[: need - have]
            if vocab_size is not None:
                check_vocab(use, vocab_size, p)
            if len(use) and not (use == self.bos_id).any():
                raise DataError(f"{p}: no BOS token ({self.bos_id}) in the {len(use):,} tokens used (wrong tokenizer or bos_id?)")
            self._parts.append(toks)
            have += len(toks)
        if have < need:
            raise DataError(
                f"validation files ({', '.join(p.name for p in self.files[:3])}{'...' if len(self.files) > 3 else ''}) "
                f"hold {have:,} tokens but {self.num_batches} steps of {step:,} need {need:,}; lower val_tokens "
                f"to at most {max(have - 1, 0) // step * step:,} or add validation files"
            )
        self._offsets = np.concatenate(([0], np.cumsum([len(t) for t in self._parts]))).astype(np.int64)

    def __len__(self) -> int:
        return self.num_batches

    def _slice(self, start: int, stop: int) -> np.ndarray:
        out = []
        i = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while start < stop:
            lo = start - int(self._offsets[i])
            take = min(stop - start, len(self._parts[i]) - lo)
            out.append(np.asarray(self._parts[i][lo: lo + take]))
            start += take
            i += 1
        return np.concatenate(out) if len(out) > 1 else out[0].copy()

    def batch(self, step: int) -> Batch:
        """This rank's batch of validation step ``step`` (0 <= step < len(self))."""
        if not 0 <= step < self.num_batches:
            raise IndexError(f"validation step {step} outside [0, {self.num_batches})")
        T = self.tokens_per_rank
        start = step * T * self.world_size + self.rank * T
        chunk = self._slice(start, start + T + 1)
        bos = np.flatnonzero(chunk[:T] == self.bos_id)
        bounds = np.concatenate(([0], bos[bos > 0], [T])).astype(np.int64)
        fitted = _fit_segments(bounds, self.max_docs, T)
        host = _host_arrays([chunk], [fitted], self.max_docs, self.bigram_mod, pin=self.device.type == "cuda")
        return batch_to(_host_batch(host, len(fitted) - 1, T), self.device)

    def __iter__(self) -> Iterator[Batch]:
        for s in range(self.num_batches):
            yield self.batch(s)

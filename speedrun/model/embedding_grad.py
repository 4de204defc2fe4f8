"""Embedding lookups whose gradient accumulates in place, once per optimizer step.

Autograd's gradient of a row lookup ``weight[rows]`` is a dense tensor of the table's size:
zeros, the looked-up rows' gradients scattered in, and from the second micro-batch of a step on
a dense add into ``weight.grad``.  The record's tables are large (embed 50,304 x 768, value
embeddings 5x that, bigram 7.5x: 521 M entries, 1.04 GB in bf16), so every micro-batch writes,
reads and adds gigabytes to deliver 49,152 rows (stage-3 profile: ~15 ms per step in zeros,
scatters and bf16 adds).  Here the backward adds the rows' gradients straight into an fp32
accumulator of the table (``index_add_``: the bytes of the rows only), and
:meth:`EmbeddingGradAccumulator.flush` hands the sum to ``weight.grad`` once per step: one pass
over each table instead of three per micro-batch (the adds: one Triton pass,
:mod:`speedrun.kernels.row_accumulate`).  The sum over micro-batches is kept in fp32
(autograd's route rounds to bf16 after every micro-batch), so the result is at least as exact.

The price is an explicit step: until :meth:`flush` runs, ``weight.grad`` lacks the gradients of
the lookups since the last flush (the training step calls it before an optimizer step that reads
these gradients; :meth:`pending` tells whether anything is waiting).  The record's tables are
updated by Adam on odd steps only, so an even step leaves its sum in the accumulators and the odd
step flushes two steps at once: one pass over the tables saved per two steps, and the two steps'
sum rounded to bf16 once instead of twice.  A checkpoint taken after an even step saves the
pending sums (:meth:`pending_sum` / :meth:`restore`), so a resumed run adds the next step to
exactly the same numbers; a discarded step (the warmup) calls :meth:`discard`.

Where the lookups run: ``model.embedding_grad="atomic"`` looks the rows up before the compiled
network (gathered copies, then read by it); ``"atomic_graph"`` inside it
(:meth:`EmbeddingGradAccumulator.traced_lookup`), where Inductor fuses each gather into the
kernels that read the rows.  Either way the backward is one custom op per table
(``speedrun::accumulate_embedding_rows``), which reaches its accumulator by an integer handle.
"""

from __future__ import annotations

import torch

from speedrun.kernels.device_work import DeviceWork

# Accumulators by handle: the backward reaches its table's accumulator through an integer, a
# constant in a compiled graph (``model.embedding_grad="atomic_graph"`` traces the lookups).
_ACCUMULATORS: list[torch.Tensor] = []


def _accumulate_embedding_rows(grad: torch.Tensor, rows: torch.Tensor, handle: int) -> torch.Tensor:
    acc = _ACCUMULATORS[handle]
    if acc is None:
        raise RuntimeError(f"embedding gradient accumulator {handle} was dropped (clear() or a table moved) "
                           "before the backward of a lookup that uses it ran")
    if grad.is_cuda:
        from speedrun.kernels.row_accumulate import accumulate_rows

        accumulate_rows(acc, rows, grad)
    else:  # the kernels' reference (their own tests run them in Triton's CPU interpreter)
        acc.index_add_(0, rows, grad.to(acc.dtype))
    return grad.new_empty(0)


# ``speedrun::accumulate_embedding_rows(grad, rows, handle) -> (0,)``: adds the rows' gradients into
# accumulator ``handle`` at run time.  Its empty result is the gradient of the lookup's anchor, so a
# compiled backward keeps the call (an op whose result nothing reads could be dropped).
_LIB = torch.library.Library("speedrun", "FRAGMENT")
_LIB.define("accumulate_embedding_rows(Tensor grad, Tensor rows, int handle) -> Tensor")
_LIB.impl("accumulate_embedding_rows", _accumulate_embedding_rows, "CompositeExplicitAutograd")
torch.library.register_fake("speedrun::accumulate_embedding_rows", lambda grad, rows, handle: grad.new_empty(0),
                            lib=_LIB)


class _AccumulatingLookup(torch.autograd.Function):
    """``weight[rows]`` forward (traceable: compiled, Inductor fuses the gather into its readers);
    the backward adds the output gradient's rows into accumulator ``handle`` (fp32, ``weight``'s
    shape) and returns no gradient for ``weight``, only an empty one for ``anchor`` (a (0,)
    tensor that requires grad and carries the op through a compiled backward)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, anchor: torch.Tensor, handle: int) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.handle = handle
        return weight.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        done = torch.ops.speedrun.accumulate_embedding_rows(grad.contiguous(), rows, ctx.handle)
        return None, None, done, None


class EmbeddingGradAccumulator:
    """fp32 gradient accumulators for embedding tables, one per parameter (allocated on first use).

    ``lookup(weight, rows)``: ``weight[rows]`` (``rows`` 1-D integer indices into the first dim)
    whose gradient goes into the accumulator when autograd reaches it.  ``flush()``: add each
    accumulator into its parameter's ``.grad`` (created when None) and zero it.  The backward adds
    rows with :func:`speedrun.kernels.row_accumulate.accumulate_rows` (atomic fp32 adds)."""

    def __init__(self) -> None:
        self._acc: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._handles: dict[int, tuple[int, torch.Tensor]] = {}  # id(acc) -> (handle, anchor)
        self._by_name: dict[str, tuple[int, torch.Tensor]] = {}  # prepare()'s tables -> (handle, anchor)
        self._pending = False
        # id(weight) -> (weight, the buffer flush hands over as its .grad): kept for the run, so
        # the gradient an optimizer step reads has one address from step to step (a captured
        # optimizer update reads it there)
        self._grads: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}

    def _accumulator(self, weight: torch.nn.Parameter) -> torch.Tensor:
        """``weight``'s fp32 accumulator, allocated on first use (and again if the table changed
        shape or device; the old one's handle then points nowhere)."""
        entry = self._acc.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1].shape != weight.shape or entry[1].device != weight.device:
            if entry is not None and id(entry[1]) in self._handles:
                _ACCUMULATORS[self._handles.pop(id(entry[1]))[0]] = None
            entry = self._acc[id(weight)] = (weight, torch.zeros(weight.shape, dtype=torch.float32, device=weight.device))
            self._grad_buffer(weight)  # with the accumulator: what a step reads keeps its address from the start
        return entry[1]

    def _entry(self, weight: torch.nn.Parameter) -> tuple[int, torch.Tensor]:
        """(handle, anchor) of ``weight``'s accumulator, allocated and registered on first use."""
        acc = self._accumulator(weight)
        if id(acc) not in self._handles:
            _ACCUMULATORS.append(acc)
            self._handles[id(acc)] = (len(_ACCUMULATORS) - 1, torch.zeros(0, device=acc.device, requires_grad=True))
        return self._handles[id(acc)]

    def lookup(self, weight: torch.nn.Parameter, rows: torch.Tensor) -> torch.Tensor:
        """``weight[rows]`` whose gradient goes into the accumulator (eager: allocates on first use)."""
        if rows.dim() != 1:
            raise ValueError(f"EmbeddingGradAccumulator.lookup: rows must be 1-D, got shape {tuple(rows.shape)}")
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return weight.index_select(0, rows)
        handle, anchor = self._entry(weight)
        self._pending = True
        return _AccumulatingLookup.apply(weight, rows, anchor, handle)

    def prepare(self, tables: dict[str, torch.nn.Parameter]) -> None:
        """Allocate and register the accumulators of ``tables`` (outside compiled code) for
        :meth:`traced_lookup`, and mark gradients pending (the lookups about to run add to them)."""
        for name, w in tables.items():  # in place, entries kept when unchanged: nothing for a guard to see
            entry = self._entry(w)
            if self._by_name.get(name) is not entry:
                self._by_name[name] = entry
        self._pending = True

    def traced_lookup(self, name: str, weight: torch.nn.Parameter, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`lookup` for code that ``torch.compile`` traces: the accumulator of table ``name``
        comes from the last :meth:`prepare` (nothing is allocated or marked here)."""
        entry = self._by_name.get(name)
        if entry is None:
            raise RuntimeError(f"EmbeddingGradAccumulator.traced_lookup: table {name!r} was not prepared; call "
                               "prepare() (RecordGPT.prepare_embedding_grads) before the network runs with gradients")
        handle, anchor = entry
        return _AccumulatingLookup.apply(weight, rows, anchor, handle)

    def pending(self) -> bool:
        """True when lookups ran with gradient since the last :meth:`flush` (their backward may
        have added to the accumulators)."""
        return self._pending

    def host_state(self) -> tuple[bool, dict]:
        """Whether sums are pending and the prepared tables (a copy; see :mod:`speedrun.train.graphs`)."""
        return self._pending, dict(self._by_name)

    def set_host_state(self, state: tuple[bool, dict]) -> None:
        self._pending = state[0]
        self._by_name.clear()  # in place, as InputScaling.set_host_state refills its containers
        self._by_name.update(state[1])

    def flush(self) -> None:
        """``weight.grad += acc`` (fp32 sum, one rounding to the parameter's dtype) for every
        table, then the accumulators are zeroed.  No-op when nothing is pending."""
        work = self.prepare_flush()
        if work is not None:
            work.launch()

    def prepare_flush(self) -> "EmbeddingFlush | None":
        """The host half of :meth:`flush`: every table without a gradient gets the buffer the
        flush copies into as its ``.grad`` (one per table, kept across steps), nothing is pending
        any more, and the kernels are returned (:class:`EmbeddingFlush`, to launch before anything
        reads the gradients).  None when nothing is pending."""
        if not self._pending:
            return None
        tables = []
        for weight, acc in self._acc.values():
            if weight.grad is None:
                # (never acc itself: it is zeroed next)
                weight.grad = self._grad_buffer(weight)
                tables.append((weight.grad, acc, "copy"))
            else:
                tables.append((weight.grad, acc, "add"))
        self._pending = False
        return EmbeddingFlush(tables)

    def _grad_buffer(self, weight: torch.nn.Parameter) -> torch.Tensor:
        entry = self._grads.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1].shape != weight.shape or entry[1].dtype != weight.dtype \
                or entry[1].device != weight.device:
            entry = self._grads[id(weight)] = (weight, torch.empty_like(weight, memory_format=torch.contiguous_format))
        return entry[1]

    def pending_sum(self, weight: torch.nn.Parameter) -> torch.Tensor | None:
        """The fp32 sum accumulated for ``weight`` since the last flush (a reference), or None
        when nothing is pending or ``weight`` has no accumulator."""
        entry = self._acc.get(id(weight))
        if not self._pending or entry is None or entry[0] is not weight:
            return None
        return entry[1]

    @torch.no_grad()
    def restore(self, weight: torch.nn.Parameter, total: torch.Tensor) -> None:
        """Make ``total`` (``weight``'s shape) the pending sum for ``weight`` (a checkpoint's
        :meth:`pending_sum`), allocating the accumulator where needed."""
        if tuple(total.shape) != tuple(weight.shape):
            raise ValueError(f"EmbeddingGradAccumulator.restore: sum of shape {tuple(total.shape)} for a table "
                             f"of shape {tuple(weight.shape)}")
        self._accumulator(weight).copy_(total)
        self._pending = True

    @torch.no_grad()
    def discard(self) -> None:
        """Zero the accumulators in place (their memory stays): the gradients since the last flush
        are dropped, as ``optimizer.zero_grad()`` drops ``.grad``."""
        if self._pending:
            for _, acc in self._acc.values():
                acc.zero_()
        self._pending = False

    def clear(self) -> None:
        """Drop the accumulators and anything pending (a step abandoned before its flush)."""
        for handle, _ in self._handles.values():
            _ACCUMULATORS[handle] = None  # the memory goes; the handle is never reused
        self._acc.clear()
        self._grads.clear()
        self._handles.clear()
        self._by_name.clear()
        self._pending = False


class EmbeddingFlush(DeviceWork):
    """The kernels of one :meth:`EmbeddingGradAccumulator.flush`: per table, ``grad`` <- ``acc``
    (a gradient buffer the flush made the table's ``.grad``) or ``grad += acc`` (one autograd
    made), then ``acc`` zeroed.  ``tables``: (grad, acc, "copy" or "add") per table."""

    def __init__(self, tables: list[tuple[torch.Tensor, torch.Tensor, str]]):
        self.tables = tables
        self.key = ("embedding_flush", tuple(mode for _, _, mode in tables))

    @torch.no_grad()
    def launch(self) -> None:
        for grad, acc, mode in self.tables:
            if mode == "copy":
                grad.copy_(acc)
            else:
                grad.add_(acc)
            acc.zero_()

    def written(self) -> list[tuple[str, torch.Tensor]]:
        return [item for i, (grad, acc, _) in enumerate(self.tables)
                for item in ((f"table{i}.grad", grad), (f"table{i}.accumulator", acc))]


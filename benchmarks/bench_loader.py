"""Time the training loader on one CPU core at the record's stage-3 shape.

Builds a synthetic GPT-2-like shard (20M tokens; document lengths log-normal with a median of
~190 tokens and a long tail, like web text) and, if $SPEEDRUN_TEST_DATA holds the decompressed
webmix_train_000000.bin, uses that too.  For each it reports the median milliseconds per
49,152-token batch (max_seq_len 2048, world_size 1, bigram hash on) over >= 50 batches:

* sync:      prefetch off, so every call builds the batch;
* prefetch:  back-to-back calls with prefetch on (the producer thread bounds this);
* hidden:    prefetch on with 20 ms of simulated model work between calls: the time the
             training loop actually waits.

Usage:  python benchmarks/bench_loader.py [--batches 100] [--tokens-per-rank 49152]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from speedrun.data.loader import TrainLoader
from speedrun.data.shards import write_shard


def synthetic_shard(path: Path, num_tokens: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lens = np.maximum(2, rng.lognormal(mean=np.log(190), sigma=1.1, size=num_tokens // 150)).astype(np.int64)
    lens = lens[np.cumsum(lens) <= num_tokens]
    tokens = rng.integers(0, 50256, int(lens.sum()), dtype=np.int64)
    tokens[np.concatenate(([0], np.cumsum(lens)[:-1]))] = 50256
    return write_shard(path, tokens)


def bench(files: list[Path], T: int, L: int, n: int, prefetch: bool, work_ms: float = 0.0) -> tuple[float, float]:
    """(median ms blocked in next_batch, construction seconds)."""
    t0 = time.perf_counter()
    loader = TrainLoader(files, T, L, bos_id=50256, vocab_size=50257, prefetch=prefetch, bigram_mod=377279)
    setup = time.perf_counter() - t0
    for _ in range(3):
        loader.next_batch()
    times = []
    for _ in range(n):
        if work_ms:
            time.sleep(work_ms / 1000)  # stands in for the forward/backward pass
        t = time.perf_counter()
        loader.next_batch()
        times.append((time.perf_counter() - t) * 1000)
    loader.close()
    return statistics.median(times), setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--tokens-per-rank", type=int, default=49152)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", RuntimeWarning)  # merging/cycling notices
    logging.getLogger("speedrun.data").setLevel(logging.ERROR)
    T, L, n = args.tokens_per_rank, args.max_seq_len, max(50, args.batches)
    print(f"loader benchmark: T={T:,} tokens/batch, max_seq_len={L}, world_size=1, {n} batches, "
          f"torch threads={torch.get_num_threads()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        sets = {"synthetic (20M tokens)": [synthetic_shard(Path(tmp) / "synth.bin", 20_000_000)]}
        data = os.environ.get("SPEEDRUN_TEST_DATA")
        if data and (Path(data) / "webmix_train_000000.bin").is_file():
            sets["webmix_train_000000"] = [Path(data) / "webmix_train_000000.bin"]
        for name, files in sets.items():
            sync, setup = bench(files, T, L, n, prefetch=False)
            pre, _ = bench(files, T, L, n, prefetch=True)
            hidden, _ = bench(files, T, L, n, prefetch=True, work_ms=20.0)
            print(f"{name:24s} sync {sync:6.2f} ms | prefetch back-to-back {pre:6.2f} ms | "
                  f"prefetch with 20 ms work {hidden:6.3f} ms | first shard load {setup * 1000:.0f} ms")


if __name__ == "__main__":
    main()

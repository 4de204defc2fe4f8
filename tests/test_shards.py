"""Shard format: round trips and every kind of corrupt file gives one clear DataError."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from speedrun.data.shards import HEADER_BYTES, MAGIC, VERSION, load_shard, read_header, read_shard, write_shard
from speedrun.errors import DataError


def _header(count: int, magic: int = MAGIC, version: int = VERSION) -> bytes:
    h = np.zeros(256, dtype="<i4")
    h[0], h[1], h[2] = magic, version, count
    return h.tobytes()


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_round_trip(tmp_path, n):
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, 50257, n).astype(np.int64)
    p = write_shard(tmp_path / "sub" / "s.bin", tokens)
    assert p.stat().st_size == HEADER_BYTES + 2 * n
    assert read_header(p) == n
    for got in (read_shard(p, vocab_size=50257), load_shard(p, vocab_size=50257)):
        assert got.dtype == np.uint16
        np.testing.assert_array_equal(got.astype(np.int64), tokens)


def test_header_layout_is_little_endian_int32(tmp_path):
    p = write_shard(tmp_path / "s.bin", [50256, 1, 2])
    raw = p.read_bytes()
    assert np.frombuffer(raw[:12], "<i4").tolist() == [MAGIC, VERSION, 3]
    assert not any(raw[12:HEADER_BYTES])
    assert np.frombuffer(raw[HEADER_BYTES:], "<u2").tolist() == [50256, 1, 2]


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    write_shard(tmp_path / "s.bin", [1, 2, 3])
    write_shard(tmp_path / "s.bin", [4, 5])  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]
    assert read_shard(tmp_path / "s.bin").tolist() == [4, 5]


@pytest.mark.parametrize("bad", [[-1], [65536], [[1, 2]], [1.5]])
def test_write_rejects_bad_tokens(tmp_path, bad):
    with pytest.raises(DataError, match="s.bin"):
        write_shard(tmp_path / "s.bin", bad)
    assert not (tmp_path / "s.bin").exists()


def test_write_checks_vocab(tmp_path):
    with pytest.raises(DataError, match="257"):
        write_shard(tmp_path / "s.bin", [256, 257], vocab_size=257)


CORRUPT = {
    "empty file": (b"", "empty file"),
    "short header": (_header(0)[:100], "short header"),
    "bad magic": (_header(2, magic=12345) + b"\0" * 4, "bad magic"),
    "bad version": (_header(2, version=7) + b"\0" * 4, "version 7"),
    "truncated body": (_header(10) + b"\0" * 8, "truncated body"),
    "trailing bytes": (_header(2) + b"\0" * 6, "trailing bytes"),
    "count mismatch": (_header(3) + b"\0" * 4, "truncated body"),
    "odd trailing byte": (_header(2) + b"\0" * 5, "trailing bytes"),
    "negative count": (_header(-5), "negative"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_files_raise_one_clear_error(tmp_path, case):
    data, msg = CORRUPT[case]
    p = tmp_path / "bad.bin"
    p.write_bytes(data)
    for fn in (read_header, read_shard, load_shard):
        with pytest.raises(DataError, match=msg) as ei:
            fn(p)
        assert str(p) in str(ei.value)
        assert ei.value.__cause__ is None  # no chained numpy/OS traceback


def test_token_id_out_of_vocab(tmp_path):
    p = write_shard(tmp_path / "s.bin", [256, 10, 300, 5])
    assert read_shard(p).max() == 300  # no vocab given: fine
    for fn in (read_shard, load_shard):
        with pytest.raises(DataError, match=r"token id 300 >= vocab size 257.*index 2"):
            fn(p, vocab_size=257)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="does not exist") as ei:
        read_shard(tmp_path / "nope.bin")
    assert "nope.bin" in str(ei.value)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(DataError, match="is a directory"):
        read_shard(tmp_path)


def test_importing_speedrun_data_has_no_heavy_side_effects():
    code = ("import sys, speedrun.data, speedrun.data.sources, speedrun.cli.data; "
            "print('torch' in sys.modules, 'tiktoken' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr

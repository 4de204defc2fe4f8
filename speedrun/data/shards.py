"""The speedrun shard format: read, write and validate token files.

A shard is a 1024-byte header of 256 little-endian int32 followed by the tokens as little-endian
uint16::

    header[0] = 20240520   magic
    header[1] = 1          version
    header[2] = N          number of tokens that follow (file size = 1024 + 2 * N bytes)
    header[3:] = 0         reserved

Every document starts with the tokenizer's BOS id (50256 for GPT-2, 256 for the byte tokenizer).
Every problem with a file is reported as one :class:`~speedrun.errors.DataError` naming the file
and what is wrong, never as an exception from deep inside numpy.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from speedrun.errors import DataError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_BYTES = 2
MAX_TOKEN_ID = np.iinfo(np.uint16).max  # uint16 storage
MAX_TOKENS = np.iinfo(np.int32).max  # the count is an int32 in the header

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER_BYTES",
    "read_header",
    "read_shard",
    "load_shard",
    "write_shard",
    "check_vocab",
]


def _check_is_file(path: Path) -> int:
    """Return the file size in bytes, or raise DataError if ``path`` is not a readable file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(f"{path}: shard file does not exist") from None
    except OSError as e:
        raise DataError(f"{path}: cannot access shard file ({e.strerror or e})") from None
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a shard file (.bin); use a glob like '{path}/*.bin'")
    if not path.is_file():
        raise DataError(f"{path}: is not a regular file")
    return st.st_size


def read_header(path: str | os.PathLike) -> int:
    """Validate the header and size of a shard; return its token count.

    Checks: the file exists and is a regular file, is at least 1024 bytes, has the magic number
    and version, and its size equals ``1024 + 2 * count`` exactly (a truncated body and trailing
    bytes are both errors).  Reads only the header, so it is cheap for 200 MB shards.
    """
    path = Path(path)
    size = _check_is_file(path)
    if size == 0:
        raise DataError(f"{path}: empty file (0 bytes), expected a {HEADER_BYTES}-byte shard header then uint16 tokens")
    if size < HEADER_BYTES:
        raise DataError(f"{path}: short header: file has {size} bytes, a shard header needs {HEADER_BYTES}")
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read shard file ({e.strerror or e})") from None
    if len(raw) != HEADER_BYTES:  # file shrank between stat and read
        raise DataError(f"{path}: short header: read {len(raw)} bytes, a shard header needs {HEADER_BYTES}")
    header = np.frombuffer(raw, dtype="<i4")
    if int(header[0]) != MAGIC:
        raise DataError(
            f"{path}: bad magic number {int(header[0])} (expected {MAGIC}); not a speedrun token shard"
        )
    if int(header[1]) != VERSION:
        raise DataError(f"{path}: unsupported shard version {int(header[1])} (this reader supports {VERSION})")
    count = int(header[2])
    if count < 0:
        raise DataError(f"{path}: header token count is negative ({count})")
    expected = HEADER_BYTES + TOKEN_BYTES * count
    if size < expected:
        raise DataError(
            f"{path}: truncated body: header says {count:,} tokens ({expected:,} bytes) but the file has "
            f"{size:,} bytes ({(size - HEADER_BYTES) // TOKEN_BYTES:,} tokens); re-create or re-download it"
        )
    if size > expected:
        raise DataError(
            f"{path}: trailing bytes: header says {count:,} tokens ({expected:,} bytes) but the file has "
            f"{size:,} bytes ({size - expected:,} bytes too many); the token count does not match the file size"
        )
    return count


def check_vocab(tokens: np.ndarray, vocab_size: int, path: str | os.PathLike) -> None:
    """Raise DataError if any token id in ``tokens`` is ``>= vocab_size``."""
    if tokens.size == 0:
        return
    top = int(tokens.max())
    if top >= vocab_size:
        where = int(np.argmax(tokens >= vocab_size))
        raise DataError(
            f"{path}: token id {top} >= vocab size {vocab_size} (first offending token at index {where:,}); "
            f"was this shard made with a different tokenizer?"
        )


def read_shard(path: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray:
    """Return the tokens of a validated shard as a read-only uint16 memmap of shape (N,).

    With ``vocab_size`` every token id is also checked to be ``< vocab_size`` (one pass over the
    data).
    """
    path = Path(path)
    count = read_header(path)
    if count == 0:
        tokens = np.zeros(0, dtype=np.uint16)
    else:
        try:
            tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot map shard file ({e})") from None
    if vocab_size is not None:
        check_vocab(tokens, vocab_size, path)
    return tokens


def load_shard(path: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray:
    """Like :func:`read_shard` but reads the tokens into memory (a writable uint16 array, (N,))."""
    path = Path(path)
    count = read_header(path)
    tokens = np.empty(count, dtype="<u2")
    try:
        with open(path, "rb") as f:
            f.seek(HEADER_BYTES)
            got = f.readinto(memoryview(tokens).cast("B"))
    except OSError as e:
        raise DataError(f"{path}: cannot read shard file ({e.strerror or e})") from None
    if got != count * TOKEN_BYTES:
        raise DataError(f"{path}: truncated body: read {got} of {count * TOKEN_BYTES} bytes")
    if vocab_size is not None:
        check_vocab(tokens, vocab_size, path)
    return tokens


def _as_uint16(tokens, path: Path, vocab_size: int | None) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"{path}: tokens must be a 1-D sequence, got shape {tuple(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size > MAX_TOKENS:
        raise DataError(f"{path}: {arr.size:,} tokens do not fit one shard (at most {MAX_TOKENS:,})")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise DataError(f"{path}: token id {bad} outside [0, {limit}) (uint16 storage / vocab size)")
    return arr.astype("<u2", copy=False)


def write_shard(path: str | os.PathLike, tokens, vocab_size: int | None = None) -> Path:
    """Write ``tokens`` (1-D integer sequence, ids in [0, 65535]) as a shard at ``path``.

    The file is written to a temporary name in the same folder and renamed into place, so a
    reader never sees a half-written shard.  Parent folders are created.  Returns the path.
    """
    path = Path(path)
    arr = _as_uint16(tokens, path, vocab_size)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, arr.size
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise DataError(f"{path}: cannot create shard file ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # mkstemp makes 0600; a shard is data like any file open() writes
                os.fchmod(fd, _file_mode())
            f.write(header.tobytes())
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise DataError(f"{path}: cannot write shard file ({e.strerror or e})") from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0666 less the process umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask

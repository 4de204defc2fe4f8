"""Tokenizers: GPT-2 BPE through tiktoken (offline-capable) and a byte-level tokenizer.

Both have the same small interface:

* ``name`` (``"gpt2"`` / ``"bytes"``), ``vocab_size`` (50257 / 257), ``bos_id`` (50256 / 256);
* ``encode(text) -> list[int]`` without BOS (special-token text such as ``<|endoftext|>`` is
  encoded as ordinary text, never as BOS);
* ``decode(ids) -> str``, which drops BOS ids and replaces invalid UTF-8 with U+FFFD.

GPT-2 files are looked up, in order, in: the ``tokenizer_dir`` argument, ``$SPEEDRUN_TOKENIZER_DIR``
(a folder holding ``encoder.json`` and ``vocab.bpe``), and tiktoken's own cache
(``$TIKTOKEN_CACHE_DIR``).  Only when none has them is the network tried, and only after a quick
connectivity check, so an offline machine gets a clear :class:`DataError` at once instead of a
hanging download.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Protocol

from speedrun.errors import DataError

GPT2_BOS = 50256
GPT2_VOCAB = 50257
BYTE_BOS = 256
BYTE_VOCAB = 257

ENV_TOKENIZER_DIR = "SPEEDRUN_TOKENIZER_DIR"
ENV_OFFLINE = "SPEEDRUN_OFFLINE"

_GPT2_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}
_GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# The GPT-2 / r50k pre-tokenization regex (contractions, letters, digits, other, whitespace).
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_HOW_TO_OFFLINE = (
    "point at local GPT-2 files: pass --tokenizer-dir DIR (or set data.tokenizer_dir / "
    f"${ENV_TOKENIZER_DIR}) to a folder holding encoder.json and vocab.bpe, or set TIKTOKEN_CACHE_DIR "
    "to a tiktoken cache that has the gpt2 files; or use the byte tokenizer (--tokenizer bytes)"
)


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS; vocab_size 257."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    bos_id = BYTE_BOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The token ids as a ``bytes`` object (each byte is one id); fast path for bulk work."""
        return text.encode("utf-8")

    def decode(self, ids: Iterable[int]) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == BYTE_BOS:
                continue
            if not 0 <= i < 256:
                raise ValueError(f"byte tokenizer: token id {i} outside [0, {BYTE_VOCAB})")
            out.append(i)
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, bos_id=256)"


class GPT2Tokenizer:
    """GPT-2 BPE (tiktoken): vocab_size 50257, BOS = ``<|endoftext|>`` = 50256.

    ``encoding`` is the underlying ``tiktoken.Encoding`` (e.g. for
    ``encoding.decode_single_token_bytes``); ``source`` says where the BPE files came from.
    """

    name = "gpt2"
    vocab_size = GPT2_VOCAB
    bos_id = GPT2_BOS

    def __init__(self, encoding, source: str):
        if encoding.n_vocab != GPT2_VOCAB or encoding.eot_token != GPT2_BOS:
            raise DataError(
                f"GPT-2 tokenizer from {source}: expected 50257 tokens with <|endoftext|> = 50256, got "
                f"{encoding.n_vocab} tokens and <|endoftext|> = {encoding.eot_token}"
            )
        self.encoding = encoding
        self.source = source

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids if int(i) != GPT2_BOS], errors="replace")

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(source={self.source!r})"


# ----------------------------------------------------------------------------------------------
# Finding GPT-2 files


def network_reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    """True if a TCP connection to ``host:port`` opens within ``timeout`` seconds.

    ``$SPEEDRUN_OFFLINE=1`` forces False (for tests and air-gapped machines).
    """
    if os.environ.get(ENV_OFFLINE, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _tiktoken_cache_dir() -> Path | None:
    """Where an unmodified ``tiktoken.get_encoding`` would look for cached files (None: caching off)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        d = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        d = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(d) if d else None


def _tiktoken_cache_has_gpt2() -> bool:
    d = _tiktoken_cache_dir()
    if d is None:
        return False
    return all((d / hashlib.sha1(url.encode()).hexdigest()).is_file() for url in _GPT2_URLS.values())


_env_lock = threading.Lock()


def _load_from_dir(d: Path):
    import tiktoken
    import tiktoken.load

    missing = [n for n in ("encoder.json", "vocab.bpe") if not (d / n).is_file()]
    if not d.is_dir():
        raise DataError(f"GPT-2 tokenizer folder {d} does not exist; {_HOW_TO_OFFLINE}")
    if missing:
        raise DataError(f"GPT-2 tokenizer folder {d} lacks {' and '.join(missing)}; {_HOW_TO_OFFLINE}")
    for fname, want in _GPT2_SHA256.items():
        try:
            got = hashlib.sha256((d / fname).read_bytes()).hexdigest()
        except OSError as e:
            raise DataError(f"cannot read {d / fname} ({e.strerror or e})") from None
        if got != want:
            raise DataError(
                f"{d / fname} is not the standard GPT-2 {fname} (sha256 {got[:12]}..., expected {want[:12]}...)"
            )
    try:
        pat = __import__("tiktoken_ext.openai_public", fromlist=["r50k_pat_str"]).r50k_pat_str
    except (ImportError, AttributeError):
        pat = _R50K_PAT
    # tiktoken copies local files into its cache dir; a read-only TIKTOKEN_CACHE_DIR would then
    # fail, so caching is switched off ("" disables it) while the local files are read.
    with _env_lock:
        saved = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = ""
        try:
            ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
                vocab_bpe_file=str(d / "vocab.bpe"),
                encoder_json_file=str(d / "encoder.json"),
                vocab_bpe_hash=_GPT2_SHA256["vocab.bpe"],
                encoder_json_hash=_GPT2_SHA256["encoder.json"],
            )
        except (ValueError, OSError, KeyError, AssertionError) as e:
            raise DataError(
                f"GPT-2 tokenizer files in {d} are not the standard GPT-2 encoder.json/vocab.bpe ({e})"
            ) from None
        finally:
            if saved is None:
                os.environ.pop("TIKTOKEN_CACHE_DIR", None)
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = saved
    enc = tiktoken.Encoding(
        name="gpt2", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": GPT2_BOS}
    )
    return GPT2Tokenizer(enc, source=str(d))


@functools.lru_cache(maxsize=4)
def _gpt2_cached(key: str) -> GPT2Tokenizer:
    import tiktoken

    if key.startswith("dir:"):
        return _load_from_dir(Path(key[4:]))
    if key == "tiktoken-cache":
        try:
            return GPT2Tokenizer(tiktoken.get_encoding("gpt2"), source=f"tiktoken cache {_tiktoken_cache_dir()}")
        except Exception as e:  # a corrupt cache entry makes tiktoken try the network
            raise DataError(f"tiktoken cache {_tiktoken_cache_dir()} could not provide gpt2 ({e}); {_HOW_TO_OFFLINE}") from None
    # key == "network"
    host = "openaipublic.blob.core.windows.net"
    if not network_reachable(host):
        raise DataError(f"no GPT-2 tokenizer files found locally and {host} is unreachable (offline?); {_HOW_TO_OFFLINE}")
    try:
        return GPT2Tokenizer(tiktoken.get_encoding("gpt2"), source="tiktoken download")
    except Exception as e:
        raise DataError(f"downloading the GPT-2 tokenizer failed ({e}); {_HOW_TO_OFFLINE}") from None


def gpt2_source(tokenizer_dir: str | os.PathLike | None = None) -> str | None:
    """Where GPT-2 files would come from without the network: ``"dir:PATH"``, ``"tiktoken-cache"``
    or None (nothing local)."""
    if tokenizer_dir:
        return f"dir:{Path(tokenizer_dir).expanduser().resolve()}"
    env = os.environ.get(ENV_TOKENIZER_DIR, "").strip()
    if env:
        return f"dir:{Path(env).expanduser().resolve()}"
    if _tiktoken_cache_has_gpt2():
        return "tiktoken-cache"
    return None


def get_tokenizer(name: str, tokenizer_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Return the tokenizer called ``name`` (``"bytes"`` or ``"gpt2"``).

    For ``"gpt2"``, ``tokenizer_dir`` (else ``$SPEEDRUN_TOKENIZER_DIR``) names a folder with
    ``encoder.json`` and ``vocab.bpe``; without either, tiktoken's cache and then the network are
    tried, failing fast with a DataError that says how to point at local files.  Loaded encodings
    are cached per source.
    """
    key = (name or "").strip().lower()
    if key in ("bytes", "byte"):
        return ByteTokenizer()
    if key in ("gpt2", "gpt-2"):
        return _gpt2_cached(gpt2_source(tokenizer_dir) or "network")
    raise DataError(f"unknown tokenizer {name!r}; known tokenizers: bytes, gpt2")


def tokenizer_for_vocab(max_id: int, tokenizer_dir: str | os.PathLike | None = None) -> Tokenizer | None:
    """Best local guess of the tokenizer of a shard whose largest id is ``max_id`` (no network):
    bytes when ``max_id <= 256``, else GPT-2 if its files are available locally, else None."""
    if max_id <= BYTE_BOS:
        return ByteTokenizer()
    if max_id < GPT2_VOCAB:
        src = gpt2_source(tokenizer_dir)
        if src is not None:
            try:
                return _gpt2_cached(src)
            except DataError:
                return None
    return None

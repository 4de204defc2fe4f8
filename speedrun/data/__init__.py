"""Data: the shard format, tokenizers, text sources and the batch loaders.

Modules: ``shards`` (read/write/validate token files), ``tokenizer`` (GPT-2 via tiktoken, offline
from local files; byte-level), ``builtin_corpus`` (offline text from the Python standard library),
``sources`` (tokenize local text, download FineWeb shards, inspect shards) and ``loader``
(BOS-aligned training batches, contiguous validation batches).

The names below are imported on first use, so ``import speedrun.data`` loads neither torch nor
tiktoken.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "read_shard": "shards",
    "load_shard": "shards",
    "write_shard": "shards",
    "read_header": "shards",
    "get_tokenizer": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "GPT2Tokenizer": "tokenizer",
    "builtin_corpus_shards": "builtin_corpus",
    "Batch": "loader",
    "TrainLoader": "loader",
    "ValLoader": "loader",
    "default_max_docs": "loader",
    "bigram_hash": "loader",
    "tokenize_files": "sources",
    "download_fineweb": "sources",
    "resolve_shards": "sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'speedrun.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"speedrun.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

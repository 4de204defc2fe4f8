"""The prefix-token table of the record's prefix-token loss (recipe §1.4 "Prefix-token prediction").

``table[i]`` is the id of the token whose bytes are the longest *proper*, non-empty prefix of
token ``i``'s bytes, or -1 when no such token exists (single bytes, special tokens such as
``<|endoftext|>``, the padded ids past the real vocabulary, and every id of a byte-level
tokenizer).  Built only from the tokenizer's vocabulary, never from data.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def token_bytes_map(tokenizer) -> dict[bytes, int]:
    """The ``bytes -> id`` map of ordinary (mergeable) tokens of ``tokenizer``.

    Accepts a ``Mapping[bytes, int]``; a ``tiktoken.Encoding`` (its mergeable ranks, which are the
    token ids for GPT-2); an object with an ``encoding`` attribute holding one (the project's
    ``GPT2Tokenizer``); or a byte-level tokenizer (``name == "bytes"``: ids 0..255 are the bytes).
    """
    if isinstance(tokenizer, Mapping):
        return dict(tokenizer)
    enc = getattr(tokenizer, "encoding", None)
    if enc is not None and hasattr(enc, "_mergeable_ranks"):
        tokenizer = enc
    ranks = getattr(tokenizer, "_mergeable_ranks", None)
    if isinstance(ranks, Mapping):
        return dict(ranks)
    if getattr(tokenizer, "name", None) == "bytes":
        return {bytes([b]): b for b in range(256)}
    raise ValueError(
        f"build_prefix_table: cannot read token bytes from {type(tokenizer).__name__}; pass a "
        "tiktoken.Encoding, an object with .encoding, a byte tokenizer (name == 'bytes'), or a "
        "dict bytes -> id"
    )


def build_prefix_table(tokenizer, table_size: int) -> torch.Tensor:
    """(table_size,) int64: the longest proper-prefix token id of every id, -1 where none.

    ``table_size`` is the model's padded vocabulary (ids from the real vocabulary up to it get -1).
    Raises ValueError if a token id does not fit in the table.
    """
    mapping = token_bytes_map(tokenizer)
    if mapping and max(mapping.values()) >= table_size:
        raise ValueError(
            f"build_prefix_table: token id {max(mapping.values())} does not fit a table of size {table_size}"
        )
    table = [-1] * table_size
    for tok, tid in mapping.items():
        # Longest first: the first hit is the answer; tokens are short (GPT-2: <= 128 bytes).
        for cut in range(len(tok) - 1, 0, -1):
            pid = mapping.get(tok[:cut])
            if pid is not None:
                table[tid] = pid
                break
    return torch.tensor(table, dtype=torch.int64)

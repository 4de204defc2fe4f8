"""Tokenizers: byte-level, GPT-2 from local files, and a fast clear failure offline."""

from __future__ import annotations

import time

import pytest

from speedrun.data import tokenizer as tk
from speedrun.data.tokenizer import ByteTokenizer, get_tokenizer
from speedrun.errors import DataError


def test_byte_tokenizer():
    t = get_tokenizer("bytes")
    assert (t.name, t.vocab_size, t.bos_id) == ("bytes", 257, 256)
    ids = t.encode("héllo")
    assert ids == list("héllo".encode("utf-8"))
    assert 256 not in ids
    assert t.decode([256, *ids, 256]) == "héllo"
    assert t.decode([104, 0xC3]) == "h\ufffd"  # invalid UTF-8 replaced
    with pytest.raises(ValueError, match="300"):
        t.decode([300])


def test_unknown_tokenizer():
    with pytest.raises(DataError, match="bytes, gpt2"):
        get_tokenizer("sentencepiece")


def test_gpt2_offline_from_dir(gpt2_dir, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_OFFLINE", "1")
    t = get_tokenizer("gpt2", tokenizer_dir=gpt2_dir)
    assert (t.name, t.vocab_size, t.bos_id) == ("gpt2", 50257, 50256)
    assert t.encode("Hello world") == [15496, 995]
    assert t.encode("<|endoftext|>") != [50256]  # special text is ordinary text
    assert t.decode([50256, 15496, 995]) == "Hello world"


def test_gpt2_from_env_var(gpt2_dir, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_OFFLINE", "1")
    monkeypatch.setenv("SPEEDRUN_TOKENIZER_DIR", str(gpt2_dir))
    assert get_tokenizer("gpt2").encode("Hello world") == [15496, 995]


def test_gpt2_dir_missing_files(tmp_path):
    (tmp_path / "encoder.json").write_text("{}")
    with pytest.raises(DataError, match="lacks vocab.bpe"):
        get_tokenizer("gpt2", tokenizer_dir=tmp_path)


def test_gpt2_wrong_files(tmp_path):
    (tmp_path / "encoder.json").write_text("{}")
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(DataError, match="not the standard GPT-2"):
        get_tokenizer("gpt2", tokenizer_dir=tmp_path)


def test_gpt2_without_files_fails_fast_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_TOKENIZER_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache
    monkeypatch.setattr(tk, "network_reachable", lambda *a, **k: False)
    t0 = time.monotonic()
    with pytest.raises(DataError, match="tokenizer-dir") as ei:
        get_tokenizer("gpt2")
    assert time.monotonic() - t0 < 2.0
    assert "encoder.json" in str(ei.value)


def test_offline_env_var_forces_no_network(monkeypatch):
    monkeypatch.setenv("SPEEDRUN_OFFLINE", "1")
    assert tk.network_reachable("localhost", 1) is False


def test_tokenizer_for_vocab():
    assert isinstance(tk.tokenizer_for_vocab(200), ByteTokenizer)
    assert tk.tokenizer_for_vocab(70000) is None

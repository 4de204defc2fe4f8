"""Sources: built-in corpus, tokenizing local text, FineWeb download logic, inspection."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from speedrun.data import builtin_corpus as bc
from speedrun.data import sources
from speedrun.data.shards import read_shard, write_shard
from speedrun.data.sources import download_fineweb, inspect_shards, resolve_shards, tokenize_files
from speedrun.errors import DataError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    cache = os.environ.get("SPEEDRUN_CACHE_DIR") or tmp_path_factory.mktemp("cache")
    t0 = time.monotonic()
    train, val = bc.builtin_corpus_shards(cache)
    return train, val, cache, time.monotonic() - t0


def test_builtin_corpus(corpus):
    train, val, cache, seconds = corpus
    assert seconds < 60
    tr, va = read_shard(train[0], vocab_size=257), read_shard(val[0], vocab_size=257)
    assert tr[0] == 256 and va[0] == 256
    assert len(tr) > 1_000_000 and len(va) > 65_536
    assert 0.02 < len(va) / (len(tr) + len(va)) < 0.10
    text = bytes(tr[:20000][tr[:20000] < 256].astype(np.uint8)).decode("utf-8", errors="replace")
    assert text.count(" the ") > 20  # English prose
    t0 = time.monotonic()
    assert bc.builtin_corpus_shards(cache) == (train, val)  # reused, not rebuilt
    assert time.monotonic() - t0 < 5
    assert f"py{os.sys.version_info.major}{os.sys.version_info.minor}-" in str(train[0])


def _fake_stdlib(root: Path, n: int = 120) -> None:
    for i in range(n):
        (root / f"mod{i}.py").write_text(f'"""Module {i} does thing {i}."""\n\ndef f{i}(x, y=1):\n    """Return x."""\n    return x\n')
    (root / "notes.txt").write_text("Some notes.\n\nMore notes.\n")
    (root / "test").mkdir()
    (root / "test" / "skipped.py").write_text('"""Tests are skipped."""\n')


def test_builtin_rebuilds_for_another_stdlib(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    root.mkdir()
    _fake_stdlib(root)
    monkeypatch.setattr(bc, "_stdlib_root", lambda: root)
    tr1, va1 = bc.builtin_corpus_shards(tmp_path / "cache")
    tokens = np.concatenate([read_shard(tr1[0]), read_shard(va1[0])])
    text = bytes(tokens[tokens < 256].astype(np.uint8)).decode()
    assert "def f7(x, y=1):" in text and '"""Return x."""' in text and "Tests are skipped" not in text
    assert bc.builtin_corpus_shards(tmp_path / "cache") == (tr1, va1)
    (root / "mod3.py").write_text('"""Changed."""\n')
    tr2, _ = bc.builtin_corpus_shards(tmp_path / "cache")
    assert tr2[0].parent != tr1[0].parent  # content hash in the folder name
    # deterministic: a fresh build gives identical bytes
    bc.build_builtin_corpus(tmp_path / "again", root)
    assert (tmp_path / "again" / "builtin_train_000000.bin").read_bytes() == tr2[0].read_bytes()


def test_is_val_document_is_order_free():
    ids = [f"doc{i}" for i in range(20000)]
    frac = np.mean([bc.is_val_document(i, 0.05) for i in ids])
    assert 0.04 < frac < 0.06
    assert [bc.is_val_document(i, 0.05) for i in ids[::-1]] == [bc.is_val_document(i, 0.05) for i in ids][::-1]
    assert not any(bc.is_val_document(i, 0.0) for i in ids[:100])


def _make_inputs(root: Path) -> Path:
    d = root / "in"
    (d / "sub").mkdir(parents=True)
    for i in range(30):
        (d / f"t{i:02d}.txt").write_text(f"Document number {i}. " * (i + 1))
    (d / "sub" / "readme.md").write_text("# Title\n\nSome *markdown* text.")
    (d / "bad.txt").write_bytes(b"caf\xe9 latin-1, not UTF-8")
    lines = [json.dumps({"text": f"json line {i} " * 3}) for i in range(200)]
    lines[57] = "{not json"
    lines[120] = json.dumps({"title": "no text"})
    (d / "data.jsonl").write_text("\n".join(lines) + "\n")
    (d / "ignored.csv").write_text("a,b\n")
    return d


def test_tokenize_bytes(tmp_path):
    src = _make_inputs(tmp_path)
    rep = tokenize_files([src], tmp_path / "out", tokenizer="bytes", val_fraction=0.2, progress=False)
    assert rep.train_docs + rep.val_docs == 30 + 1 + 198
    assert rep.val_docs > 10 and rep.train_docs > 100
    assert [p for p, _ in rep.skipped_files] == [str(src / "bad.txt")]
    assert [(line, r.split(" ")[0]) for _, line, r in rep.skipped_lines] == [(58, "not"), (121, "no")]
    tr = read_shard(rep.train_files[0], vocab_size=257)
    assert tr[0] == 256 and (tr == 256).sum() == rep.train_docs and len(tr) == rep.train_tokens
    all_text = bytes(tr[tr < 256].astype(np.uint8)).decode()
    assert "Some *markdown* text." in all_text or "Some *markdown* text." in bytes(
        read_shard(rep.val_files[0])[read_shard(rep.val_files[0]) < 256].astype(np.uint8)).decode()


def test_tokenize_is_independent_of_workers_and_task_size(tmp_path, monkeypatch):
    src = _make_inputs(tmp_path)
    a = tokenize_files([src], tmp_path / "a", tokenizer="bytes", val_fraction=0.2, progress=False)
    monkeypatch.setattr(sources, "_SPLIT_BYTES", 500)  # the jsonl file becomes many tasks
    b = tokenize_files([src], tmp_path / "b", tokenizer="bytes", val_fraction=0.2, workers=2, progress=False)
    assert len(b.skipped_lines) == 2 and [x[1] for x in b.skipped_lines] == [58, 121]  # absolute line numbers
    for fa, fb in zip(a.train_files + a.val_files, b.train_files + b.val_files):
        assert fa.name == fb.name and fa.read_bytes() == fb.read_bytes()


def test_tokenize_strict_names_file_and_line(tmp_path):
    src = _make_inputs(tmp_path)
    (src / "bad.txt").unlink()
    with pytest.raises(DataError, match=r"data\.jsonl: line 58: not valid JSON"):
        tokenize_files([src], tmp_path / "o", tokenizer="bytes", strict=True, progress=False)
    (src / "x.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError, match=r"data\.jsonl: line 58|x\.txt: not valid UTF-8"):
        tokenize_files([src], tmp_path / "o2", tokenizer="bytes", strict=True, progress=False)


def test_tokenize_shard_rollover_keeps_documents_whole(tmp_path):
    src = _make_inputs(tmp_path)
    rep = tokenize_files([src], tmp_path / "o", tokenizer="bytes", val_fraction=0.0, shard_tokens=3000,
                         prefix="tiny", progress=False)
    assert len(rep.train_files) > 3 and rep.val_files == []
    assert [p.name for p in rep.train_files[:2]] == ["tiny_train_000000.bin", "tiny_train_000001.bin"]
    sizes = [len(read_shard(p)) for p in rep.train_files]
    assert sum(sizes) == rep.train_tokens and max(sizes) <= 3000
    for p in rep.train_files:
        assert read_shard(p)[0] == 256  # every shard starts a document
    with pytest.raises(DataError, match="--force"):
        tokenize_files([src], tmp_path / "o", tokenizer="bytes", prefix="tiny", progress=False)
    again = tokenize_files([src], tmp_path / "o", tokenizer="bytes", prefix="tiny", force=True, progress=False)
    assert sorted((tmp_path / "o").glob("tiny_*.bin")) == sorted(again.train_files + again.val_files)


def test_tokenize_gpt2(tmp_path, gpt2_dir):
    (tmp_path / "a.txt").write_text("Hello world")
    rep = tokenize_files([tmp_path / "a.txt"], tmp_path / "o", tokenizer="gpt2", tokenizer_dir=str(gpt2_dir),
                         val_fraction=0.0, progress=False)
    assert read_shard(rep.train_files[0]).tolist() == [50256, 15496, 995]


def test_tokenize_input_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        tokenize_files([tmp_path / "nope"], tmp_path / "o", tokenizer="bytes")
    (tmp_path / "x.pdf").write_bytes(b"%PDF")
    with pytest.raises(DataError, match="unsupported input type"):
        tokenize_files([tmp_path / "x.pdf"], tmp_path / "o", tokenizer="bytes")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt"):
        tokenize_files([tmp_path / "empty"], tmp_path / "o", tokenizer="bytes")


def _fake_hub(calls, corrupt=()):
    def download(*, repo_id, repo_type, filename, local_dir):
        assert repo_id == "kjj0/fineweb10B-gpt2" and repo_type == "dataset"
        calls.append(filename)
        path = Path(local_dir) / filename
        tokens = np.tile([50256, 464, 2068], 100)
        write_shard(path, tokens)
        if filename in corrupt:
            with open(path, "ab") as f:
                f.write(b"xx")
        return str(path)
    return download


def test_fineweb_download_resume_and_verify(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_hub_offline_reason", lambda: None)
    calls: list[str] = []
    out = tmp_path / "fw"
    paths = download_fineweb(2, out, downloader=_fake_hub(calls), log=lambda s: None)
    assert calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert [p.name for p in paths] == calls
    calls.clear()
    # resume: present and valid files are skipped; a damaged one is fetched again
    with open(out / "fineweb_train_000001.bin", "r+b") as f:
        f.truncate(2000)
    download_fineweb(3, out, downloader=_fake_hub(calls), log=lambda s: None)
    assert calls == ["fineweb_train_000001.bin", "fineweb_train_000003.bin"]
    calls.clear()
    download_fineweb(3, out, downloader=_fake_hub(calls), log=lambda s: None)
    assert calls == []


def test_fineweb_bad_download_is_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_hub_offline_reason", lambda: None)
    with pytest.raises(DataError, match="failed verification.*trailing bytes"):
        download_fineweb(1, tmp_path, downloader=_fake_hub([], corrupt={"fineweb_train_000001.bin"}), log=lambda s: None)
    assert not (tmp_path / "fineweb_train_000001.bin").exists()
    assert (tmp_path / "fineweb_val_000000.bin").exists()

    def broken(**kw):
        raise ConnectionError("reset by peer")
    with pytest.raises(DataError, match="reset by peer.*again to resume"):
        download_fineweb(1, tmp_path, downloader=broken, log=lambda s: None)


def test_fineweb_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "network_reachable", lambda *a, **k: False)
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"unreachable.*--data 'DIR/\*_train_\*\.bin'.*data tokenize"):
        download_fineweb(1, tmp_path, downloader=lambda **k: pytest.fail("must not download"), log=lambda s: None)
    assert time.monotonic() - t0 < 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="HF_HUB_OFFLINE"):
        download_fineweb(1, tmp_path, log=lambda s: None)
    with pytest.raises(DataError, match="103"):
        download_fineweb(500, tmp_path)


def test_inspect_and_resolve(tmp_path):
    docs = [[256, *b"first doc here"], [256, *b"ab"], [256, *b"xyz" * 10]]
    a = write_shard(tmp_path / "s_train_000000.bin", [t for d in docs for t in d])
    b = write_shard(tmp_path / "s_train_000001.bin", [256, 1, 2, 3])
    assert resolve_shards(tmp_path) == [a, b] == resolve_shards(str(tmp_path / "s_train_*.bin"))
    assert resolve_shards(a) == [a]
    with pytest.raises(DataError, match="match"):
        resolve_shards(str(tmp_path / "zz_*.bin"))
    st = inspect_shards([a, b])
    assert st["tokens"] == 15 + 3 + 31 + 4 and st["docs"] == 4 and st["max_id"] == 256
    assert st["doc_len"]["max"] == 31 and st["doc_len"]["p50"] == 9.5
    assert st["tokenizer"] == "bytes" and st["sample"] == "first doc here"
    assert "4 documents" in sources.format_inspection(st)


def test_shard_writer_gives_long_documents_their_own_shard(tmp_path):
    w = sources._ShardWriter(tmp_path, "p", "train", shard_tokens=10)
    docs = [np.array([256] + [1] * n, dtype=np.uint16) for n in (3, 25, 2, 2, 2, 30)]
    w.add(np.concatenate(docs), np.array([len(d) for d in docs]))
    w.flush()
    assert [len(read_shard(p)) for p in w.files] == [4, 26, 9, 31]
    assert all(read_shard(p)[0] == 256 for p in w.files) and w.docs == 6 and w.tokens == 70

"""Where shards come from: tokenizing local text, downloading FineWeb, and inspecting shards.

* :func:`tokenize_files` turns ``.txt``/``.md``/``.rst`` files (one document each) and ``.jsonl``
  files (one document per line, its ``text`` field) into shards, in parallel, with a deterministic
  train/val split by a hash of each document's identity.
* :func:`download_fineweb` fetches the upstream GPT-2-tokenized FineWeb shards from the Hugging
  Face Hub (resumable, verified), failing fast when offline.
* :func:`inspect_shards` summarizes shards: tokens, documents, length percentiles, a sample.
* :func:`resolve_shards` turns a file, folder or glob into a sorted list of shard paths.

The built-in corpus lives in :mod:`speedrun.data.builtin_corpus`.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlparse

import numpy as np

from speedrun.data.builtin_corpus import is_val_document
from speedrun.data.shards import MAX_TOKENS, read_header, read_shard, write_shard
from speedrun.data.tokenizer import get_tokenizer, network_reachable, tokenizer_for_vocab
from speedrun.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl",)
_SPLIT_BYTES = 32 << 20  # a .jsonl file is cut into tasks of about this many bytes


def resolve_shards(spec: str | os.PathLike | Iterable[str | os.PathLike], what: str = "shard") -> list[Path]:
    """Shard paths for a file, a folder (its ``*.bin``), a glob, or a list of those; sorted per item."""
    if not isinstance(spec, (str, os.PathLike)):
        out: list[Path] = []
        for item in spec:
            out += resolve_shards(item, what)
        if not out:
            raise DataError(f"no {what} files given")
        return out
    text = os.path.expanduser(os.fspath(spec))
    if not text:
        raise DataError(f"no {what} files given (empty path)")
    p = Path(text)
    if p.is_dir():
        files = sorted(p.glob("*.bin"))
        if not files:
            raise DataError(f"{p}: folder holds no .bin shard files")
        return files
    if glob.has_magic(text):
        files = sorted(Path(f) for f in glob.glob(text))
        if not files:
            raise DataError(f"no {what} files match {text!r}")
        return files
    if not p.exists():
        raise DataError(f"{p}: {what} file does not exist")
    return [p]


# ----------------------------------------------------------------------------------------------
# Tokenizing local text


@dataclass
class TokenizeReport:
    """What :func:`tokenize_files` wrote and skipped."""

    train_files: list[Path] = field(default_factory=list)
    val_files: list[Path] = field(default_factory=list)
    train_tokens: int = 0
    val_tokens: int = 0
    train_docs: int = 0
    val_docs: int = 0
    skipped_files: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    skipped_lines: list[tuple[str, int, str]] = field(default_factory=list)  # (path, line, reason)

    def summary(self) -> str:
        lines = [
            f"train: {self.train_tokens:,} tokens, {self.train_docs:,} documents, {len(self.train_files)} shard(s)",
            f"val:   {self.val_tokens:,} tokens, {self.val_docs:,} documents, {len(self.val_files)} shard(s)",
        ]
        if self.skipped_files or self.skipped_lines:
            lines.append(
                f"skipped {len(self.skipped_files)} file(s) and {len(self.skipped_lines)} jsonl line(s) "
                f"(use --strict to stop at the first one):"
            )
            for path, reason in self.skipped_files[:5]:
                lines.append(f"  {path}: {reason}")
            for path, line, reason in self.skipped_lines[:5]:
                lines.append(f"  {path}:{line}: {reason}")
            more = len(self.skipped_files) + len(self.skipped_lines) - min(5, len(self.skipped_files)) - min(
                5, len(self.skipped_lines))
            if more > 0:
                lines.append(f"  ... and {more} more")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Task:
    path: str
    identity: str
    kind: str  # "text" | "jsonl"
    start: int = 0  # byte range, for jsonl pieces
    end: int = -1


def _discover(inputs: Iterable[str | os.PathLike]) -> list[tuple[Path, str]]:
    """(file, identity) for every input file, in a fixed order; identity is stable across machines."""
    found: list[tuple[Path, str]] = []
    for item in inputs:
        p = Path(os.path.expanduser(os.fspath(item)))
        if p.is_dir():
            files = sorted(
                (f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES),
                key=lambda f: f.relative_to(p).as_posix(),
            )
            found += [(f, f"{p.resolve().name}/{f.relative_to(p).as_posix()}") for f in files]
        elif p.is_file():
            if p.suffix.lower() not in TEXT_SUFFIXES + JSONL_SUFFIXES:
                raise DataError(f"{p}: unsupported input type {p.suffix!r}; use .txt, .md, .rst or .jsonl (a 'text' field per line)")
            found.append((p, p.name))
        elif p.exists():
            raise DataError(f"{p}: not a file or folder")
        else:
            raise DataError(f"{p}: input does not exist")
    return found


def _tasks(files: list[tuple[Path, str]]) -> list[_Task]:
    tasks = []
    for path, ident in files:
        if path.suffix.lower() not in JSONL_SUFFIXES:
            tasks.append(_Task(str(path), ident, "text"))
            continue
        try:
            size = path.stat().st_size
            cuts = [0]
            with open(path, "rb") as f:
                while cuts[-1] + _SPLIT_BYTES < size:
                    f.seek(cuts[-1] + _SPLIT_BYTES)
                    f.readline()  # move to the next line start
                    if f.tell() >= size:
                        break
                    cuts.append(f.tell())
            cuts.append(size)
        except OSError:  # reported by the worker, which opens it again
            cuts = [0, -1]
        tasks += [_Task(str(path), ident, "jsonl", a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    return tasks


_worker_state: dict = {}


def _init_worker(tokenizer: str, tokenizer_dir: str | None, val_fraction: float, strict: bool) -> None:
    _worker_state.update(tok=get_tokenizer(tokenizer, tokenizer_dir), val_fraction=val_fraction, strict=strict)


def _encode_doc(text: str) -> np.ndarray:
    tok = _worker_state["tok"]
    body = np.asarray(tok.encode(text), dtype=np.uint16)
    out = np.empty(len(body) + 1, dtype=np.uint16)
    out[0] = tok.bos_id
    out[1:] = body
    return out


def _run_task(task: _Task) -> dict:
    """Tokenize one task.  Returns per split the concatenated tokens and document lengths, the
    errors as (line relative to the task or 0, reason), the lines read, and the bytes covered."""
    docs = {"train": [], "val": []}
    errors: list[tuple[int, str]] = []
    strict, vf = _worker_state["strict"], _worker_state["val_fraction"]
    lines = 0
    try:
        with open(task.path, "rb") as f:
            if task.kind == "text":
                raw = f.read()
                nbytes = len(raw)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    errors.append((0, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"))
                    text = ""
                if text:
                    docs["val" if is_val_document(task.identity, vf) else "train"].append(_encode_doc(text))
            else:
                f.seek(task.start)
                pos = task.start
                end = task.end if task.end >= 0 else float("inf")
                while pos < end and not (strict and errors):
                    line = f.readline()
                    if not line:
                        break
                    lines += 1
                    offset, pos = pos, pos + len(line)
                    if not line.strip():
                        continue
                    reason = None
                    try:
                        obj = json.loads(line.decode("utf-8"))
                        text = obj.get("text") if isinstance(obj, dict) else None
                        if not isinstance(text, str):
                            reason = "no string 'text' field"
                    except UnicodeDecodeError as e:
                        reason = f"not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
                    except json.JSONDecodeError as e:
                        reason = f"not valid JSON ({e.msg})"
                    if reason:
                        errors.append((lines, reason))
                    elif text:
                        split = "val" if is_val_document(f"{task.identity}@{offset}", vf) else "train"
                        docs[split].append(_encode_doc(text))
                nbytes = pos - task.start
    except OSError as e:
        errors.append((0, f"cannot read ({e.strerror or e})"))
        nbytes = 0
    out = {"errors": errors, "lines": lines, "bytes": nbytes}
    for split, items in docs.items():
        out[split] = np.concatenate(items) if items else np.zeros(0, np.uint16)
        out[split + "_lens"] = np.array([len(d) for d in items], dtype=np.int64)
    return out


class _ShardWriter:
    """Writes ``{prefix}_{split}_{index:06d}.bin`` shards of at most ``shard_tokens`` tokens that
    end at document boundaries (a single longer document gets a shard of its own)."""

    def __init__(self, out_dir: Path, prefix: str, split: str, shard_tokens: int):
        self.out_dir, self.prefix, self.split, self.shard_tokens = out_dir, prefix, split, shard_tokens
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.files: list[Path] = []
        self.tokens = 0
        self.docs = 0

    def add(self, tokens: np.ndarray, lens: np.ndarray) -> None:
        if not len(lens):
            return
        self.docs += len(lens)
        ends = np.cumsum(lens)
        i, n = 0, len(lens)
        while i < n:
            base = int(ends[i - 1]) if i else 0
            j = int(np.searchsorted(ends, base + self.shard_tokens - self.size, side="right"))
            if j == i:
                if self.size:
                    self.flush()
                    continue
                j = i + 1
            self.parts.append(tokens[base: int(ends[j - 1])])
            self.size += int(ends[j - 1]) - base
            i = j
            if self.size >= self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.size:
            return
        path = self.out_dir / f"{self.prefix}_{self.split}_{len(self.files):06d}.bin"
        write_shard(path, np.concatenate(self.parts))
        self.files.append(path)
        self.tokens += self.size
        self.parts, self.size = [], 0


def tokenize_files(
    inputs: Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    tokenizer: str = "gpt2",
    tokenizer_dir: str | None = None,
    val_fraction: float = 0.01,
    workers: int = 1,
    strict: bool = False,
    shard_tokens: int = 100_000_000,
    prefix: str = "data",
    force: bool = False,
    progress: bool = True,
) -> TokenizeReport:
    """Tokenize text/markdown/jsonl files and folders into train/val shards under ``out_dir``.

    Each text file is one document, each non-empty ``.jsonl`` line is one (its ``text`` field);
    every document gets BOS prepended.  A document goes to validation when a hash of its identity
    (folder name + relative path, plus the byte offset of a jsonl line) falls below
    ``val_fraction``, so the output is the same for any ``workers`` and any processing order.
    Unreadable or non-UTF-8 input is skipped and reported, or with ``strict`` raises a DataError
    naming the file (and line).  Existing ``{prefix}_{train,val}_*.bin`` in ``out_dir`` are an error
    unless ``force`` (then they are deleted first).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val fraction must lie in [0, 1), got {val_fraction}")
    if not 1 <= shard_tokens <= MAX_TOKENS:
        raise DataError(f"shard size must lie in [1, {MAX_TOKENS:,}] tokens, got {shard_tokens:,}")
    if not prefix or "/" in prefix or os.sep in prefix:
        raise DataError(f"prefix must be a plain file-name part, got {prefix!r}")
    tok = get_tokenizer(tokenizer, tokenizer_dir)  # fail early (and fast offline) in this process
    files = _discover(inputs)
    if not files:
        raise DataError("no .txt, .md, .rst or .jsonl files found in the inputs")
    out = Path(out_dir).expanduser()
    stale = sorted(out.glob(f"{prefix}_train_*.bin")) + sorted(out.glob(f"{prefix}_val_*.bin"))
    if stale:
        if not force:
            raise DataError(f"{out} already holds {len(stale)} '{prefix}' shard(s) ({stale[0].name}, ...); "
                            f"use --force to replace them or pick another --prefix/--out")
        for p in stale:
            p.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create output folder {out} ({e.strerror or e})") from None

    tasks = _tasks(files)
    total_bytes = sum(max(t.end, 0) - t.start if t.kind == "jsonl" else _size(t.path) for t in tasks)
    writers = {s: _ShardWriter(out, prefix, s, shard_tokens) for s in ("train", "val")}
    report = TokenizeReport()
    line_base: dict[str, int] = {}  # lines seen so far per jsonl file (tasks of a file come in order)
    init = (tok.name, tokenizer_dir, val_fraction, strict)
    workers = max(1, min(int(workers), len(tasks)))
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, init)
        results = pool.imap(_run_task, tasks, chunksize=1)
    else:
        _init_worker(*init)
        results = map(_run_task, tasks)
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=None if progress else True, leave=False)
    try:
        for task, res in zip(tasks, results):
            base = line_base.get(task.path, 0)
            line_base[task.path] = base + res["lines"]
            for line, reason in res["errors"]:
                if strict:
                    where = f"{task.path}: line {base + line}" if line else task.path
                    raise DataError(f"{where}: {reason}")
                if line:
                    report.skipped_lines.append((task.path, base + line, reason))
                else:
                    report.skipped_files.append((task.path, reason))
            for split, w in writers.items():
                w.add(res[split], res[split + "_lens"])
            bar.update(res["bytes"])
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    for w in writers.values():
        w.flush()
    report.train_files, report.val_files = writers["train"].files, writers["val"].files
    report.train_tokens, report.val_tokens = writers["train"].tokens, writers["val"].tokens
    report.train_docs, report.val_docs = writers["train"].docs, writers["val"].docs
    if not report.train_docs and not report.val_docs:
        raise DataError("the inputs held no readable documents; nothing written\n" + report.summary())
    return report


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


# ----------------------------------------------------------------------------------------------
# FineWeb download

FINEWEB_REPO = "kjj0/fineweb10B-gpt2"
FINEWEB_TRAIN_SHARDS = 103
GPT2_VOCAB = 50257


def fineweb_filenames(train_shards: int) -> list[str]:
    """The validation shard, then training shards 1..N (upstream names)."""
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, train_shards + 1)]


def _hub_offline_reason() -> str | None:
    """Why the Hub cannot be reached, or None if a quick connect works."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SPEEDRUN_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    host = urlparse(os.environ.get("HF_ENDPOINT", "") or "https://huggingface.co").hostname or "huggingface.co"
    if not network_reachable(host, 443, timeout=3.0):
        return f"{host}:443 is unreachable (no network?)"
    return None


def _valid(path: Path) -> bool:
    try:
        read_shard(path, vocab_size=GPT2_VOCAB)
        return True
    except DataError:
        return False


def download_fineweb(
    train_shards: int,
    out_dir: str | os.PathLike = "data/fineweb10B",
    *,
    downloader: Callable[..., str] | None = None,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Fetch ``fineweb_val_000000.bin`` and ``fineweb_train_000001..N.bin`` into ``out_dir``.

    Files already present and valid are kept (so an interrupted download resumes; the Hub client
    also resumes partial files).  Every downloaded file is verified with the shard reader (header,
    size, ids < 50257).  Offline, raises a DataError at once saying how to use local shards.
    ``downloader`` replaces ``huggingface_hub.hf_hub_download`` (tests).  Returns all paths.
    """
    if not 0 <= train_shards <= FINEWEB_TRAIN_SHARDS:
        raise DataError(f"--train-shards must lie in [0, {FINEWEB_TRAIN_SHARDS}] ({FINEWEB_REPO} has "
                        f"{FINEWEB_TRAIN_SHARDS} training shards of 100M tokens), got {train_shards}")
    out = Path(out_dir).expanduser()
    names = fineweb_filenames(train_shards)
    paths = [out / n for n in names]
    missing = [p for p in paths if not (p.exists() and _valid(p))]
    if len(missing) < len(paths):
        log(f"{len(paths) - len(missing)} of {len(paths)} shard(s) already present and valid in {out}")
    if not missing:
        return paths
    reason = _hub_offline_reason()
    if reason is not None:
        raise DataError(
            f"cannot download FineWeb: {reason}. Use local shards instead: "
            f"speedrun train --data 'DIR/*_train_*.bin' --val-data 'DIR/*_val_*.bin', "
            f"or make shards from local text with: speedrun data tokenize TEXT_DIR --out DIR"
        )
    if downloader is None:
        try:
            from huggingface_hub import hf_hub_download as downloader
        except ImportError:
            raise DataError("huggingface_hub is not installed: pip install huggingface_hub") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create {out} ({e.strerror or e})") from None
    for i, p in enumerate(missing):
        log(f"[{i + 1}/{len(missing)}] downloading {p.name} from {FINEWEB_REPO}")
        if p.exists():
            p.unlink()  # present but invalid: fetch again
        t0 = time.monotonic()
        try:
            got = Path(downloader(repo_id=FINEWEB_REPO, repo_type="dataset", filename=p.name, local_dir=str(out)))
        except Exception as e:  # network, auth, missing file: one line, re-running resumes
            raise DataError(f"downloading {p.name} failed ({type(e).__name__}: {e}); run the command again to resume") from None
        if got.resolve() != p.resolve():
            raise DataError(f"{p.name} was saved at {got}, expected {p}")
        try:
            n = read_header(p)
            read_shard(p, vocab_size=GPT2_VOCAB)
        except DataError as e:
            p.unlink(missing_ok=True)
            raise DataError(f"downloaded file failed verification and was deleted: {e}; run the command again") from None
        log(f"    {n:,} tokens in {time.monotonic() - t0:.1f} s, verified")
    return paths


# ----------------------------------------------------------------------------------------------
# Inspecting shards


def inspect_shards(paths: list[Path], *, bos_id: int | None = None, tokenizer: str | None = None,
                   tokenizer_dir: str | None = None, sample_chars: int = 300) -> dict:
    """Statistics of shards: per-file and total tokens and documents, document-length
    percentiles (tokens; a document runs from a BOS to the next BOS or the shard end), the
    largest token id, and the first document decoded (``sample``; None without a tokenizer)."""
    files, lens_all = [], []
    max_id, first_doc = -1, None
    for p in paths:
        toks = read_shard(p)
        m = int(toks.max()) if len(toks) else -1
        files.append({"path": str(p), "tokens": int(len(toks)), "max_id": m})
        max_id = max(max_id, m)
    bos = bos_id if bos_id is not None else (256 if max_id <= 256 else 50256)
    for info in files:
        toks = read_shard(info["path"])
        starts = np.flatnonzero(toks == bos)
        info["docs"] = int(len(starts))
        info["before_first_bos"] = int(starts[0]) if len(starts) else int(len(toks))
        if len(starts):
            lens_all.append(np.diff(np.append(starts, len(toks))))
            if first_doc is None:
                end = int(starts[1]) if len(starts) > 1 else len(toks)
                first_doc = np.asarray(toks[int(starts[0]): min(end, int(starts[0]) + 4 * sample_chars)])
    lens = np.concatenate(lens_all) if lens_all else np.zeros(0, np.int64)
    stats = {
        "files": files,
        "tokens": sum(f["tokens"] for f in files),
        "docs": int(len(lens)),
        "bos_id": bos,
        "max_id": max_id,
        "doc_len": {k: float(np.percentile(lens, q)) for k, q in (("p10", 10), ("p50", 50), ("p90", 90), ("p99", 99))}
        if len(lens) else {},
        "sample": None,
        "tokenizer": None,
        "first_ids": None if first_doc is None else [int(x) for x in first_doc[:32]],
    }
    if len(lens):
        stats["doc_len"]["max"] = float(lens.max())
        stats["doc_len"]["mean"] = float(lens.mean())
    tok = get_tokenizer(tokenizer, tokenizer_dir) if tokenizer else tokenizer_for_vocab(max_id, tokenizer_dir)
    if tok is not None and first_doc is not None:
        if max_id >= tok.vocab_size:
            raise DataError(f"token id {max_id} >= {tok.name} vocab size {tok.vocab_size}: these shards were not made with {tok.name}")
        stats["tokenizer"] = tok.name
        stats["sample"] = tok.decode(first_doc.tolist())[:sample_chars]
    return stats


def format_inspection(stats: dict) -> str:
    """Human-readable lines for :func:`inspect_shards`'s result."""
    out = []
    for f in stats["files"]:
        extra = f", {f['before_first_bos']:,} tokens before the first BOS" if f["before_first_bos"] else ""
        out.append(f"{f['path']}: {f['tokens']:,} tokens, {f['docs']:,} documents, max id {f['max_id']}{extra}")
    if len(stats["files"]) > 1:
        out.append(f"total: {stats['tokens']:,} tokens, {stats['docs']:,} documents in {len(stats['files'])} files")
    out.append(f"BOS id {stats['bos_id']}, largest token id {stats['max_id']}")
    d = stats["doc_len"]
    if d:
        out.append("document length (tokens): " + ", ".join(
            f"{k} {v:,.0f}" if k != "mean" else f"{k} {v:,.1f}" for k, v in d.items()))
    else:
        out.append("no documents (no BOS token found)")
    if stats["sample"] is not None:
        out.append(f"first document ({stats['tokenizer']}), first {len(stats['sample'])} characters:")
        out.append("  " + stats["sample"].replace("\n", "\n  "))
    elif stats["first_ids"] is not None:
        out.append("first document token ids (no tokenizer available; pass --tokenizer-dir for GPT-2): "
                   + " ".join(map(str, stats["first_ids"])))
    return "\n".join(out)


"""The built-in offline corpus: English text from the installed Python standard library.

Every machine that runs ``speedrun`` has a Python standard library, and it is full of prose:
module, class and function docstrings, the language reference topics of ``pydoc_data.topics``,
and a few ``.txt``/``.rst`` files.  :func:`builtin_corpus_shards` turns that into byte-level
shards (vocab 257, BOS 256) once and caches them:

* documents of a few hundred bytes to a few KB, each starting with BOS (256): a module's
  docstring, and each documented ``class``/``def`` as its signature plus docstring (headed by the
  module name and enclosing class lines; no code bodies); the language reference topics of
  ``pydoc_data.topics`` and the ``.txt``/``.rst`` files split at blank lines into ~2 KB pieces;
* train/val split by a hash of the source's identity (its path relative to the stdlib, plus
  the topic name), about 5 % validation, independent of walk order; a source's documents all go
  to the same side so validation text is unseen;
* cached under ``<cache>/builtin/py<major><minor>-<hash>/`` where the hash covers the source
  files' bytes and this builder's version, so another stdlib rebuilds and the same one reuses.

CPython 3.11 gives about 2.6 M training and 0.15 M validation tokens (bytes) in ~8 s on one core.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np

from speedrun.data.shards import read_header, write_shard
from speedrun.data.tokenizer import BYTE_BOS
from speedrun.errors import DataError

log = logging.getLogger(__name__)

BUILDER_VERSION = 1  # bump when the document text changes
VAL_FRACTION = 0.05
_DOC_BYTES = 2000  # long prose is split into documents of about this many characters
ENV_CACHE_DIR = "SPEEDRUN_CACHE_DIR"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib-dynload"}
_TEXT_SUFFIXES = (".txt", ".rst")


def default_cache_dir() -> Path:
    """``$SPEEDRUN_CACHE_DIR`` if set, else ``~/.cache/speedrun``."""
    env = os.environ.get(ENV_CACHE_DIR, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "speedrun"


def is_val_document(identity: str, val_fraction: float) -> bool:
    """Deterministic split: True for about ``val_fraction`` of identities (by SHA-1, not order)."""
    if val_fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha1(identity.encode("utf-8")).digest()[:8], "little")
    return h < val_fraction * 2.0**64


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[Path]:
    """The stdlib files used, in a fixed order (sorted relative paths)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py") or (name.endswith(_TEXT_SUFFIXES) and "Grammar" not in name):
                out.append(Path(dirpath) / name)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _docstring_block(doc: str, indent: str) -> list[str]:
    doc = doc.replace('"""', '\\"\\"\\"')
    lines = doc.split("\n")
    if len(lines) == 1:
        return [f'{indent}"""{doc}"""']
    return [f'{indent}"""{lines[0]}', *[(indent + ln) if ln else "" for ln in lines[1:]], f'{indent}"""']


def _definitions(body: list[ast.stmt], context: list[str], indent: str) -> list[list[str]]:
    """One block of lines per documented ``def``/``class`` (recursing into classes); each block
    starts with its enclosing ``class`` lines so it reads on its own."""
    out: list[list[str]] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            try:
                args = ast.unparse(node.args)
            except Exception:  # unparse of odd defaults; the name alone still reads fine
                args = "..."
            out.append([*context, f"{indent}{kw} {node.name}({args}):", *_docstring_block(doc, indent + "    ")])
        elif isinstance(node, ast.ClassDef):
            try:
                bases = ", ".join(ast.unparse(b) for b in node.bases)
            except Exception:
                bases = ""
            head = f"{indent}class {node.name}({bases}):" if bases else f"{indent}class {node.name}:"
            doc = ast.get_docstring(node)
            if doc:
                out.append([*context, head, *_docstring_block(doc, indent + "    ")])
            out += _definitions(node.body, [*context, head], indent + "    ")
    return out


def _paragraph_groups(text: str, target: int = _DOC_BYTES) -> list[str]:
    """Split long prose at blank lines into pieces of about ``target`` characters."""
    groups, cur, size = [], [], 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        if cur and size + len(para) > target:
            groups.append("\n\n".join(cur) + "\n")
            cur, size = [], 0
        cur.append(para)
        size += len(para) + 2
    if cur:
        groups.append("\n\n".join(cur) + "\n")
    return groups


def _sources(root: Path, files: list[Path]) -> list[tuple[str, list[str]]]:
    """(identity, documents) per source, in a fixed order.  A source is a module, a text file or a
    pydoc topic; the train/val split is decided per source so validation text is unseen."""
    sources: list[tuple[str, list[str]]] = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if path.suffix in _TEXT_SUFFIXES:
            sources.append((rel, _paragraph_groups(raw.decode("utf-8", errors="replace"))))
            continue
        try:
            tree = ast.parse(raw, filename=rel)
        except (SyntaxError, ValueError):
            continue  # e.g. lib2to3 test fixtures written in Python 2
        if rel == "pydoc_data/topics.py":
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                    for k, v in zip(node.value.keys, node.value.values):
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                            sources.append((f"{rel}#{k.value}", _paragraph_groups(v.value)))
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        header = f"# {module}"
        docs = []
        doc = ast.get_docstring(tree)
        if doc:
            docs.append("\n".join([header, "", *_docstring_block(doc, "")]) + "\n")
        for block in _definitions(tree.body, [], ""):
            docs.append("\n".join([header, "", *block]) + "\n")
        sources.append((rel, docs))
    return [(ident, docs) for ident, docs in sources if docs]


def _content_hash(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256(f"builder={BUILDER_VERSION} val={VAL_FRACTION}\n".encode())
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(b"<unreadable>")
        h.update(b"\0")
    return h.hexdigest()[:16]


def _encode(docs: list[str]) -> np.ndarray:
    parts = []
    bos = np.array([BYTE_BOS], dtype=np.uint16)
    for text in docs:
        parts.append(bos)
        parts.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def build_builtin_corpus(out_dir: str | os.PathLike, root: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Tokenize the stdlib text under ``root`` (default: this Python's stdlib) into
    ``out_dir/builtin_{train,val}_000000.bin``; returns (train, val).  No caching here."""
    root = Path(root) if root is not None else _stdlib_root()
    sources = _sources(root, _source_files(root))
    train = [d for ident, docs in sources if not is_val_document(ident, VAL_FRACTION) for d in docs]
    val = [d for ident, docs in sources if is_val_document(ident, VAL_FRACTION) for d in docs]
    if not train or not val:
        raise DataError(f"{root}: the Python standard library yielded too little text for the built-in corpus")
    out_dir = Path(out_dir)
    tr = write_shard(out_dir / "builtin_train_000000.bin", _encode(train))
    va = write_shard(out_dir / "builtin_val_000000.bin", _encode(val))
    return tr, va


def builtin_corpus_shards(cache_dir: str | os.PathLike | None = None) -> tuple[list[Path], list[Path]]:
    """Return ([train shard], [val shard]) of the built-in byte-level corpus, building it on first use.

    ``cache_dir`` defaults to :func:`default_cache_dir`.  The shards hold byte tokens (vocab 257,
    BOS 256).  Building takes ~10 s on one core; later calls only hash the sources (~0.1 s).
    Files are written under temporary names and renamed, so concurrent builders are safe.
    """
    root = _stdlib_root()
    if not root.is_dir():
        raise DataError(f"the Python standard library folder {root} is missing; use shards instead (data.source=shards)")
    files = _source_files(root)
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{_content_hash(root, files)}"
    base = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    out = base / "builtin" / tag
    train, val = out / "builtin_train_000000.bin", out / "builtin_val_000000.bin"
    try:
        read_header(train)
        read_header(val)
        return [train], [val]
    except DataError:
        pass  # not built yet, or a damaged cache: rebuild
    log.info("building the built-in corpus from %s into %s", root, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the corpus cache folder {out} ({e.strerror or e}); set ${ENV_CACHE_DIR}") from None
    build_builtin_corpus(out, root)
    return [train], [val]

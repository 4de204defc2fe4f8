"""Carry a torch.compile cache (Inductor's cache folder, its Triton kernels included) from one GPU
machine to the next, so a later session's run loads its compiled kernels instead of compiling them
again (most of an upstream run's time on the machine is its compile).  Inductor keys every entry by the
graph, torch, Triton and the device, so an entry that does not fit is a miss, never a wrong kernel.

    python3 tools/compile_cache.py restore ARCHIVE DIR     unpack ARCHIVE (.tar.gz) into DIR, if it exists
    python3 tools/compile_cache.py save DIR ARCHIVE [--max-mib 15]
        pack DIR into ARCHIVE when the packed size is at most --max-mib (one file the device tool
        brings back is at most 16 MiB); either way print both sizes

Point the run at DIR with ``TORCHINDUCTOR_CACHE_DIR=DIR``.  Here, keep a saved archive under
``.carry/compile_cache/`` (ignored; it counts towards the 64 MiB a device call carries).
Python's ``tarfile`` does the work, gzip at its fastest level: packing must not eat the device
call that waits for it, and compiled kernels shrink little at any level.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

MIB = 2**20


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def restore(archive: Path, folder: Path) -> str:
    """Unpack ``archive`` into ``folder``; a missing archive is a cold compile, not an error."""
    if not archive.is_file() or archive.stat().st_size == 0:
        return f"compile cache: none at {archive} (a cold compile)"
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            folder.mkdir(parents=True, exist_ok=True)
            tar.extractall(folder, filter="data")  # no paths outside the folder, no devices
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SystemExit(f"compile cache: {archive} does not unpack: {e}")
    files = sum(m.isfile() for m in members)
    return f"compile cache: {files} files from {archive} into {folder}"


def save(folder: Path, archive: Path, max_mib: int) -> str:
    """Pack ``folder`` into ``archive`` when it packs into ``max_mib``; say the sizes either way."""
    if not folder.is_dir():
        raise SystemExit(f"compile cache: no folder {folder} (nothing compiled there?)")
    raw = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    fd, tmp = tempfile.mkstemp(suffix=".tar.gz")
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=1) as tar:
            tar.add(folder, arcname=".")
        packed = os.path.getsize(tmp)
        if packed > max_mib * MIB:
            return f"compile cache: {folder} is {_mib(raw)}, {_mib(packed)} packed: over {max_mib} MiB, not saved"
        archive.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(tmp, archive)
        return f"compile cache: {folder} is {_mib(raw)}, saved as {archive} ({_mib(packed)})"
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restore", help="unpack ARCHIVE into DIR (nothing to do when ARCHIVE is absent)")
    r.add_argument("archive", type=Path)
    r.add_argument("folder", type=Path)
    s = sub.add_parser("save", help="pack DIR into ARCHIVE if it fits --max-mib")
    s.add_argument("folder", type=Path)
    s.add_argument("archive", type=Path)
    s.add_argument("--max-mib", type=int, default=15)
    args = ap.parse_args(argv)
    if args.cmd == "restore":
        print(restore(args.archive, args.folder))
    else:
        if args.max_mib < 1:
            ap.error(f"--max-mib must be >= 1, got {args.max_mib}")
        print(save(args.folder, args.archive, args.max_mib))
    return 0


if __name__ == "__main__":
    sys.exit(main())

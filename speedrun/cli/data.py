"""``speedrun data``: make, fetch and inspect token shards."""

from __future__ import annotations

import argparse

_EPILOG = """\
examples:
  speedrun data tokenize notes/ books.jsonl --out data/mine --tokenizer gpt2 --workers 8
      every .txt/.md/.rst file is one document, every .jsonl line one (its "text" field);
      writes data/mine/data_train_000000.bin, data/mine/data_val_000000.bin, ...
  speedrun data fineweb --train-shards 9
      the upstream GPT-2 FineWeb shards (900M training tokens) into data/fineweb10B
  speedrun data inspect 'data/fineweb10B/fineweb_*.bin'
      tokens, documents, document lengths and a decoded sample

Shards: a 1024-byte header (256 int32: 20240520, 1, token count) then uint16 tokens; every
document starts with BOS (50256 for GPT-2, 256 for the byte tokenizer).  Train on them with
  speedrun train --data 'data/mine/data_train_*.bin' --val-data 'data/mine/data_val_*.bin'
"""

_TOKENIZE_EPILOG = """\
examples:
  speedrun data tokenize docs/ --out data/docs
  speedrun data tokenize corpus.jsonl --out data/c --workers 8 --val-fraction 0.005 --prefix corpus
  speedrun data tokenize notes/ --out data/notes --tokenizer bytes
  SPEEDRUN_TOKENIZER_DIR=/path/to/gpt2 speedrun data tokenize docs/ --out data/docs   (offline GPT-2)

The train/val split is decided per document by a hash of its identity (folder name + path, plus
the byte offset of a jsonl line), so the output does not depend on --workers.  Unreadable and
non-UTF-8 files (and bad jsonl lines) are skipped and counted; --strict stops at the first one.
"""

_FINEWEB_EPILOG = """\
examples:
  speedrun data fineweb --train-shards 9                 900M tokens + the 100M-token val shard
  speedrun data fineweb --train-shards 103 --out /data/fw   all of FineWeb-10B

Each shard is 100M tokens (~200 MB).  Present and valid files are skipped, so re-running resumes.
Without network (or with HF_HUB_OFFLINE=1) this fails at once; use local shards instead:
  speedrun train --data 'DIR/*_train_*.bin' --val-data 'DIR/*_val_*.bin'
or make shards from local text with 'speedrun data tokenize'.
"""

_INSPECT_EPILOG = """\
examples:
  speedrun data inspect data/fineweb10B/fineweb_val_000000.bin
  speedrun data inspect data/fineweb10B                  every .bin in the folder
  speedrun data inspect 'data/mine/*_train_*.bin' --tokenizer-dir /path/to/gpt2
"""


def _tokens(text: str) -> int:
    return int(text.replace("_", "").replace(",", ""))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data", help="make, fetch and inspect token shards",
        description="Make token shards from local text, download the FineWeb shards, or inspect shards.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    t = dsub.add_parser(
        "tokenize", help="tokenize .txt/.md/.rst/.jsonl files or folders into shards",
        description="Tokenize text into train/val shards (BOS before every document).",
        epilog=_TOKENIZE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders (searched recursively)")
    t.add_argument("--out", required=True, metavar="DIR", help="output folder for the shards")
    t.add_argument("--tokenizer", choices=("gpt2", "bytes"), default="gpt2", help="default: gpt2")
    t.add_argument("--tokenizer-dir", metavar="D", help="folder with GPT-2 encoder.json and vocab.bpe (offline)")
    t.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation (default 0.01)")
    t.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizer processes (default 1)")
    t.add_argument("--strict", action="store_true", help="stop at the first unreadable file or bad line")
    t.add_argument("--shard-tokens", type=_tokens, default=100_000_000, metavar="N",
                   help="tokens per shard (default 100_000_000; shards end at document boundaries)")
    t.add_argument("--prefix", default="data", help="shard name prefix: PREFIX_train_000000.bin (default data)")
    t.add_argument("--force", action="store_true", help="replace existing PREFIX_* shards in --out")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_tokenize)

    f = dsub.add_parser(
        "fineweb", help="download the GPT-2 tokenized FineWeb-10B shards (needs network)",
        description="Download fineweb_val_000000.bin and fineweb_train_000001..N.bin from the Hugging Face "
        "dataset kjj0/fineweb10B-gpt2, resumable and verified.",
        epilog=_FINEWEB_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument("--train-shards", type=int, required=True, metavar="N", help="training shards to fetch (1..103)")
    f.add_argument("--out", default="data/fineweb10B", metavar="DIR", help="default: data/fineweb10B")
    f.set_defaults(func=_fineweb)

    i = dsub.add_parser(
        "inspect", help="tokens, documents, document lengths and a sample of shards",
        description="Summarize a shard, a folder of shards or a glob.",
        epilog=_INSPECT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("path", metavar="PATH", help="shard file, folder or glob (quote globs)")
    i.add_argument("--tokenizer", choices=("gpt2", "bytes"),
                   help="decode the sample with this tokenizer (default: bytes if ids <= 256, else gpt2 if local files exist)")
    i.add_argument("--tokenizer-dir", metavar="D", help="folder with GPT-2 encoder.json and vocab.bpe")
    i.add_argument("--bos-id", type=int, help="BOS token (default: 256 if ids <= 256, else 50256)")
    i.set_defaults(func=_inspect)


def _tokenize(args: argparse.Namespace) -> int:
    from speedrun.data.sources import tokenize_files

    report = tokenize_files(
        args.inputs, args.out, tokenizer=args.tokenizer, tokenizer_dir=args.tokenizer_dir,
        val_fraction=args.val_fraction, workers=args.workers, strict=args.strict,
        shard_tokens=args.shard_tokens, prefix=args.prefix, force=args.force, progress=not args.quiet,
    )
    print(report.summary())
    for path in report.train_files + report.val_files:
        print(f"  wrote {path}")
    return 0


def _fineweb(args: argparse.Namespace) -> int:
    from speedrun.data.sources import download_fineweb

    paths = download_fineweb(args.train_shards, args.out)
    print(f"{len(paths)} FineWeb shard(s) ready in {args.out}; train with:")
    print(f"  speedrun train --preset small --data '{args.out}/fineweb_train_*.bin' "
          f"--val-data '{args.out}/fineweb_val_*.bin'")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from speedrun.data.sources import format_inspection, inspect_shards, resolve_shards

    stats = inspect_shards(resolve_shards(args.path), bos_id=args.bos_id, tokenizer=args.tokenizer,
                           tokenizer_dir=args.tokenizer_dir)
    print(format_inspection(stats))
    return 0

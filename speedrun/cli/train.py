"""``speedrun train``: run a preset (with overrides) or resume a run folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_EPILOG = """\
examples:
  speedrun train
      the embedded default: a small GPT on the Python standard library's own text (byte-level,
      no download, no GPU), a few minutes on 2 CPU cores; prints progress, validation loss and a
      generated sample, and writes a run folder under ./runs
  speedrun train --steps 50 --set train.val_every=25
  speedrun train --data 'data/fineweb10B/fineweb_train_*.bin' --val-data 'data/fineweb10B/fineweb_val_*.bin'
      the same model on GPT-2 tokenized shards (vocabulary switches to GPT-2's 50257)
  speedrun train --preset small --data ... --val-data ...          a 124M-class model on one GPU
  torchrun --standalone --nproc_per_node=8 -m speedrun train --preset small ...
  speedrun train --resume runs/tiny-20261202-101500-ab12cd   continue a stopped run from its checkpoint
      Ctrl-C (SIGINT) or SIGTERM writes a checkpoint and stops; checkpoints are also written every
      10 minutes (train.checkpoint_every_s), at stage boundaries and every train.checkpoint_every steps
  speedrun train --resume runs/tiny-20261202-101500-ab12cd --steps 500
      train a finished 250-step run on to 500 steps, in a new run folder (the finished one is kept as is)

settings: every field of the run configuration can be set with --set section.field=value, e.g.
  --set model.num_layers=6 --set train.lr=2e-3 --set train.checkpoint_every=100
(sections: model, data, train; 'speedrun train --show-config' prints them all).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model (default: the tiny preset on built-in text, CPU-friendly)",
        description="Train a GPT: untimed warmup, timed training, periodic validation, checkpoints, "
        "and a run folder with config, log (upstream line format), metrics and a sample.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", help="named configuration (default: tiny)")
    p.add_argument("--data", help="glob of training shards; switches the data source to shards")
    p.add_argument("--val-data", help="glob of validation shards (default: --data with 'train' -> 'val' in its "
                   "last path part that has 'train'; an error when none has)")
    p.add_argument("--allow-val-overlap", action="store_true",
                   help="accept validation shards that are also training shards (refused by default)")
    p.add_argument("--tokenizer", choices=("gpt2", "bytes"), help="tokenizer of the shards (default gpt2 with --data)")
    p.add_argument("--tokenizer-dir", help="folder with GPT-2 encoder.json and vocab.bpe (offline)")
    p.add_argument("--steps", type=int, help="number of optimizer steps")
    p.add_argument("--seed", type=int, help="random seed (model init)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--out", help="folder that receives run folders (default ./runs)")
    p.add_argument("--name", help="run name prefix (default: the preset's name)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any configuration field (repeatable)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue this run folder from its newest checkpoint; a finished run is refused, or with "
                   "--steps N (more than it ran) continued in a new folder RUN_DIR-toN")
    p.add_argument("--show-config", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--quiet", action="store_true", help="no console progress (the log file is still written)")
    p.add_argument("--no-preflight", action="store_true",
                   help="skip the environment checks a timed preset (record) runs before compiling")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    from speedrun.config import apply_overrides, preset
    from speedrun.config_check import validate_config
    from speedrun.data.splits import val_glob_for

    try:
        cfg = preset(args.preset)
    except KeyError as e:
        from speedrun.errors import ConfigError

        raise ConfigError(str(e.args[0])) from None
    if args.data:
        cfg.data.source = "shards"
        cfg.data.train_files = args.data
        cfg.data.val_files = args.val_data or val_glob_for(args.data)
        tok = args.tokenizer or "gpt2"
        cfg.data.tokenizer = tok
        if tok == "gpt2":
            cfg.data.bos_id = 50256
            cfg.model.vocab_size = max(cfg.model.vocab_size, 50257)
            if cfg.train.sample_prompt == "The ":
                cfg.train.sample_prompt = "The"
    elif args.val_data:
        cfg.data.val_files = args.val_data
    if args.tokenizer and not args.data:
        cfg.data.tokenizer = args.tokenizer
    if args.tokenizer_dir:
        cfg.data.tokenizer_dir = args.tokenizer_dir
    if args.steps is not None:
        cfg.train.steps = args.steps
    if args.seed is not None:
        cfg.train.seed = args.seed
    if args.device:
        cfg.train.device = args.device
    if args.out:
        cfg.out_dir = args.out
    if args.name:
        cfg.name = args.name
    if args.allow_val_overlap:
        cfg.data.allow_val_overlap = True
    apply_overrides(cfg, args.overrides)
    return validate_config(cfg)


def preflight(cfg) -> None:
    """Refuse to start a timed run on an environment `speedrun doctor` finds broken."""
    from speedrun.errors import EnvironmentProblem
    from speedrun.evidence.doctor import run_doctor

    report = run_doctor(require_gpu=True, data_glob=cfg.data.train_files or None, measure=False)
    if report.blocking:
        problems = "; ".join(f"{what}: {fix}" for what, fix in report.blocking)
        raise EnvironmentProblem(f"preset {cfg.name!r} is a timed GPU run and this environment is not ready: "
                                 f"{problems} (run 'speedrun doctor' for details, or --no-preflight to start anyway)")


def run(args: argparse.Namespace) -> int:
    from speedrun.config import RunConfig
    from speedrun.config_check import validate_config
    from speedrun.errors import ConfigError
    from speedrun.train import faults
    from speedrun.train.loop import train

    if args.resume:
        run_dir = Path(args.resume)
        cfg_file = run_dir / "config.json"
        if not cfg_file.exists():
            raise ConfigError(f"cannot resume: {run_dir} is not a run folder (no config.json)")
        if args.overrides:
            raise ConfigError("--set does not apply with --resume: a resumed run keeps the settings in its "
                              "config.json")
        if args.steps is not None:  # more steps: only for a finished run, continued in a new folder
            run_dir = faults.extension_dir(run_dir, args.steps)
            print(f"extending into {run_dir}")
        else:
            faults.refuse_finished(run_dir)
        cfg = validate_config(RunConfig.from_dict(json.loads((run_dir / "config.json").read_text())))
        result = train(cfg, run_dir=run_dir, resume=True, console=not args.quiet)
    else:
        cfg = build_config(args)
        if args.show_config:
            print(cfg.to_json())
            return 0
        if cfg.train.preflight and not args.no_preflight:
            preflight(cfg)
        result = train(cfg, console=not args.quiet)
    if result.rank != 0:
        return faults.EXIT_STATUS.get(result.signal, 0)
    print(f"run folder: {result.run_dir}")
    if result.signal:
        print(f"stopped by {result.signal}; continue with: speedrun train --resume {result.run_dir}")
        return faults.EXIT_STATUS.get(result.signal, 1)
    print(f"final val_loss: {result.final_val_loss:.4f}  train_time: {result.train_time_ms / 1000:.1f}s")
    return 0

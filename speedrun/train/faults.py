"""What keeps a run from being lost or silently wrong: interrupts, checkpoint policy, a diverged
loss, finished runs and failed starts.

The training loop (:mod:`speedrun.train.loop`) asks a :class:`RunGuard` after every step whether a
checkpoint is due and whether to stop, and hands it every loss it reads anyway; the guard never
reads a device value itself, so it adds no synchronisation to a step.

- SIGINT and SIGTERM set a flag (a second SIGINT interrupts at once); the loop then writes a
  checkpoint outside the timed region and stops, and ``speedrun train --resume`` continues
  bit-exactly.  Under torchrun the ranks agree on the flag every ``train.log_every`` steps, over
  the host group (:func:`speedrun.distributed.any_rank`: no device synchronisation), so all of
  them stop at the same step.
- Checkpoints: every ``train.checkpoint_every`` steps, when ``train.checkpoint_every_s`` seconds of
  wall clock have passed since the last one, at each stage boundary (``train.checkpoint_stages``)
  and at the end.
- A NaN or infinite loss stops the run (:class:`TrainingDiverged`) with the step and the last good
  checkpoint; no checkpoint is written from a diverged state.
- A finished run (``summary.json``) is never resumed over; :func:`extension_dir` prepares a new run
  folder that continues one with more steps.
- :class:`RunStart` removes the run folder of a run that failed before its first step, and
  records the error in ``log.txt`` of one that failed later.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from speedrun import distributed
from speedrun.errors import ConfigError, SpeedrunError

# Exit statuses of a run stopped by a signal (128 + the signal number, as a shell reports them).
EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}


class TrainingDiverged(SpeedrunError):
    """The training or validation loss became NaN or infinite."""


class RunGuard:
    """Signal handling and checkpoint policy of one training run (see the module docstring).

    ``stage_starts``: the steps at which a new stage begins (checkpointed when
    ``train.checkpoint_stages``); ``distributed``: the ``speedrun.distributed`` info, whose ranks
    must agree on time- and signal-driven checkpoints; ``clock``: seconds (wall clock)."""

    def __init__(self, cfg, stage_starts, info, run_dir: Path, clock: Callable[[], float] = time.monotonic):
        t = cfg.train
        self.every = t.checkpoint_every
        self.every_s = t.checkpoint_every_s
        self.stage_starts = {s for s in stage_starts if s > 0} if t.checkpoint_stages else set()
        self.info = info
        self.run_dir = Path(run_dir)
        self.clock = clock
        self.last_checkpoint_time = clock()
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_step: int | None = None
        self.signal_name: str | None = None  # the signal received (this rank)
        self.stop = False  # agreed: write a checkpoint and stop
        self._previous: dict[int, object] = {}

    # -- signals -----------------------------------------------------------------------------

    def install(self) -> None:
        """Catch SIGINT and SIGTERM (from the main thread only: Python sets handlers nowhere else)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> "RunGuard":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signal_name = name

    # -- policy ------------------------------------------------------------------------------

    def checkpoint_due(self, done: int, agree: bool) -> bool:
        """Whether to checkpoint after ``done`` steps.  Step-count and stage rules always apply;
        time and signals on one process every step (host values only), under torchrun only where
        ``agree`` (the loop's logging steps): there the ranks agree on them over the host group."""
        due = (self.every > 0 and done % self.every == 0) or done in self.stage_starts
        if self.info.enabled and not agree:
            return due
        timed = self.every_s > 0 and self.clock() - self.last_checkpoint_time >= self.every_s
        wants = distributed.any_rank([self.signal_name is not None, timed], self.info)
        if wants[0]:
            self.stop = True
            if self.signal_name is None:
                self.signal_name = "SIGTERM"  # another rank's
        return due or any(wants)

    def checkpoint_written(self, path: Path | None, step: int) -> None:
        self.last_checkpoint_time = self.clock()
        self.last_checkpoint, self.last_checkpoint_step = path, step
        if self.signal_name is not None and not self.info.enabled:
            self.stop = True  # a signal that came during the write: this checkpoint is the final one

    # -- losses ------------------------------------------------------------------------------

    def check_loss(self, value: float, step: int, what: str = "training loss") -> None:
        """Raise :class:`TrainingDiverged` when ``value`` (already on the host) is NaN or infinite;
        under torchrun on every rank when it is so on any (one rank alone stopping would leave the
        others waiting in the next collective)."""
        (bad,) = distributed.any_rank([not math.isfinite(value)], self.info)
        if not bad:
            return
        if self.last_checkpoint is not None:
            last = f"last good checkpoint: {self.last_checkpoint} (step {self.last_checkpoint_step})"
        else:
            last = "no checkpoint was written before it"
        raise TrainingDiverged(f"{what} is {value} after step {step}: the run stopped; {last}.  Lower the "
                               f"learning rates (train.lr, train.muon_lr, train.embed_lr) or check the data, "
                               f"and train again")

    def stop_message(self, step: int) -> str:
        return (f"stopped by {self.signal_name} after step {step}; checkpoint {self.last_checkpoint} written. "
                f"Continue with: speedrun train --resume {self.run_dir}")


# ----------------------------------------------------------------------------------------------
# Finished runs


def finished(run_dir: Path) -> dict | None:
    """The ``summary.json`` of a run that ran to its end, or None."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"steps": None}


def refuse_finished(run_dir: Path) -> None:
    """A clear error when ``run_dir`` has finished: resuming it would overwrite its results."""
    summary = finished(run_dir)
    if summary is None:
        return
    steps = summary.get("steps")
    loss = summary.get("final_val_loss")
    loss_text = f", final val_loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
    raise ConfigError(f"{run_dir} is a finished run ({steps} steps{loss_text}); there is nothing to resume and "
                      f"its results stay as they are.  To train it for more steps, pass --steps N (N > {steps}) "
                      f"with --resume: that continues its last checkpoint in a new run folder")


def extension_dir(run_dir: Path, steps: int) -> Path:
    """A new run folder that continues the finished ``run_dir`` up to ``steps`` steps.

    It holds ``config.json`` (``train.steps`` = ``steps``) and a copy of the finished run's last
    checkpoint, so ``train(..., resume=True)`` on it continues from there (the learning-rate
    schedule is that of a ``steps``-step run from then on).  ``run_dir`` itself is only read.  An
    extension folder that exists already (an earlier attempt) is reused."""
    from speedrun.train.checkpoint import list_checkpoints

    run_dir = Path(run_dir)
    summary = finished(run_dir)
    if summary is None:
        raise ConfigError(f"{run_dir} has not finished: resume it without --steps to continue it")
    done = summary.get("steps")
    if not isinstance(done, int) or steps <= done:
        raise ConfigError(f"--steps {steps} must exceed the finished run's {done} steps to extend {run_dir}")
    target = run_dir.with_name(f"{run_dir.name}-to{steps}")
    if (target / "config.json").exists():
        return target
    found = list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"{run_dir} has no checkpoint to extend from")
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["train"]["steps"] = steps
    (target / "checkpoints").mkdir(parents=True, exist_ok=True)
    last = found[-1]
    for part in [last, *last.parent.glob(last.stem + ".rank*.pt")]:
        shutil.copy2(part, target / "checkpoints" / part.name)
    (target / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (target / "EXTENDS").write_text(f"{run_dir.resolve()} from step {done} to {steps}\n")
    return target


# ----------------------------------------------------------------------------------------------
# Failed starts


class RunStart:
    """Tracks one ``train()`` call's run folder so a failure leaves no half-made folder behind.

    ``folder(run_dir, created, log)`` once the folder exists; ``began()`` when the first training
    step starts.  ``failed(error)``: a folder this call created, failed before training began, is
    removed; otherwise the error is appended to its ``log.txt``."""

    def __init__(self):
        self.run_dir: Path | None = None
        self.created = False
        self.trained = False
        self.log = None

    def folder(self, run_dir: Path, created: bool, log) -> None:
        self.run_dir, self.created, self.log = Path(run_dir), created, log

    def began(self) -> None:
        self.trained = True

    def failed(self, error: BaseException) -> None:
        if self.run_dir is None or self.log is None or not self.log.enabled:
            return
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if self.created and not self.trained:
            try:
                self.log.close()
            except Exception:
                pass
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        try:
            self.log.print(f"error: {text}", console=False)
            self.log.metric(event="error", error=text)
            self.log.close()
        except Exception:
            pass  # the original error matters more than a log that cannot be written

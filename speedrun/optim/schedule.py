"""The record's training schedule as data (recipe §2.4, §4.2, §6).

Three scheduled stages of equal length plus an extension stage:

| stage | steps (1270 + 15) | batch (global tokens) | seq cap | windows (blocks of 128) | lr_mul | MTP weights      | prefix   |
|-------|-------------------|-----------------------|---------|-------------------------|--------|------------------|----------|
| 0     | 0-422             | 131,072               | 896     | (1, 3)                  | 1.0    | [1, .5, .25->0]  | .25      |
| 1     | 423-846           | 262,144               | 2048    | (3, 7)                  | 1.52   | [1, .5->0]       | .25->0   |
| 2     | 847-1269          | 393,216               | 2048    | (5, 11)                 | 1.73   | [1]              | 0        |
| ext   | 1270-1284         | 393,216               | 2048    | (6, 13)                 | (0.15) | [1]              | 0        |

Ramps (``a->b``) are linear in ``t = (step - stage_start) / stage_length``.  The final validation uses
a long window of 20 blocks (2560 tokens).  LR multiplier: the stage's lr_mul until
``int(scheduled * (1 - 0.6)) = 508``, then linear to 0.15 at the end of the scheduled steps, 0.15 in
the extension.  NorMuon momentum: 0.85 -> 0.95 over steps 0-300, 0.95, then back toward 0.85 over
the last 50 steps.  Adam steps on odd steps; embed/lm_head untie after the first odd step of stage 2
(847).  The untimed warmup visits steps {0, 1} and s-2..s+1 around every transition s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["StageSpec", "RECORD_STAGES", "StepSettings", "RecordSchedule", "schedule_table"]


@dataclass(frozen=True)
class StageSpec:
    """One stage.  ``duration`` is the fraction of the scheduled steps (None for the extension)."""

    batch_tokens: int
    max_seq_len: int
    window_blocks: tuple[int, int]  # (short, long) in units of block_size tokens
    lr_mul: float
    mtp_start: tuple[float, ...]
    mtp_end: tuple[float, ...]
    prefix_start: float = 0.0
    prefix_end: float = 0.0
    duration: float | None = None


RECORD_STAGES: tuple[StageSpec, ...] = (
    StageSpec(131072, 896, (1, 3), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, 0.25, 1 / 3),
    StageSpec(262144, 2048, (3, 7), 1.52, (1.0, 0.5), (1.0, 0.0), 0.25, 0.0, 1 / 3),
    StageSpec(393216, 2048, (5, 11), 1.73, (1.0,), (1.0,), 0.0, 0.0, 1 / 3),
    StageSpec(393216, 2048, (6, 13), 1.0, (1.0,), (1.0,), 0.0, 0.0, None),  # extension; lr_mul unused
)


@dataclass(frozen=True)
class StepSettings:
    """Everything the training loop and optimizer need at one step.

    Windows are in tokens (``*_blocks`` in 128-token blocks); ``batch_tokens`` is global.
    ``yarn_change``: the long window differs from the previous step's (rescale RoPE before this
    step's forward).  ``untie``: untie embed/lm_head after this step's optimizer update.
    ``loader_change``: batch size or sequence cap differs from the previous step's.
    """

    step: int
    stage_index: int
    batch_tokens: int
    max_seq_len: int
    window_short: int
    window_long: int
    window_short_blocks: int
    window_long_blocks: int
    mtp_weights: tuple[float, ...]
    prefix_weight: float
    lr_mult: float
    muon_momentum: float
    adam_step: bool
    untie: bool
    yarn_change: bool
    loader_change: bool


class RecordSchedule:
    """The record's schedule; ``at(step)`` gives :class:`StepSettings` for 0 <= step < total_steps.

    num_scheduled: steps of the three main stages (1270 in the record); num_extension: extra steps
    at the final lr and windows (15 at f411b3d; 45 in PR #344).
    """

    def __init__(
        self,
        num_scheduled: int = 1270,
        num_extension: int = 15,
        *,
        stages: tuple[StageSpec, ...] = RECORD_STAGES,
        block_size: int = 128,
        cooldown_frac: float = 0.60,
        final_lr_mult: float = 0.15,
        muon_warmup_steps: int = 300,
        muon_cooldown_steps: int = 50,
        momentum_min: float = 0.85,
        momentum_max: float = 0.95,
        split_stage: int = 2,
        final_window_long_blocks: int = 20,
    ):
        if num_scheduled < len(stages) or num_extension < 0:
            raise ValueError(f"RecordSchedule: need num_scheduled >= {len(stages)} and num_extension >= 0, "
                             f"got {num_scheduled}, {num_extension}")
        if stages[-1].duration is not None or any(s.duration is None for s in stages[:-1]):
            raise ValueError("RecordSchedule: every stage but the last (extension) needs a duration")
        self.stages = stages
        self.num_scheduled = num_scheduled
        self.num_extension = num_extension
        self.total_steps = num_scheduled + num_extension
        self.block_size = block_size
        self.cooldown_frac = cooldown_frac
        self.final_lr_mult = final_lr_mult
        self.muon_warmup_steps = muon_warmup_steps
        self.muon_cooldown_steps = muon_cooldown_steps
        self.momentum_min, self.momentum_max = momentum_min, momentum_max
        self.final_window_long_blocks = final_window_long_blocks
        ends, acc = [0], 0.0
        for s in stages[:-1]:
            acc += s.duration
            ends.append(round(acc * num_scheduled))
        if ends[-1] != num_scheduled:
            raise ValueError(f"RecordSchedule: stage durations must sum to 1, got {acc}")
        ends.append(self.total_steps)
        self.boundaries: list[tuple[int, int]] = list(zip(ends[:-1], ends[1:]))
        # The untie must land on an Adam (odd) step so both tables get the same final update.
        self.split_step = self.boundaries[split_stage][0] | 1

    # -- pieces ------------------------------------------------------------------------------------

    def transitions(self) -> list[int]:
        """First step of every stage after the first: [423, 847, 1270] for the record."""
        return [start for start, _ in self.boundaries[1:]]

    def lookup(self, step: int) -> tuple[int, float]:
        """(stage index, fraction of that stage done) for ``step``; past the end: (last, 1.0)."""
        for i, (start, end) in enumerate(self.boundaries):
            if step < end:
                return i, (step - start) / (end - start)
        return len(self.stages) - 1, 1.0

    def lr_mult(self, step: int) -> float:
        """Multiplier on every base learning rate."""
        i, _ = self.lookup(step)
        lr = self.stages[i].lr_mul
        cd_start = int(self.num_scheduled * (1 - self.cooldown_frac))
        if step >= cd_start:
            t = min(1.0, (step - cd_start) / max(1, self.num_scheduled - cd_start))
            lr = lr * (1 - t) + self.final_lr_mult * t
        return lr

    def muon_momentum(self, step: int) -> float:
        lo, hi = self.momentum_min, self.momentum_max
        cd_start = self.total_steps - self.muon_cooldown_steps
        if step < self.muon_warmup_steps:
            return lo + (hi - lo) * step / self.muon_warmup_steps
        if step > cd_start:
            return hi - (hi - lo) * (step - cd_start) / self.muon_cooldown_steps
        return hi

    @staticmethod
    def adam_step(step: int) -> bool:
        """Adam (and the embed/lm_head tie bookkeeping) updates on odd steps only."""
        return step % 2 == 1

    def warmup_steps(self) -> list[int]:
        """Steps the untimed compile warmup runs: {0, 1} and s-2..s+1 around each transition."""
        steps = {0, 1}
        for s in self.transitions():
            steps.update(range(s - 2, s + 2))
        return sorted(x for x in steps if 0 <= x < self.total_steps)

    def final_eval_windows(self) -> tuple[int, int]:
        """(short, long) windows in tokens for the final validation (long window 20 blocks)."""
        return (self.stages[-1].window_blocks[0] * self.block_size,
                self.final_window_long_blocks * self.block_size)

    # -- everything at once ------------------------------------------------------------------------

    def at(self, step: int) -> StepSettings:
        if not 0 <= step < self.total_steps:
            raise ValueError(f"RecordSchedule.at: step {step} outside 0..{self.total_steps - 1}")
        i, t = self.lookup(step)
        st = self.stages[i]
        prev = self.stages[self.lookup(step - 1)[0]] if step > 0 else st
        mtp = tuple(a + (b - a) * t for a, b in zip(st.mtp_start, st.mtp_end))
        short_b, long_b = st.window_blocks
        return StepSettings(
            step=step,
            stage_index=i,
            batch_tokens=st.batch_tokens,
            max_seq_len=st.max_seq_len,
            window_short=short_b * self.block_size,
            window_long=long_b * self.block_size,
            window_short_blocks=short_b,
            window_long_blocks=long_b,
            mtp_weights=mtp,
            prefix_weight=st.prefix_start + (st.prefix_end - st.prefix_start) * t,
            lr_mult=self.lr_mult(step),
            muon_momentum=self.muon_momentum(step),
            adam_step=self.adam_step(step),
            untie=step == self.split_step,
            yarn_change=step > 0 and prev.window_blocks[1] != long_b,
            loader_change=step > 0 and (prev.batch_tokens, prev.max_seq_len) != (st.batch_tokens, st.max_seq_len),
        )

    def to_config_stages(self) -> list:
        """The stages as :class:`speedrun.config.Stage` (ramps as (start, end) pairs)."""
        from speedrun.config import Stage

        out = []
        for (start, _), st in zip(self.boundaries, self.stages):
            out.append(Stage(
                start_step=start, batch_tokens=st.batch_tokens, max_seq_len=st.max_seq_len,
                window_short=st.window_blocks[0] * self.block_size,
                window_long=st.window_blocks[1] * self.block_size,
                mtp_weights=tuple(a if a == b else (a, b) for a, b in zip(st.mtp_start, st.mtp_end)),
                prefix_weight=(st.prefix_start, st.prefix_end),
            ))
        return out


def schedule_table(num_scheduled: int = 1270, num_extension: int = 15) -> list[dict]:
    """Per-step settings of the record schedule as plain dicts (see :class:`StepSettings`)."""
    sched = RecordSchedule(num_scheduled, num_extension)
    return [asdict(sched.at(s)) for s in range(sched.total_steps)]

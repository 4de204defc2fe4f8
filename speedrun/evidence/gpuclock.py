"""SM clock, power and temperature sampled while each benchmark arm runs.

An H200 running the record's stage-3 step draws its 700 W limit and lowers its SM clock to stay
there, well below its idle clock.  Two arms
that move different numbers of bytes or use FP8 instead of bf16 can then run the *same* kernels
at different clocks, and a time ratio mixes work saved with energy saved.  :class:`ClockSampler`
polls NVML from a background thread (``torch.cuda.clock_rate`` / ``power_draw`` /
``temperature``, which need the ``nvidia-ml-py`` package) and files each sample under the arm
whose timed step is running (:attr:`ClockSampler.label`; ``None`` between steps: not kept).

The thread holds the GIL for roughly 0.1 ms per sample; at the default 20 samples per second that
is ~0.2% of the host's time, the same for every arm of an interleaved bench.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import asdict, dataclass
from typing import Callable

import torch

Reading = tuple[float, float, float]  # (SM clock MHz, power W, temperature C)


@dataclass
class ArmClocks:
    samples: int
    sm_mhz_median: float
    sm_mhz_p10: float
    power_w_median: float
    temp_c_max: float


def nvml_reader(device: torch.device) -> tuple[Callable[[], Reading] | None, str]:
    """A function reading (SM MHz, W, C) of ``device``, or None and why it is unavailable."""
    if device.type != "cuda":
        return None, f"no GPU clocks on a {device.type} device"
    try:
        def read() -> Reading:
            return (float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1000.0,
                    float(torch.cuda.temperature(device)))

        read()
    except Exception as err:  # ModuleNotFoundError (no nvidia-ml-py), NVML errors, a driver without NVML
        return None, f"NVML unavailable ({type(err).__name__}: {str(err)[:120]})"
    return read, ""


class ClockSampler:
    """Sample ``read`` every ``interval_s`` seconds in a daemon thread while :attr:`label` is set;
    :meth:`summary` gives per-label medians.  Use as a context manager (starts and stops the
    thread)."""

    def __init__(self, read: Callable[[], Reading], interval_s: float = 0.05):
        if interval_s <= 0:
            raise ValueError(f"ClockSampler: interval_s must be > 0, got {interval_s}")
        self.read, self.interval_s = read, interval_s
        self.label: str | None = None
        self.samples: dict[str, list[Reading]] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            label = self.label
            if label is None:
                continue
            try:
                reading = self.read()
            except Exception:  # one failed read loses one sample, not the benchmark
                self.errors += 1
                continue
            if self.label == label:  # the step may have ended while NVML answered
                self.samples.setdefault(label, []).append(reading)

    def __enter__(self) -> "ClockSampler":
        self._thread = threading.Thread(target=self._run, name="speedrun-clock-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.label = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self) -> dict[str, dict]:
        """{label: ArmClocks as a dict} for every label with samples."""
        out = {}
        for label, rows in self.samples.items():
            clocks = sorted(r[0] for r in rows)
            out[label] = asdict(ArmClocks(len(rows), statistics.median(clocks), clocks[len(clocks) // 10],
                                          statistics.median(r[1] for r in rows), max(r[2] for r in rows)))
        return out

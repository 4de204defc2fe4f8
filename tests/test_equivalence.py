"""speedrun.evidence.equivalence: per-tensor relative errors of two runs' final weights."""

import pytest
import torch

from speedrun.evidence.equivalence import relative_errors


def test_relative_errors_per_tensor():
    a = {"w": torch.ones(4), "z": torch.zeros(3), "b": torch.tensor([3.0, 4.0])}
    b = {"w": torch.ones(4) * 1.01, "z": torch.zeros(3), "b": torch.tensor([3.0, 4.0])}
    errs = relative_errors(a, b)
    assert errs["w"] == pytest.approx(0.01) and errs["z"] == 0.0 and errs["b"] == 0.0
    assert relative_errors({"z": torch.zeros(2)}, {"z": torch.ones(2)})["z"] == float("inf")
    with pytest.raises(ValueError, match="differ in keys"):
        relative_errors(a, {"w": a["w"]})
    with pytest.raises(ValueError, match="shape"):
        relative_errors({"w": torch.ones(4)}, {"w": torch.ones(5)})

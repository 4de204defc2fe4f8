"""Importing any module needs no GPU, network, data or tokenizer download, and has no side effects."""

import subprocess
import sys

SCRIPT = r"""
import importlib, pkgutil, socket, sys
def no_network(*a, **k):
    raise AssertionError("a module opened a network connection at import time")
socket.socket.connect = no_network
socket.create_connection = no_network
import speedrun
names = [m.name for m in pkgutil.walk_packages(speedrun.__path__, "speedrun.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
import torch
assert not torch.cuda.is_initialized(), "a module initialised CUDA at import time"
assert "tiktoken" not in sys.modules or not hasattr(sys.modules["tiktoken"], "_cached"), "tokenizer loaded"
print(len(names))
"""


def test_every_module_imports_without_side_effects(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) > 30
    assert list(tmp_path.iterdir()) == [], "importing wrote files"


WITHOUT_TRITON = r"""
import sys
sys.modules["triton"] = None  # as on a CPU install without the test extra
import torch
import speedrun.optim.normuon
from speedrun.kernels.fused_adam import adam_update_auto_, fused_adam_supported
from speedrun.optim.adam import new_adam_state
p = torch.randn(4, 4)
assert not fused_adam_supported(p, p)
before = p.clone()
adam_update_auto_(p, torch.randn(4, 4), new_adam_state(p), lr=0.1, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
assert not torch.equal(p, before)
print("ok")
"""


def test_optimizer_imports_and_runs_its_references_without_triton(tmp_path):
    """Triton is optional on the CPU (a test extra): NorMuon + Adam must import and update without it."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"

"""Importing any module needs no GPU, network, data or tokenizer download, and has no side effects."""

import os
import subprocess
import sys
from pathlib import Path

import speedrun

# the subprocesses import the speedrun under test, not whatever an editable install points at
TREE = str(Path(speedrun.__file__).resolve().parent.parent)

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
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": TREE}
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
from speedrun.kernels.fused_adam import fused_adam_supported
from speedrun.optim.adam import adam_update_auto_, new_adam_state
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
                         timeout=300, env={**os.environ, "PYTHONPATH": TREE})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


# ----------------------------------------------------------------------------------------------
# Layering: which package of speedrun may import which (every import, module level or inside a
# function, read from the source with ast)

# A package imports only packages of a lower layer (and itself).  data -> model -> train ->
# evidence -> cli; kernels sit just above config and errors and import nothing else of ours.
LAYERS = {
    "errors": 0, "config": 1,
    "kernels": 2, "compiling": 2, "distributed": 2, "config_check": 2,
    "data": 3, "attention": 3,
    "model": 4, "optim": 4,
    "train": 5,
    "evidence": 6,
    "cli": 7,
    "__main__": 8,
}


def _speedrun_imports():
    """(importing module path, its package, imported package, line) for every import of speedrun.X."""
    import ast
    from pathlib import Path

    import speedrun

    root = Path(speedrun.__file__).parent
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        pkg = rel.parts[0].removesuffix(".py")
        if pkg == "__init__":
            continue  # the package root (version, lazy re-exports)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = ([f"speedrun.{a.name}" for a in node.names] if node.module == "speedrun" else [node.module])
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "speedrun" and len(parts) > 1 and parts[1] != "__version__" and parts[1] != pkg:
                    out.append((str(rel), pkg, parts[1], node.lineno))
    return out


def test_packages_import_only_lower_layers():
    edges = _speedrun_imports()
    pkgs = {p for _, p, _, _ in edges} | {t for _, _, t, _ in edges}
    assert pkgs <= set(LAYERS), f"packages without a layer in this test: {sorted(pkgs - set(LAYERS))}"
    # the scan sees real edges (a parser that found nothing would pass every rule below)
    assert {("train", "model"), ("model", "kernels"), ("cli", "evidence")} <= {(p, t) for _, p, t, _ in edges}
    bad = [f"{f}:{line} ({p}) imports speedrun.{t}" for f, p, t, line in edges if LAYERS[t] >= LAYERS[p]]
    assert not bad, "imports against the layering (data -> model -> train -> evidence -> cli):\n" + "\n".join(bad)


def test_kernels_import_only_config_and_errors_and_only_cli_imports_evidence():
    edges = _speedrun_imports()
    bad = [f"{f}:{line} imports speedrun.{t}" for f, p, t, line in edges if p == "kernels" and t not in ("config", "errors")]
    bad += [f"{f}:{line} imports speedrun.evidence" for f, p, t, line in edges if t == "evidence" and p != "cli"]
    assert not bad, "\n".join(bad)

"""The step key's host time inside live replayed steps (rank 0 of 8 simulated, 11 layers, CPU)."""
import sys, tempfile, time, statistics
sys.path.insert(0, "benchmarks")
import torch
torch.set_num_threads(1)
import bench_replay_host as b
from speedrun import distributed
from speedrun.config import apply_overrides, preset
from speedrun.evidence.bench import build_session
from speedrun.train.graphs import StepGraphs
for arm in ("record", "candidate"):
    preset_name, switches = b.ARMS[arm]
    cfg = preset(preset_name)
    apply_overrides(cfg, ["model.num_layers=11", "train.batch_divisor=1024", "train.grad_accum=0", "train.steps=400",
                          f"out_dir={tempfile.mkdtemp()}", *switches])
    s = build_session(arm, cfg, 0, distributed.setup("cpu"), simulate_world=8)
    g = s.graphs = StepGraphs(s.run_model, s.recipe, s.info.device, s.dtype, capture_with=b.NoOpCapture, check=False,
                              ends_step=False)
    for _ in range(g.steps_until_replay + 2):
        s.step()
    orig, acc = g._key, []

    def timed(*a, **k):
        t0 = time.perf_counter()
        r = orig(*a, **k)
        acc.append(time.perf_counter() - t0)
        return r

    g._key = timed
    for _ in range(60):
        time.sleep(0.02)  # the loop's wait for the GPU
        s.step()
    s.close()
    q = statistics.quantiles(acc, n=4)
    print(f"{arm} key in live steps: median {statistics.median(acc)*1e6:.0f} us, q1 {q[0]*1e6:.0f}, q3 {q[2]*1e6:.0f} (n={len(acc)})")

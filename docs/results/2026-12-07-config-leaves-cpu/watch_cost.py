import sys, tempfile, time, statistics
sys.path.insert(0, "benchmarks")
import torch
torch.set_num_threads(1)
import bench_replay_host as b
from speedrun import distributed
from speedrun.config import apply_overrides, preset
from speedrun.evidence.bench import build_session
from speedrun.train.addresses import AddressWatch
for arm in ("record", "candidate"):
    preset_name, switches = b.ARMS[arm]
    cfg = preset(preset_name)
    apply_overrides(cfg, ["model.num_layers=11", "train.batch_divisor=1024", "train.grad_accum=0", "train.steps=400", f"out_dir={tempfile.mkdtemp()}", *switches])
    s = build_session(arm, cfg, 0, distributed.setup("cpu"), simulate_world=8)
    for _ in range(3):
        s.step()
    w = AddressWatch([("model", s.model)])
    w.fingerprint()
    n = dict(edges=len(w._holders), leaves=len(w._leaf_holders), tensors=len(w._tensor_holders), versioned=len(w._versioned), sized=len(w._sized))
    ts, cold = [], []
    for _ in range(2000):
        t0 = time.perf_counter(); w.fingerprint(); ts.append(time.perf_counter() - t0)
    junk = torch.zeros(16 * 2**20 // 4)  # 16 MiB: more than this CPU's caches
    for _ in range(200):
        junk.add_(1.0)  # evict: the step's other work does this between keys
        t0 = time.perf_counter(); w.fingerprint(); cold.append(time.perf_counter() - t0)
    s.close()
    print(arm, n, "entries", sum(n.values()), f"check median {statistics.median(ts)*1e6:.1f} us warm, {statistics.median(cold)*1e6:.1f} us after evicting the caches")

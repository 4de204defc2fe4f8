import sys, tempfile, time, statistics
sys.path.insert(0, "benchmarks")
import torch
torch.set_num_threads(1)
import bench_replay_host as b
from speedrun import distributed
from speedrun.config import apply_overrides, preset
from speedrun.evidence.bench import build_session
from speedrun.train.graphs import StepGraphs, step_key, _batch_shape
for arm in ("record", "candidate"):
    preset_name, switches = b.ARMS[arm]
    cfg = preset(preset_name)
    apply_overrides(cfg, ["model.num_layers=11", "train.batch_divisor=1024", "train.grad_accum=0", "train.steps=400", f"out_dir={tempfile.mkdtemp()}", *switches])
    s = build_session(arm, cfg, 0, distributed.setup("cpu"), simulate_world=8)
    g = s.graphs = StepGraphs(s.run_model, s.recipe, s.info.device, s.dtype, capture_with=b.NoOpCapture, check=False, ends_step=False)
    for _ in range(g.steps_until_replay + 2):
        s.step()
    # capture the arguments of the next _key call
    got = {}
    orig = g._key
    def spy(*a, **k):
        got["a"] = a; return orig(*a, **k)
    g._key = spy
    s.step()
    g._key = orig
    batches, args, scale, divisor = got["a"]
    model = g.model
    params = g._named_params
    fp = g._watch.fingerprint()
    junk = torch.zeros(16 * 2**20 // 4)
    parts = {k: [] for k in ("watch", "present", "signature", "shape", "step_key", "hash", "lookup", "_key+get")}
    for _ in range(300):
        junk.add_(1.0)
        t0 = time.perf_counter(); g._watch.fingerprint(); t1 = time.perf_counter()
        frozenset(n for n, p in params if p.grad is not None); t2 = time.perf_counter()
        model.graph_signature(); t3 = time.perf_counter()
        _batch_shape(batches[0]); t4 = time.perf_counter()
        key = step_key(model, batches, args, scale, divisor, fingerprint=fp, params=params); t5 = time.perf_counter()
        hash(key); t6 = time.perf_counter()
        g._steps.get(key); t7 = time.perf_counter()
        junk.add_(1.0)
        t8 = time.perf_counter(); g._steps.get(g._key(batches, args, scale, divisor)); t9 = time.perf_counter()
        for k, v in zip(parts, (t1-t0, t2-t1, t3-t2, t4-t3, t5-t4, t6-t5, t7-t6, t9-t8)):
            parts[k].append(v)
    s.close()
    print(arm, "  ".join(f"{k} {statistics.median(v)*1e6:.1f}" for k, v in parts.items()), "(us, medians, caches evicted before each round)")

"""The errors behind the golden tests' bounds: the presets' MLP modes against upstream f411b3d's
MLP kernel, and the candidate's model against PR #344's (c4c209d), from the committed fixtures.
Run from the repository root:  TRITON_INTERPRET=1 python docs/results/2026-12-08-faithfulness-goldens-cpu/measure.py"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import upstream_goldens as G  # noqa: E402
from speedrun.model.interface import ForwardArgs  # noqa: E402

torch.set_num_threads(1)
mlp = G.load_fixture("mlp")
inputs = G.mlp_inputs()
for case, mode in (("bf16", "bf16"), ("fp8", "fp8_fwd"), ("fp8", "fp8_full"), ("bf16", "fp8_fwd")):
    got = G.our_mlp(inputs, mode)
    errs = {k: G.relative_error(got[k], mlp["cases"][case][k], f"mlp.{k}") for k in ("y", "dx", "dw1", "dw2")}
    print(f"mlp: ours {mode:8s} vs upstream {case:4s}: " + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()))
print(f"mlp: upstream's FP8 activation scale at the recorded call {mlp['cases']['fp8']['act_scale']:.6f}")

net = G.load_fixture("network", G.PR344_DIR)
params, signs = G.network_params(net, G.PR344_DIR), G.unpack_signs(net["sign_table"])


def ours(attn_scale="preset"):
    cfg = G.candidate_config()
    if attn_scale != "preset":
        cfg.attn_scale = attn_scale
    return G.ours_from_upstream(G.pr344_to_f411b3d_layout(params), signs, model_cfg=cfg)


def losses(model, case):
    for old, new in case["yarn"]:
        model.yarn.apply(old, new)
    with torch.no_grad():
        return model.per_token_loss(G.batch_of(G.SHAPES.docs, G.SHAPES.vocab, case["seed"], net["bigram_mod"]),
                                    ForwardArgs(*case["windows"]))


for i, case in enumerate(net["cases"]):
    d = (losses(ours(), case) - case["loss"]).abs()
    print(f"pr344: candidate eval losses, case {i} (windows {case['windows']}): max |diff| {d.max().item():.2e}")
m = ours()
G.grad_case_backward(m, net)
errs = G.gradient_errors(m, net["grads"])
lam = ("post_lambdas", "resid_lambdas")
worst = max((n for n in errs if n not in lam), key=errs.get)
print(f"pr344: candidate gradients, largest relative error {errs[worst]:.2e} ({worst}); "
      + ", ".join(f"{n} {errs[n]:.2e}" for n in lam))
d = losses(ours(0.1), net["cases"][0]) - net["cases"][0]["loss"]
print(f"pr344: with the record's starting scale 0.1 instead: max |diff| {d.abs().max().item():.3f}, "
      f"mean |diff| {d.abs().mean().item():.3f}, mean loss {d.mean().item():+.4f}")

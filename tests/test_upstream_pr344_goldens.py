"""The candidate preset's model against golden values recorded from upstream PR #344's own code
(c4c209d, ``tests/fixtures/upstream_pr344/``, written by ``tools/record_upstream_goldens.py
UPSTREAM_DIR --pr344``).  No upstream source is needed: these run on every CI run.

PR #344's model is f411b3d's with 96-wide Q/K heads: its attention runs its own fused QK kernel
(norm, RoPE, key offset, padding to 128; in Triton's interpreter made to round as a GPU does,
``tests/interpreter_numerics.py``), and its softmax scale starts at ``0.1 * sqrt(128 / 96)``.  The
fixture pins its evaluation per-token losses in two window/YaRN cases and the gradient of every
parameter, at the shapes and from the recipes of the f411b3d goldens (``tests/upstream_goldens.py``);
our ``RecordGPT`` with the candidate preset's model settings (``G.candidate_config``) must match
them to fp32 rounding, after two layout conventions are bridged: RoPE's rotation direction (as for
f411b3d) and PR #344's transposed O in the V/O bank (``G.pr344_to_f411b3d_layout``).
"""

from __future__ import annotations

import pytest
import torch

import upstream_goldens as G
from speedrun.model.interface import ForwardArgs

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 5e-5  # per-token losses, fp32 on both sides (the f411b3d goldens' tolerances)
GRAD_RTOL = 5e-5
LAMBDA_GRAD_RTOL = 4e-3  # upstream rounds the residual/post lambdas to bf16 in its forward


@pytest.fixture(scope="module")
def network():
    payload = G.load_fixture("network", G.PR344_DIR)
    return payload, G.network_params(payload, G.PR344_DIR), G.unpack_signs(payload["sign_table"])


def _ours(network, model_cfg=None):
    payload, params, signs = network
    return G.ours_from_upstream(G.pr344_to_f411b3d_layout(params), signs, model_cfg=model_cfg or G.candidate_config())


def _loss(ours, payload, case):
    for old, new in case["yarn"]:
        ours.yarn.apply(old, new)
    with torch.no_grad():
        return ours.per_token_loss(G.batch_of(G.SHAPES.docs, G.SHAPES.vocab, case["seed"], payload["bigram_mod"]),
                                   ForwardArgs(*case["windows"]))


@pytest.mark.parametrize("case", range(len(G.FORWARD_CASES)))
def test_candidate_eval_forward_matches_pr344(network, case):
    payload = network[0]
    want = G.require(payload, "cases", "network", G.PR344_DIR)[case]
    got = _loss(_ours(network), payload, want)
    assert got.shape == want["loss"].shape == (sum(G.SHAPES.docs),)
    torch.testing.assert_close(got, want["loss"], rtol=0, atol=ATOL)


def test_candidate_gradients_match_pr344(network):
    payload = network[0]
    ours = _ours(network)
    G.grad_case_backward(ours, payload)
    grads = G.require(payload, "grads", "network", G.PR344_DIR)
    assert payload["mlp_padding_grad_norm"] == 0
    assert sorted(grads) == sorted(n for n, _ in ours.named_parameters())
    for name, err in G.gradient_errors(ours, grads).items():
        assert err is not None, name
        assert err < (LAMBDA_GRAD_RTOL if name in ("post_lambdas", "resid_lambdas") else GRAD_RTOL), (name, err)


def test_the_goldens_catch_the_records_softmax_scale_and_an_untransposed_o(network):
    """The tolerance is tight enough: the record's starting scale 0.1 on the 96-wide heads (what the
    candidate ran before it took PR #344's rule), or PR #344's O read without the transpose, moves
    the losses far past it."""
    payload = network[0]
    case = payload["cases"][0]
    cfg = G.candidate_config()
    cfg.attn_scale = 0.1
    assert (_loss(_ours(network, cfg), payload, case) - case["loss"]).abs().max() > 20 * ATOL
    _, params, signs = network
    untransposed = G.ours_from_upstream(params, signs, model_cfg=G.candidate_config())
    assert (_loss(untransposed, payload, case) - case["loss"]).abs().max() > 20 * ATOL


def test_the_candidate_preset_starts_at_pr344s_softmax_scale(network):
    ours = _ours(network)
    assert ours.yarn.rope_dims == 48 and ours.attn_scale == pytest.approx(0.1 * (128 / 96) ** 0.5, rel=1e-12)


def test_pr344_fixture_is_small_and_names_its_commit():
    size = G.fixture_path("network", G.PR344_DIR).stat().st_size
    assert size < 2**20, size
    body = torch.load(G.fixture_path("network", G.PR344_DIR), weights_only=True)
    assert body["upstream_commit"] == G.PR344_COMMIT


def test_a_missing_pr344_fixture_names_the_pr344_command(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "PR344_DIR", tmp_path)
    with pytest.raises(G.GoldenFixtureError, match=r"network\.pt: missing; regenerate it with .*--pr344"):
        G.load_fixture("network", G.PR344_DIR)


def test_the_o_transpose_maps_each_o_and_nothing_else():
    vo = torch.randn(24, 8, 8)
    before = vo.clone()
    got = G.pr344_to_f411b3d_layout({"vo_bank": vo, "other": vo[:1]}, num_attn_layers=10)["vo_bank"]
    for i in range(24):
        want = vo[i].t() if i % 2 and i < 20 else vo[i]
        assert torch.equal(got[i], want), i
    assert torch.equal(vo, before)  # the input is left as it was

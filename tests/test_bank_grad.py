"""The record MLP's weight gradients summed in place (speedrun.model.bank_grad, model.mlp_weight_grad)."""

from __future__ import annotations

import pytest
import torch

from speedrun.config import ModelConfig
from speedrun.errors import ConfigError
from speedrun.model.bank_grad import MLPBankGradAccumulator
from speedrun.model.record import RecordGPT
from test_candidate import ARGS, _batch, _grads, _pair

pytestmark = pytest.mark.usefixtures("one_thread")


def test_first_product_overwrites_later_ones_add_and_flush_hands_over():
    """Slot semantics over two steps: a step's first product overwrites its slot (whatever the
    buffer held), later ones add; flush hands the buffer to .grad; a slot the second step does not
    write is zero in its gradient, and the padding slot is never anything but zero."""
    g = torch.Generator().manual_seed(0)
    bank = torch.nn.Parameter(torch.zeros(3, 2, 4, 5))  # layers 0-1 real, 2 padding
    acc = MLPBankGradAccumulator(bank)
    ops = [(torch.randn(4, 7, generator=g), torch.randn(7, 5, generator=g)) for _ in range(6)]
    acc.add_product(0, 0, *ops[0])
    acc.add_product(0, 1, *ops[1])
    acc.add_product(1, 0, *ops[2])
    acc.add_product(0, 0, *ops[3])
    assert acc.pending() and bank.grad is None  # nothing reaches .grad before the flush
    acc.flush()
    assert not acc.pending() and bank.grad is acc.buffer
    want = torch.zeros(3, 2, 4, 5)
    want[0, 0] = ops[0][0] @ ops[0][1] + ops[3][0] @ ops[3][1]
    want[0, 1] = ops[1][0] @ ops[1][1]
    want[1, 0] = ops[2][0] @ ops[2][1]
    torch.testing.assert_close(bank.grad, want, rtol=1e-6, atol=1e-6)
    bank.grad = None  # the optimizer drops it
    acc.add_product(1, 0, *ops[4])  # step 2 writes one slot only
    acc.flush()
    want2 = torch.zeros(3, 2, 4, 5)
    want2[1, 0] = ops[4][0] @ ops[4][1]
    torch.testing.assert_close(bank.grad, want2, rtol=1e-6, atol=1e-6)
    acc.flush()  # nothing pending: changes nothing
    torch.testing.assert_close(bank.grad, want2, rtol=1e-6, atol=1e-6)
    # a gradient from elsewhere gets ours added, not replaced
    other = torch.ones(3, 2, 4, 5)
    bank.grad = other
    acc.add_product(0, 1, *ops[5])
    acc.flush()
    want3 = torch.ones(3, 2, 4, 5)
    want3[0, 1] += ops[5][0] @ ops[5][1]
    assert bank.grad is other
    torch.testing.assert_close(bank.grad, want3, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not fit slot"):
        acc.add_product(0, 0, torch.randn(3, 7), torch.randn(7, 5))


def test_discarded_step_leaves_nothing_behind():
    bank = torch.nn.Parameter(torch.zeros(2, 2, 3, 3))
    acc = MLPBankGradAccumulator(bank)
    acc.add_product(0, 0, torch.ones(3, 2), torch.ones(2, 3))
    acc.add_product(1, 1, torch.ones(3, 2), torch.ones(2, 3))
    acc.discard()
    assert not acc.pending()
    acc.flush()
    assert bank.grad is None
    acc.add_product(0, 0, torch.eye(3), torch.eye(3))  # overwrites the discarded sum
    acc.flush()
    want = torch.zeros(2, 2, 3, 3)
    want[0, 0] = torch.eye(3)
    assert torch.equal(bank.grad, want)  # slot (1, 1) of the discarded step zeroed


def test_bf16_products_into_a_bf16_bank_add_inside_the_gemm():
    """bf16 bank and operands: beta=1 ``addmm_`` (the GPU's route); the sum is rounded once per
    product (fp32 product plus the old slot), within bf16 of the fp32 sum."""
    g = torch.Generator().manual_seed(1)
    bank = torch.nn.Parameter(torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16))
    acc = MLPBankGradAccumulator(bank)
    ops = [(torch.randn(8, 32, generator=g), torch.randn(32, 16, generator=g)) for _ in range(4)]
    for a, b in ops:
        acc.add_product(0, 1, a.bfloat16(), b.bfloat16())
    acc.flush()
    exact = sum(a.bfloat16().float() @ b.bfloat16().float() for a, b in ops)
    assert bank.grad.dtype == torch.bfloat16
    torch.testing.assert_close(bank.grad[0, 1].float(), exact, rtol=2e-2, atol=2e-2)
    assert (bank.grad[0, 0] == 0).all()


@pytest.mark.parametrize("kernels,switches", [("triton", {}), ("fp8", {}), ("fp8", {"mlp_input_quant": "graph"})])
def test_record_mlp_bank_gradient_equals_autograd(kernels, switches):
    """The record network with its fused MLP (bf16 or FP8 forward), two micro-batches of one step
    then a second step: with the dW GEMMs summing into the accumulator, mlp_bank.grad after the
    flush equals autograd's (stack + add) route exactly (an fp32 bank: both cast the same bf16
    products), every other gradient is unchanged, and the bank gets nothing before the flush."""
    _, auto = _pair("reference", kernels, **switches)
    _, acc = _pair("reference", kernels, mlp_weight_grad="accumulate", **switches)
    for step in range(2):
        for T in (64, 48):
            batch = _batch(T)
            la, lb = auto.loss(batch, ARGS), acc.loss(batch, ARGS)
            assert torch.equal(la, lb)
            la.backward()
            lb.backward()
        assert acc.mlp_bank.grad is None
        acc.flush_weight_grads()
        auto.flush_weight_grads()  # no-op with autograd
        ga, gb = _grads(auto), _grads(acc)
        assert ga.keys() == gb.keys()
        assert ga["mlp_bank"].abs().sum() > 0
        for name in ga:
            assert torch.equal(ga[name], gb[name]), (step, name)
        auto.zero_grad()
        acc.zero_grad()


def test_switch_is_validated():
    with pytest.raises(ConfigError, match="mlp_weight_grad"):
        ModelConfig(mlp_weight_grad="sparse").validate()
    for kw in (dict(architecture="core"), dict(architecture="record", kernels="reference"),
               dict(architecture="record", kernels="fp8_full")):
        with pytest.raises(ConfigError, match="mlp_weight_grad=accumulate needs"):
            ModelConfig(mlp_weight_grad="accumulate", **kw).validate()
    assert RecordGPT(ModelConfig(vocab_size=257, num_layers=4, model_dim=32, num_heads=2, qk_head_dim=16,
                                 v_head_dim=16, architecture="record"))._mlp_weight_grads is None


@pytest.mark.usefixtures("use_builtin_cache")
def test_training_with_in_place_mlp_gradients_takes_the_same_steps(tmp_path, monkeypatch, kernels_use_references):
    """The tiny record recipe with the FP8 MLP, two micro-batches per step and a warmup: the loop
    flushes the bank's sums before each optimizer step, which sees the gradient autograd's route
    gives (fp32 bank: to the bit), and the run ends at the same weights; the warmup's discarded
    step leaves nothing in the accumulator.  The loop's plumbing is under test, not the FP8
    kernels (test_record_mlp_bank_gradient_equals_autograd runs them through the interpreter):
    their PyTorch references keep the interpreter out of the 2 x 5 steps."""
    from speedrun.config import apply_overrides, preset
    from speedrun.optim.normuon import NorMuonAndAdam
    from speedrun.train.checkpoint import list_checkpoints
    from speedrun.train.loop import train

    seen: dict[str, list] = {}
    real_prepare = NorMuonAndAdam.prepare  # reads the gradients the step is about to apply

    def spy(self, step_index, **kw):
        seen[mode].append(self.entries["mlp_bank"].param.grad.clone())
        return real_prepare(self, step_index, **kw)

    monkeypatch.setattr(NorMuonAndAdam, "prepare", spy)
    products = {"autograd": 0, "accumulate": 0}  # the accumulate run must take the in-place route
    real_add = MLPBankGradAccumulator.add_product

    def count(self, *a, **kw):
        products[mode] += 1
        return real_add(self, *a, **kw)

    monkeypatch.setattr(MLPBankGradAccumulator, "add_product", count)
    weights = {}
    for mode in ("autograd", "accumulate"):
        seen[mode] = []
        cfg = preset("tiny-record")
        apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
                              "model.kernels=fp8", "train.grad_accum=2", "train.batch_divisor=256", "train.steps=5",
                              "train.num_extension=1", "train.warmup_steps=1", "train.val_tokens=2048",
                              "train.val_every=0", "train.log_every=5", f"model.mlp_weight_grad={mode}",
                              f"out_dir={tmp_path / mode}"])
        result = train(cfg, console=False)
        weights[mode] = torch.load(list_checkpoints(result.run_dir)[-1], weights_only=False)["model"]
    assert products["autograd"] == 0 and products["accumulate"] > 0, products
    assert len(seen["autograd"]) == len(seen["accumulate"]) >= 4
    for i, (want, got) in enumerate(zip(seen["autograd"], seen["accumulate"])):
        assert want.abs().sum() > 0 and torch.equal(got, want), i
    for name, tensor in weights["autograd"].items():
        assert torch.equal(weights["accumulate"][name], tensor), name

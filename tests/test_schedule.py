"""The record schedule: stage boundaries, per-step values, lr/momentum curves, warmup steps."""

from __future__ import annotations

import pytest

from speedrun.optim.schedule import RecordSchedule, schedule_table


@pytest.fixture(scope="module")
def sched() -> RecordSchedule:
    return RecordSchedule()


def test_boundaries_and_special_steps(sched):
    assert sched.total_steps == 1285
    assert sched.boundaries == [(0, 423), (423, 847), (847, 1270), (1270, 1285)]
    assert sched.transitions() == [423, 847, 1270]
    assert sched.split_step == 847
    assert sched.warmup_steps() == [0, 1, 421, 422, 423, 424, 845, 846, 847, 848, 1268, 1269, 1270, 1271]
    assert sched.final_eval_windows() == (768, 2560)


@pytest.mark.parametrize(
    "step,stage,batch,seq,short,long",
    [(0, 0, 131072, 896, 128, 384), (422, 0, 131072, 896, 128, 384), (423, 1, 262144, 2048, 384, 896),
     (846, 1, 262144, 2048, 384, 896), (847, 2, 393216, 2048, 640, 1408), (1269, 2, 393216, 2048, 640, 1408),
     (1270, 3, 393216, 2048, 768, 1664), (1284, 3, 393216, 2048, 768, 1664)],
)
def test_stage_values(sched, step, stage, batch, seq, short, long):
    s = sched.at(step)
    assert (s.stage_index, s.batch_tokens, s.max_seq_len, s.window_short, s.window_long) == (
        stage, batch, seq, short, long)


def test_mtp_and_prefix_ramps(sched):
    assert sched.at(0).mtp_weights == (1.0, 0.5, 0.25) and sched.at(0).prefix_weight == 0.25
    mid = sched.at(211)  # t = 211/423 in stage 0
    assert mid.mtp_weights[2] == pytest.approx(0.25 * (1 - 211 / 423))
    assert sched.at(422).prefix_weight == 0.25
    assert sched.at(423).mtp_weights == (1.0, 0.5) and sched.at(423).prefix_weight == 0.25
    assert sched.at(635).prefix_weight == pytest.approx(0.25 * (1 - 212 / 424))
    assert sched.at(635).mtp_weights[1] == pytest.approx(0.5 * (1 - 212 / 424))
    assert sched.at(847).mtp_weights == (1.0,) and sched.at(847).prefix_weight == 0.0
    assert sched.at(1284).mtp_weights == (1.0,)


def test_lr_multiplier(sched):
    assert sched.at(0).lr_mult == 1.0 and sched.at(507).lr_mult == 1.52
    assert sched.at(508).lr_mult == pytest.approx(1.52)  # cooldown starts at int(1270*0.4) = 508
    t = (900 - 508) / 762
    assert sched.at(900).lr_mult == pytest.approx(1.73 * (1 - t) + 0.15 * t)
    assert sched.at(1269).lr_mult == pytest.approx(1.73 * (1 - 761 / 762) + 0.15 * 761 / 762)
    assert sched.at(1270).lr_mult == pytest.approx(0.15) and sched.at(1284).lr_mult == pytest.approx(0.15)


def test_muon_momentum(sched):
    assert sched.at(0).muon_momentum == pytest.approx(0.85)
    assert sched.at(150).muon_momentum == pytest.approx(0.90)
    assert sched.at(300).muon_momentum == 0.95 and sched.at(1235).muon_momentum == 0.95
    assert sched.at(1260).muon_momentum == pytest.approx(0.95 - 0.1 * 25 / 50)
    assert sched.at(1284).muon_momentum == pytest.approx(0.852)
    long = RecordSchedule(1270, 45)  # PR #344's extension moves the cooldown to 1265-1315
    assert long.at(1265).muon_momentum == 0.95 and long.at(1314).muon_momentum == pytest.approx(0.852)
    assert long.transitions() == [423, 847, 1270] and long.at(1300).lr_mult == pytest.approx(0.15)


def test_flags(sched):
    assert [s for s in range(20) if sched.at(s).adam_step] == list(range(1, 20, 2))
    table = schedule_table()
    assert len(table) == 1285
    assert [r["step"] for r in table if r["yarn_change"]] == [423, 847, 1270]
    assert [r["step"] for r in table if r["loader_change"]] == [423, 847]
    assert [r["step"] for r in table if r["untie"]] == [847]


def test_config_stages_and_errors(sched):
    stages = sched.to_config_stages()
    assert [s.start_step for s in stages] == [0, 423, 847, 1270]
    assert stages[0].mtp_weights == (1.0, 0.5, (0.25, 0.0)) and stages[1].prefix_weight == (0.25, 0.0)
    with pytest.raises(ValueError, match="outside"):
        sched.at(1285)
    with pytest.raises(ValueError, match="num_scheduled"):
        RecordSchedule(2, 0)

"""Learning-rate schedules at known points."""

import math

import pytest

from mambactl.train.config import LoopConfig, OptimConfig, ScheduleConfig, TrainConfig
from mambactl.train.schedule import learning_rate


def config(kind, warmup=10, steps=110, min_lr_ratio=0.1, decay_fraction=0.2, lr=1.0):
    return TrainConfig(optim=OptimConfig(lr=lr), train=LoopConfig(steps=steps),
                       schedule=ScheduleConfig(kind=kind, warmup_steps=warmup, min_lr_ratio=min_lr_ratio,
                                               decay_fraction=decay_fraction))


@pytest.mark.parametrize("kind", ["constant", "cosine", "wsd"])
def test_linear_warmup(kind):
    cfg = config(kind, lr=2.0)
    assert [learning_rate(s, cfg) for s in (0, 4, 9)] == pytest.approx([0.2, 1.0, 2.0])


def test_constant():
    cfg = config("constant", warmup=0)
    assert {learning_rate(s, cfg) for s in (0, 50, 109, 500)} == {1.0}


def test_cosine_known_points():
    cfg = config("cosine")  # cosine from step 10 (lr) to step 110 (0.1 lr)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(60, cfg) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert learning_rate(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert learning_rate(110, cfg) == pytest.approx(0.1)
    assert learning_rate(1000, cfg) == pytest.approx(0.1)
    values = [learning_rate(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_known_points():
    cfg = config("wsd", steps=100, decay_fraction=0.2, min_lr_ratio=0.0)  # stable until 80, linear to 0 at 100
    assert [learning_rate(s, cfg) for s in (10, 50, 80)] == pytest.approx([1.0, 1.0, 1.0])
    assert learning_rate(90, cfg) == pytest.approx(0.5)
    assert learning_rate(99, cfg) == pytest.approx(0.05)
    assert learning_rate(100, cfg) == pytest.approx(0.0)


def test_schedule_follows_total_steps_from_tokens():
    cfg = TrainConfig(train=LoopConfig(batch_size=2, seq_len=5, steps=0, tokens=1000),  # 100 steps
                      schedule=ScheduleConfig(kind="cosine", warmup_steps=0, min_lr_ratio=0.0))
    assert learning_rate(50, cfg) == pytest.approx(0.5 * cfg.optim.lr)


def test_warmup_longer_than_the_run_never_exceeds_the_ramp():
    cfg = config("cosine", warmup=200, steps=100)
    assert learning_rate(49, cfg) == pytest.approx(0.25)

"""The skipped-step counts: the host, device and DeepSpeed-engine paths agree on one sequence of verdicts."""

from types import SimpleNamespace

import pytest
import torch

from lwm.utils.errors import ConfigError
from lwm.training.nonfinite import (SkippedSteps, check_deepspeed_skips_overflow, deepspeed_checks_overflow,
    deepspeed_scaling_loss)

VERDICTS = [False, True, True, False, True, True, True, False]  # True: the step's gradient was not finite


def test_host_and_device_verdicts_give_the_same_counts():
    host, device = SkippedSteps(total=2), SkippedSteps(total=2)  # 2 from a checkpoint
    in_a_row_host, in_a_row_device = [], []
    for nonfinite in VERDICTS:
        if nonfinite:
            in_a_row_host.append(host.skipped())
        else:
            host.finite()
            in_a_row_host.append(host.in_a_row)
        device.on_device(torch.tensor(nonfinite))
        in_a_row_device.append(device.in_a_row_on_device())
    assert in_a_row_host == in_a_row_device == [0, 1, 2, 0, 1, 2, 3, 0]
    assert host.total == device.total == 2 + 5
    assert host.as_tensor(torch.device("cpu")).item() == device.as_tensor(torch.device("cpu")).item() == 7


def test_a_loss_scalers_routine_overflow_counts_but_neither_stops_nor_breaks_a_run_of_skips():
    skips = SkippedSteps()
    assert skips.skipped() == 1
    assert skips.skipped(in_a_row=False) == 1
    assert skips.skipped() == 2 and skips.total == 3


def test_the_engine_count_is_read_as_new_skips_since_the_last_read():
    skips = SkippedSteps()
    assert not skips.reading_engine
    skips.engine_start(10)  # a resumed engine's count: not new
    assert skips.reading_engine and skips.total == 0
    assert [skips.engine_count(c, scaling_loss=False) for c in (10, 11, 12, 12, 13)] == [0, 1, 2, 0, 1]
    assert skips.engine_count(14, scaling_loss=True) == 1 and skips.total == 4  # counted, not towards the stop


def test_an_engine_scales_the_loss_only_dynamically_and_at_a_scale_of_at_least_one():
    from types import SimpleNamespace as NS

    def engine(**config):
        return NS(optimizer=NS(loss_scale_config=NS(**config)))

    assert deepspeed_scaling_loss(engine(dynamic_loss_scale=True, cur_scale=2.0**16))
    assert not deepspeed_scaling_loss(engine(dynamic_loss_scale=True, cur_scale=0.5))
    assert not deepspeed_scaling_loss(engine(dynamic_loss_scale=False, cur_scale=2.0**16))
    assert not deepspeed_scaling_loss(NS(optimizer=NS()))  # bf16: no loss scale
    assert deepspeed_scaling_loss(NS(optimizer=NS(dynamic_loss_scale=True, cur_scale=4.0)))  # DeepSpeed < 0.18


def test_lwm_turns_on_deepspeeds_bf16_overflow_check_which_its_zero_optimizer_then_reads():
    """DeepSpeed 0.19.2 (lwm's minimum) skips a bf16 step with a NaN/inf gradient only with bf16.check_grad_overflow,
    off by default there: lwm writes it into the strategy's config, and Lightning's formatting keeps it."""
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision
    from lightning.pytorch.strategies import DeepSpeedStrategy

    bf16 = {"enabled": True, "check_grad_overflow": True}
    for precision, expected in (("bf16-mixed", bf16), ("bf16-true", bf16), ("32-true", None)):
        strategy = DeepSpeedStrategy(stage=2)
        strategy.precision_plugin = DeepSpeedPrecision(precision)
        deepspeed_checks_overflow(strategy)
        strategy._format_config()  # what Lightning does at setup
        assert strategy.config.get("bf16") == expected
    from deepspeed.runtime.precision_config import get_bfloat16_config

    assert get_bfloat16_config({"bf16": {"enabled": True, "check_grad_overflow": True}}).check_grad_overflow is True
    own = DeepSpeedStrategy(config={"bf16": {"enabled": True, "check_grad_overflow": False}})  # a config's own: kept
    own.precision_plugin = DeepSpeedPrecision("bf16-mixed")
    deepspeed_checks_overflow(own)
    assert own.config["bf16"]["check_grad_overflow"] is False


def test_a_deepspeed_bf16_engine_that_would_apply_a_nan_update_is_refused():
    optimizer = SimpleNamespace(check_grad_overflow=False)
    trainer = SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=SimpleNamespace(
        optimizer=optimizer, bfloat16_enabled=lambda: True)))
    with pytest.raises(ConfigError, match="check_grad_overflow off: a NaN/inf gradient would update the weights"):
        check_deepspeed_skips_overflow(trainer)
    optimizer.check_grad_overflow = True
    check_deepspeed_skips_overflow(trainer)
    check_deepspeed_skips_overflow(SimpleNamespace(strategy=SimpleNamespace()))  # not DeepSpeed: nothing to check
    # fp32: DeepSpeed's ZeRO optimizer has no overflow check there, and skips a step whose gradient norm is not
    # finite (its compute_grad_norm, on by default): not refused
    fp32 = SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=SimpleNamespace(
        optimizer=SimpleNamespace(check_grad_overflow=False), bfloat16_enabled=lambda: False)))
    check_deepspeed_skips_overflow(fp32)


def test_the_longest_unread_run_survives_a_checkpoint():
    """The device path reads its longest run at the logging interval: one that a checkpoint caught before that read
    is read first after the resume (3 NaN steps, saved, restored: the read says 3)."""
    skips = SkippedSteps()
    for _ in range(3):
        skips.on_device(torch.tensor(True))
    skips.on_device(torch.tensor(False))  # the run ended before any read
    state = skips.state()
    assert state == {"total": 3, "in_a_row": 0, "longest_unread": 3}
    assert SkippedSteps(**state).state() == state  # saved again before its read (a checkpoint every step): kept
    resumed = SkippedSteps(**state)
    assert resumed.in_a_row_on_device() == 3 and resumed.in_a_row_on_device() == 0

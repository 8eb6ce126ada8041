"""Resuming continues the run exactly: training 2N steps equals N steps, a stop, `--ckpt_path last`, N more."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.helpers import SimulatedCrash, make_dataset, process_starts, read_metrics, run, train_series


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])  # with workers, batches are drawn ahead of the training step
def test_stop_and_resume_equals_uninterrupted(tmp_path, workers):
    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=16", "--checkpoint.every_n_train_steps=7", "--data.val_size_percent=0",
              f"--data.num_workers={workers}"]
    assert run(manifest, tmp_path / "a", *common) == 0
    crash = ["--trainer.callbacks+=tests.lightning.helpers.CrashAtStep", "--trainer.callbacks.step=7"]
    with pytest.raises(SimulatedCrash):  # mid-epoch (7 batches in, epochs of 5), after the step-7 checkpoint
        run(manifest, tmp_path / "b", *common, *crash)
    assert run(manifest, tmp_path / "b", *common, "--ckpt_path=last") == 0

    full, resumed = train_series(tmp_path / "a"), train_series(tmp_path / "b")
    assert sorted(full) == list(range(16)) and sorted(resumed) == list(range(16))
    assert process_starts(tmp_path / "b") == [0]  # resumed at step 7, where the crash left off (not afresh)
    assert torch.allclose(torch.tensor([resumed[s] for s in range(16)]), torch.tensor([full[s] for s in range(16)]),
                          rtol=1e-5, atol=1e-7)
    a = torch.load(tmp_path / "a/checkpoints/last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 16
    for key, value in a["state_dict"].items():  # weights and codebook buffers (EMA counts, sums, dead-code clocks)
        assert torch.allclose(value.float(), b["state_dict"][key].float(), rtol=1e-4, atol=1e-6), key


@pytest.mark.slow
def test_extending_a_finished_run_equals_the_longer_run(tmp_path):
    """A run that ended at max_steps (mid-epoch, no step checkpoint there), extended with a larger max_steps and
    --ckpt_path last, draws the batches and logs the steps (training and validation) of the longer run. The
    tiny config's schedule is still in its warmup at these steps, so the longer cosine does not differ yet."""
    manifest = make_dataset(tmp_path / "data")
    common = ["--checkpoint.every_n_train_steps=5", "--trainer.val_check_interval=3"]
    assert run(manifest, tmp_path / "a", "--trainer.max_steps=9", *common) == 0
    assert run(manifest, tmp_path / "b", "--trainer.max_steps=7", *common) == 0
    with pytest.warns(UserWarning, match=r"trainer.max_steps=5 is below the step of .*last.ckpt, 7: nothing is "
                                         r"trained \(a larger max_steps extends the run\)"):
        assert run(manifest, tmp_path / "b", "--trainer.max_steps=5", "--ckpt_path=last", *common) == 0
    assert run(manifest, tmp_path / "b", "--trainer.max_steps=9", "--ckpt_path=last", *common) == 0
    assert process_starts(tmp_path / "b") == [0]
    for key in ("Train_Total/loss", "Val_Total/loss"):
        full, extended = train_series(tmp_path / "a", key), train_series(tmp_path / "b", key)
        assert sorted(extended) == sorted(full), key
        assert torch.allclose(torch.tensor([extended[s] for s in sorted(full)]),
                              torch.tensor([full[s] for s in sorted(full)]), rtol=1e-5, atol=1e-7), key


@pytest.mark.slow
def test_the_final_step_gets_its_step_checkpoint_too(tmp_path):
    """A run ending at max_steps on an epoch's last batch (where Lightning defers the step checkpoint to the
    validation after it) writes it, and so does its extension."""
    import os

    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches
    common = ["--checkpoint.every_n_train_steps=5", "--data.val_size_percent=0.5"]
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=10", *common) == 0
    names = sorted(n for n in os.listdir(tmp_path / "run/checkpoints") if n.endswith(".ckpt"))
    assert names == ["last.ckpt", "step=0000005.ckpt", "step=0000010.ckpt"]
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=15", "--ckpt_path=last", *common) == 0
    assert "step=0000015.ckpt" in os.listdir(tmp_path / "run/checkpoints")
    assert process_starts(tmp_path / "run") == [0]
    for name in ("step=0000010.ckpt", "step=0000015.ckpt"):
        assert torch.load(tmp_path / "run/checkpoints" / name, weights_only=True)["global_step"] == int(name[5:12])


@pytest.mark.slow
def test_the_final_step_checkpoint_ranked_by_a_validation_metric_gets_the_fresh_value(tmp_path):
    import os

    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches: validation after steps 5 and 10
    common = ["--checkpoint.every_n_train_steps=5", "--data.val_size_percent=0.5", "--checkpoint.monitor=Val_Total/loss",
              "--checkpoint.mode=min", "--checkpoint.filename={step:07d}-{Val_Total/loss:.6f}"]
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=10", *common) == 0
    names = sorted(n for n in os.listdir(tmp_path / "run/checkpoints") if n.endswith(".ckpt") and n != "last.ckpt")
    val = {int(r["step"]): r["Val_Total/loss"] for r in read_metrics(tmp_path / "run") if "Val_Total/loss" in r}
    assert [int(n[:7]) for n in names] == [5, 10], names
    for name in names:  # each file carries the validation right after its step (logged one step lower)
        step, loss = int(name[:7]), float(name[8:].removesuffix(".ckpt"))
        assert abs(loss - val[step - 1]) < 1e-6, (name, val[step - 1])


def _step_checkpoints(folder) -> list[int]:
    return sorted(int(n.split("=")[1].split("-")[0].removesuffix(".ckpt")) if n.startswith("step=") else int(n[:7])
                  for n in (p.name for p in folder.glob("*.ckpt")) if n != "last.ckpt")


@pytest.mark.slow
def test_step_checkpoints_on_an_epochs_last_batch_are_written_with_step_based_validation(tmp_path):
    """Validation every 1000 steps across epochs (check_val_every_n_epoch: null), a checkpoint every 5 steps on
    epochs of 5 batches: each falls on an epoch's last batch, which Lightning defers to a validation that does not
    follow. They are written there; a crash later resumes from the newest one."""
    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches
    common = ["--trainer.check_val_every_n_epoch=null", "--trainer.val_check_interval=1000",
              "--checkpoint.every_n_train_steps=5", "--checkpoint.save_top_k=-1", "--trainer.max_steps=20"]
    crash = ["--trainer.callbacks+=tests.lightning.helpers.CrashAtStep", "--trainer.callbacks.step=11"]
    with pytest.raises(SimulatedCrash):
        run(manifest, tmp_path / "run", *common, *crash)
    assert _step_checkpoints(tmp_path / "run/checkpoints") == [5, 10]
    assert torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] == 10
    assert run(manifest, tmp_path / "run", *common, "--ckpt_path=last") == 0
    assert _step_checkpoints(tmp_path / "run/checkpoints") == [5, 10, 15, 20]
    assert process_starts(tmp_path / "run") == [0, 10]  # step 10 logged by the crashed run, then from its checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("where", ["epoch_end", "mid_epoch", "every_step"])
def test_a_crash_in_the_validation_after_a_step_checkpoint_loses_no_validation(tmp_path, where):
    """A validation after the batch a checkpoint is due at, on an epoch's last batch (after steps 5, 10, 15) or
    mid-epoch (after steps 3, 6, 9: Lightning writes that one before the validation; or a checkpoint every step,
    a validation every 2): it is written after that validation, so a crash during the validation resumes from the
    checkpoint before and redoes the steps and the validation: the resumed run's series (training and validation)
    equal the uninterrupted run's."""
    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches
    every, val, crash_at, steps = {"epoch_end": (5, 5, 10, 15), "mid_epoch": (3, 3, 6, 9),
                                   "every_step": (1, 2, 4, 6)}[where]
    common = [f"--trainer.val_check_interval={val}", f"--checkpoint.every_n_train_steps={every}",
              f"--trainer.max_steps={steps}", "--data.val_size_percent=0.5"]
    if where != "epoch_end":
        common.append("--trainer.check_val_every_n_epoch=null")  # every `val` steps across epochs
    assert run(manifest, tmp_path / "a", *common) == 0
    crash = ["--trainer.callbacks+=tests.lightning.helpers.CrashAtStep", f"--trainer.callbacks.step={crash_at}",
             "--trainer.callbacks.during=validation"]
    with pytest.raises(SimulatedCrash):
        run(manifest, tmp_path / "b", *common, *crash)
    before = crash_at - every  # the checkpoint before the crashed validation's step
    assert _step_checkpoints(tmp_path / "b/checkpoints") == list(range(every, before + 1, every))
    assert torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=True)["global_step"] == before
    assert run(manifest, tmp_path / "b", *common, "--ckpt_path=last") == 0
    assert process_starts(tmp_path / "b") == [0, before]
    assert _step_checkpoints(tmp_path / "b/checkpoints")[-1] == steps
    for key in ("Train_Total/loss", "Val_Total/loss"):
        full, resumed = train_series(tmp_path / "a", key), train_series(tmp_path / "b", key)
        assert sorted(resumed) == sorted(full), key
        assert torch.allclose(torch.tensor([resumed[s] for s in sorted(full)]),
                              torch.tensor([full[s] for s in sorted(full)]), rtol=1e-5, atol=1e-7), key


def test_timed_validation_keeps_lightnings_deferral():
    """With val_check_interval a duration, a validation may fall due during the save itself (and on each rank's
    own clock): the checkpoint waits for it, as in Lightning."""
    from types import SimpleNamespace

    from lwm.training.trainer_state import validation_follows

    timed = SimpleNamespace(enable_validation=True, num_val_batches=[2], check_val_every_n_epoch=None,
                            current_epoch=0, should_stop=False, val_check_batch=None)  # Lightning's: None when timed
    assert validation_follows(timed)


@pytest.mark.slow
def test_a_checkpoint_ranked_by_a_validation_metric_waits_only_for_a_validation_that_follows(tmp_path):
    """Validation after steps 7 and 14 (check_val_every_n_epoch: null): the step-5 checkpoint waits for the first
    validation (no metric to rank it by before it), the step-10 one (an epoch's last batch, no validation after it)
    is written at step 10 with the step-7 value, not at step 14."""
    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches
    common = ["--trainer.check_val_every_n_epoch=null", "--trainer.val_check_interval=7",
              "--data.val_size_percent=0.5", "--checkpoint.every_n_train_steps=5", "--checkpoint.save_top_k=-1",
              "--checkpoint.monitor=Val_Total/loss", "--checkpoint.mode=min",
              "--checkpoint.filename={step:07d}-{Val_Total/loss:.6f}", "--trainer.max_steps=12"]
    assert run(manifest, tmp_path / "run", *common) == 0
    names = sorted(p.name for p in (tmp_path / "run/checkpoints").glob("0*.ckpt"))
    val = {int(r["step"]): r["Val_Total/loss"] for r in read_metrics(tmp_path / "run") if "Val_Total/loss" in r}
    assert [int(n[:7]) for n in names] == [7, 10], names
    assert abs(float(names[1][8:].removesuffix(".ckpt")) - val[6]) < 1e-6  # the validation after step 7


@pytest.mark.slow
def test_resume_with_gradient_accumulation_and_revival_every_step(tmp_path):
    """With ``accumulate_grad_batches`` and a revival at every optimizer step, a resumed run revives at the
    same steps as an uninterrupted one (never after the first micro-batch of a restarted process)."""
    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.accumulate_grad_batches=2", "--revival.every_n_steps=1", "--model.net.dead_code_steps=2",
              "--data.val_size_percent=0", "--checkpoint.every_n_train_steps=100"]
    assert run(manifest, tmp_path / "a", *common, "--trainer.max_steps=6") == 0
    assert run(manifest, tmp_path / "b", *common, "--trainer.max_steps=3") == 0
    assert run(manifest, tmp_path / "b", *common, "--trainer.max_steps=6", "--ckpt_path=last") == 0
    full, resumed = train_series(tmp_path / "a"), train_series(tmp_path / "b")
    assert sorted(full) == sorted(resumed) == list(range(6)) and process_starts(tmp_path / "b") == [0]
    assert torch.allclose(torch.tensor([resumed[s] for s in range(6)]), torch.tensor([full[s] for s in range(6)]),
                          rtol=1e-5, atol=1e-7)
    a = torch.load(tmp_path / "a/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    for key, value in a.items():
        assert torch.allclose(value.float(), b[key].float(), rtol=1e-4, atol=1e-6), key


@pytest.mark.slow
def test_a_resume_with_another_batch_size_finishes_the_epoch_at_the_same_batch_index(tmp_path):
    """Stopped after 3 of 4 batches of 3 windows; resumed with batches of 2 (7 an epoch): the epoch goes on with
    batches 3 to 6 (Lightning's count and the sampler's agree), then epoch 1; the warning says so."""
    manifest = make_dataset(tmp_path / "data")  # 7 training files of 2 windows: 14 windows
    common = ["--data.val_size_percent=0", "--checkpoint.every_n_train_steps=3", "--trainer.log_every_n_steps=1"]
    assert run(manifest, tmp_path / "r", *common, "--data.batch_size=3", "--trainer.max_steps=3") == 0
    with pytest.warns(UserWarning, match=r"global batch of 2 windows \(batch_size x ranks\), the checkpoint's run "
                                         r"had 3: epoch 0 continues at batch 3 of this run's 7"):
        assert run(manifest, tmp_path / "r", *common, "--data.batch_size=2", "--trainer.max_steps=8",
                   "--ckpt_path=last") == 0
    epochs = {int(r["step"]): int(r["epoch"]) for r in read_metrics(tmp_path / "r") if "epoch" in r}
    assert [epochs[s] for s in range(8)] == [0] * 7 + [1]


@pytest.mark.slow
def test_a_resume_with_another_seed_validates_as_the_uninterrupted_run(tmp_path):
    """Resumed with another data.seed, the run keeps the checkpoint's (as the warning says) for its training
    batches and for its validation subset (half the windows: a seeded draw): its losses and validation values
    are the uninterrupted run's. `lwm validate --ckpt_path last` with that seed reports the fit's last
    validation value (the windows the checkpoint's run validated on)."""
    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.val_check_interval=3", "--data.val_size_percent=0.5", "--checkpoint.every_n_train_steps=100"]
    assert run(manifest, tmp_path / "a", *common, "--trainer.max_steps=8") == 0
    assert run(manifest, tmp_path / "b", *common, "--trainer.max_steps=4") == 0
    with pytest.warns(UserWarning, match=r"data.seed=5 differs from the checkpoint's sampler seed 0: the resumed run "
                                         r"keeps drawing the checkpoint's batches and validation windows"):
        assert run(manifest, tmp_path / "b", *common, "--trainer.max_steps=8", "--data.seed=5",
                   "--ckpt_path=last") == 0
    for key in ("Train_Total/loss", "Val_Total/loss"):
        full, resumed = train_series(tmp_path / "a", key), train_series(tmp_path / "b", key)
        assert sorted(resumed) == sorted(full) == (list(range(8)) if key.startswith("Train") else [2, 7]), key
        assert torch.allclose(torch.tensor([resumed[s] for s in sorted(full)]),
                              torch.tensor([full[s] for s in sorted(full)]), rtol=1e-5, atol=1e-7), key
    assert run(manifest, tmp_path / "b", "--data.val_size_percent=0.5", "--data.seed=5", "--ckpt_path=last",
               verb="validate") == 0
    validated = [r["Val_Total/loss"] for r in read_metrics(tmp_path / "b/validate") if "Val_Total/loss" in r]
    assert validated == [pytest.approx(train_series(tmp_path / "a", "Val_Total/loss")[7], rel=1e-5)]


SLURM_ENV = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "1",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("during", ["validation", "training"])
def test_a_preemption_saves_at_the_next_batch_end_runs_no_more_validation_and_resumes_exactly(
        tmp_path, monkeypatch, during):
    """SIGTERM under SLURM in the middle of a validation (which can outlast the grace time), or in the training
    batch before one: the training state is saved at that batch's end and the fit ends without running (the
    rest of) the validation; the resumed run trains exactly as an uninterrupted one (the cut validation is not
    logged)."""
    from tests.lightning.helpers import SendSignal

    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=8", "--trainer.val_check_interval=3", "--checkpoint.every_n_train_steps=100",
              "--data.val_batch_size=1"]  # several validation batches
    assert run(manifest, tmp_path / "a", *common) == 0
    for name, value in SLURM_ENV.items():
        monkeypatch.setenv(name, value)
    signal = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal",
              f"--trainer.callbacks.step={3 if during == 'validation' else 2}", f"--trainer.callbacks.during={during}"]
    assert run(manifest, tmp_path / "b", *common, *signal) == 0
    assert SendSignal.validation_batches_after == []  # stopped at the batch where the signal came
    saved = torch.load(tmp_path / "b/hpc_ckpt_1.ckpt", weights_only=True)
    last = torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=True)
    assert saved["global_step"] == last["global_step"] == 3
    assert run(manifest, tmp_path / "b", *common, "--ckpt_path=last") == 0

    full, resumed = train_series(tmp_path / "a"), train_series(tmp_path / "b")
    assert sorted(full) == sorted(resumed) == list(range(8))
    assert process_starts(tmp_path / "b") == [0]  # at step 3, where the stopped run left off
    assert torch.allclose(torch.tensor([resumed[s] for s in range(8)]), torch.tensor([full[s] for s in range(8)]),
                          rtol=1e-5, atol=1e-7)
    full_val, resumed_val = train_series(tmp_path / "a", "Val_Total/loss"), train_series(tmp_path / "b", "Val_Total/loss")
    # validations after steps 3 and 8 (logged one lower); the cut one is not logged, the next one matches
    assert sorted(full_val) == [2, 7] and sorted(resumed_val) == [7]
    assert resumed_val[7] == pytest.approx(full_val[7], rel=1e-5)


@pytest.mark.slow
def test_a_slurm_restart_without_ckpt_path_resumes_from_the_latest_checkpoint_not_an_older_hpc_one(
        tmp_path, monkeypatch):
    """Preempted at step 4 (hpc_ckpt_1.ckpt), requeued, trained on to step 10, then the node died (no signal, no
    new hpc file): a plain `lwm fit` under SLURM resumes from last.ckpt of step 10 (Lightning's own choice, the
    highest-numbered hpc file, would redo steps 4 to 10)."""
    for name, value in SLURM_ENV.items():
        monkeypatch.setenv(name, value)
    manifest = make_dataset(tmp_path / "data")
    root = tmp_path / "run"
    common = ["--trainer.max_steps=12", "--checkpoint.every_n_train_steps=5", "--data.val_size_percent=0"]
    signal = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal", "--trainer.callbacks.step=3",
              "--trainer.callbacks.during=training"]
    assert run(manifest, root, *common, *signal) == 0  # SIGTERM under SLURM: hpc_ckpt_1.ckpt of step 4
    crash = ["--trainer.callbacks+=tests.lightning.helpers.CrashAtStep", "--trainer.callbacks.step=10"]
    with pytest.raises(SimulatedCrash):
        run(manifest, root, *common, *crash)
    step = lambda path: torch.load(path, weights_only=True)["global_step"]  # noqa: E731
    assert step(root / "hpc_ckpt_1.ckpt") == 4 and step(root / "checkpoints/last.ckpt") == 10
    assert run(manifest, root, *common) == 0
    assert process_starts(root) == [0]  # each start where the one before left off: none from step 4 again
    assert sorted(train_series(root)) == list(range(12))


@pytest.mark.slow
def test_a_preemption_at_a_due_step_on_an_epochs_last_batch_writes_that_step_checkpoint(tmp_path, monkeypatch):
    """SIGTERM under SLURM in the training batch that makes step 5, the last of an epoch of 5 with checkpoints every
    5 steps (Lightning defers such a step file to the validation after it, which the stop skips): the stop writes
    step=0000005.ckpt as well as last.ckpt and the hpc file."""
    for name, value in SLURM_ENV.items():
        monkeypatch.setenv(name, value)
    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches
    signal = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal", "--trainer.callbacks.step=4",
              "--trainer.callbacks.during=training"]
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=12", "--checkpoint.every_n_train_steps=5",
               *signal) == 0
    ckpts = tmp_path / "run/checkpoints"
    step = lambda path: torch.load(path, weights_only=True)["global_step"]  # noqa: E731
    assert step(ckpts / "step=0000005.ckpt") == step(ckpts / "last.ckpt") == step(tmp_path / "run/hpc_ckpt_1.ckpt") == 5


@pytest.mark.slow
def test_a_ctrl_c_before_the_training_steps_exits_130_with_one_line(tmp_path, capsys):
    """Before lwm's handler is in (the fit loading its data, starting wandb), Ctrl-C is Python's KeyboardInterrupt:
    Lightning exited 1 after its 'Detected KeyboardInterrupt', where docs/training.md promises 130."""
    manifest = make_dataset(tmp_path / "data", files=4)
    interrupt = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal", "--trainer.callbacks.step=0",
                 "--trainer.callbacks.during=setup"]
    import signal

    handler = signal.getsignal(signal.SIGINT)
    off = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal", "--trainer.callbacks.step=2",
           "--trainer.callbacks.during=training", "--trainer.callbacks.name=SIGINT", "--slurm_requeue.interrupts=false"]
    try:
        assert run(manifest, tmp_path / "run", *interrupt) == 130
        err = capsys.readouterr().err
        signal.signal(signal.SIGINT, handler)
        # with lwm's handling off (Lightning's: Python's KeyboardInterrupt mid-training), said so
        assert run(manifest, tmp_path / "off", *off) == 130
    finally:  # (Lightning ignores SIGINT from its KeyboardInterrupt on: this process's next fits need it)
        signal.signal(signal.SIGINT, handler)
    assert "SIGINT: stopping now, before the training steps (nothing saved)" in err
    assert "Detected KeyboardInterrupt" not in err  # (Lightning's line: lwm's says it)
    assert "SIGINT: stopping now (slurm_requeue.interrupts=false: nothing saved)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_an_interrupt_outside_slurm_saves_last_ckpt_at_the_batch_end_and_resumes_exactly(tmp_path, name):
    """Ctrl-C or kill outside SLURM: last.ckpt is written at the end of that batch (no hpc checkpoint), the fit
    stops with 128 + the signal's number, no validation started, and --ckpt_path last continues exactly."""
    import signal as signals

    from tests.lightning.helpers import SendSignal

    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=8", "--trainer.val_check_interval=3", "--checkpoint.every_n_train_steps=100",
              "--data.num_workers=1"]  # a worker too: Ctrl-C reaches it as well (it ignores it)
    assert run(manifest, tmp_path / "a", *common) == 0
    signal = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal", "--trainer.callbacks.step=2",
              "--trainer.callbacks.during=training", f"--trainer.callbacks.name={name}"]
    assert run(manifest, tmp_path / "b", *common, *signal) == 128 + getattr(signals, name)
    assert SendSignal.validation_batches_after == []  # (the validation after step 3: not started)
    assert torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=True)["global_step"] == 3
    assert not list((tmp_path / "b").glob("hpc_ckpt_*.ckpt"))
    assert run(manifest, tmp_path / "b", *common, "--ckpt_path=last") == 0
    full, resumed = train_series(tmp_path / "a"), train_series(tmp_path / "b")
    assert sorted(full) == sorted(resumed) == list(range(8))
    assert process_starts(tmp_path / "b") == [0]  # at step 3, where the stopped run left off
    assert torch.allclose(torch.tensor([resumed[s] for s in range(8)]), torch.tensor([full[s] for s in range(8)]),
                          rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_an_interrupt_in_a_validation_inside_an_accumulation_window_saves_at_the_windows_end(tmp_path):
    """With accumulate_grad_batches=2 and a validation after every batch (epochs of 5 batches), Ctrl-C at the
    first batch of step 3 (epoch 1's first) comes before the validation after that batch, inside the window:
    that validation runs to its end, the window's last batch saves (step 4, not a half-accumulated step 3) and
    the resumed run trains as the uninterrupted one, loss for loss and weight for weight."""
    import signal as signals

    from tests.lightning.helpers import SendSignal

    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=6", "--trainer.accumulate_grad_batches=2", "--trainer.val_check_interval=1",
              "--checkpoint.every_n_train_steps=100", "--data.val_size_percent=0.5", "--data.val_batch_size=1"]
    assert run(manifest, tmp_path / "a", *common) == 0
    signal = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal", "--trainer.callbacks.step=3",
              "--trainer.callbacks.during=training", "--trainer.callbacks.name=SIGINT"]
    assert run(manifest, tmp_path / "b", *common, *signal) == 128 + signals.SIGINT
    assert SendSignal.validation_batches_after == [0, 1, 2]  # the validation inside the window, whole; none after
    assert torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=True)["global_step"] == 4
    assert run(manifest, tmp_path / "b", *common, "--ckpt_path=last") == 0
    full, resumed = train_series(tmp_path / "a"), train_series(tmp_path / "b")
    assert sorted(full) == sorted(resumed) == list(range(6))
    assert process_starts(tmp_path / "b") == [0]
    assert torch.allclose(torch.tensor([resumed[s] for s in range(6)]), torch.tensor([full[s] for s in range(6)]),
                          rtol=1e-5, atol=1e-7)
    a = torch.load(tmp_path / "a/checkpoints/last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "b/checkpoints/last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 6
    for key, value in a["state_dict"].items():
        assert torch.allclose(value.float(), b["state_dict"][key].float(), rtol=1e-4, atol=1e-6), key


@pytest.mark.slow
def test_a_resume_with_another_checkpoint_interval_keeps_ranking_the_step_files(tmp_path, recwarn):
    """Step files every 2 steps, then resumed with one every 3: the 3 most recent (by step) are kept across both,
    the earlier ones removed, and Lightning does not ask for the old callback."""
    manifest = make_dataset(tmp_path / "data")
    common = ["--data.val_size_percent=0", "--checkpoint.save_top_k=3"]
    assert run(manifest, tmp_path / "run", *common, "--checkpoint.every_n_train_steps=2", "--trainer.max_steps=4") == 0
    assert _step_checkpoints(tmp_path / "run/checkpoints") == [2, 4]
    assert run(manifest, tmp_path / "run", *common, "--checkpoint.every_n_train_steps=3", "--trainer.max_steps=12",
               "--ckpt_path=last") == 0
    assert _step_checkpoints(tmp_path / "run/checkpoints") == [6, 9, 12]
    assert not [w for w in recwarn if "callbacks used to create the checkpoint" in str(w.message)]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mid_epoch", "epoch_end"])
def test_a_resume_from_a_validations_end_with_another_validation_schedule_logs_every_step_once(tmp_path, where):
    """The step checkpoint written at the end of the validation after step 3 (every 3 steps) or 5 (each epoch's
    end), resumed with a schedule that does not validate there: the resumed run logs the next step as the next
    step (Lightning counted that batch's logged step only where it skipped the validation again: one too low)."""
    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches
    every = 3 if where == "mid_epoch" else 5
    common = ["--data.val_size_percent=0.5", f"--checkpoint.every_n_train_steps={every}", "--trainer.max_steps=8",
              "--trainer.log_every_n_steps=1"]
    schedule = (["--trainer.check_val_every_n_epoch=null"] if where == "mid_epoch" else [])
    crash = ["--trainer.callbacks+=tests.lightning.helpers.CrashAtStep", f"--trainer.callbacks.step={every + 1}"]
    with pytest.raises(SimulatedCrash):
        run(manifest, tmp_path / "run", *common, *schedule, f"--trainer.val_check_interval={every}", *crash)
    assert torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] == every
    assert run(manifest, tmp_path / "run", *common, *schedule, "--trainer.val_check_interval=2",
               "--ckpt_path=last") == 0
    assert process_starts(tmp_path / "run") == [0, every]
    assert sorted(train_series(tmp_path / "run")) == list(range(8))


@pytest.mark.slow
def test_a_second_step_checkpoint_callback_of_other_files_keeps_its_own_state(tmp_path):
    """The default rolling step files, plus one every 4 steps kept forever in another folder (the same monitor):
    both run, and a resume finds each one's state."""
    manifest = make_dataset(tmp_path / "data")
    keep = tmp_path / "keep"
    common = ["--data.val_size_percent=0", "--checkpoint.every_n_train_steps=2", "--checkpoint.save_top_k=1",
              "--trainer.callbacks+=lwm.training.checkpoint.ModelCheckpoint", "--trainer.callbacks.monitor=step",
              "--trainer.callbacks.mode=max", "--trainer.callbacks.every_n_train_steps=4",
              "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={keep}",
              "--trainer.callbacks.filename=step={step:07d}", "--trainer.callbacks.auto_insert_metric_name=false"]
    assert run(manifest, tmp_path / "run", *common, "--trainer.max_steps=4") == 0
    assert run(manifest, tmp_path / "run", *common, "--trainer.max_steps=8", "--ckpt_path=last") == 0
    assert _step_checkpoints(tmp_path / "run/checkpoints") == [8]
    assert _step_checkpoints(keep) == [4, 8]
    states = [k for k in torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["callbacks"]
              if k.startswith("ModelCheckpoint")]
    assert len(states) == 2


@pytest.mark.slow
def test_a_checkpoint_at_the_end_of_a_validation_after_an_accumulating_batch_leaves_one_row_per_step(tmp_path):
    """With gradient accumulation a validation can follow a batch that did not step (no training row yet at its
    step): the checkpoint written at its end does not write that step's row early (a second, partial row of the
    step would follow, and readers keep the last)."""
    import csv

    manifest = make_dataset(tmp_path / "data")
    assert run(manifest, tmp_path / "run", "--trainer.accumulate_grad_batches=2", "--trainer.val_check_interval=3",
               "--trainer.check_val_every_n_epoch=null", "--checkpoint.monitor=Val_Total/loss",
               "--checkpoint.mode=min", "--checkpoint.every_n_train_steps=1", "--trainer.max_steps=6",
               "--trainer.log_every_n_steps=1", "--data.val_size_percent=0.5") == 0
    with open(tmp_path / "run/metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert len(steps) == len(set(steps)), steps
    assert sorted(train_series(tmp_path / "run", "Val_Total/loss"))  # validations ran, and were logged

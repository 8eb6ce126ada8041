from types import SimpleNamespace

import pytest

from lwm.callbacks.progress import StepProgressBar


def _description(max_epochs, max_steps, global_step=7):
    trainer = SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps, global_step=global_step, current_epoch=3)
    return StepProgressBar().train_description(trainer)


def test_step_based_runs_show_the_step_not_a_negative_epoch_count():
    assert _description(-1, 100).strip() == "Epoch 3 · step 7/100"
    assert _description(10, -1).strip() == "Epoch 3/9"


def test_validations_leave_no_hidden_tasks_behind(tmp_path):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    bar, tasks = StepProgressBar(), []

    class CountTasks(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            tasks.append(len(bar.progress.tasks))

    trainer = L.Trainer(max_steps=6, val_check_interval=1, limit_val_batches=2, callbacks=[bar, CountTasks()],
                        logger=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                        accelerator="cpu")
    trainer.fit(BoringModel())
    assert tasks == [1] + [3] * 6  # the sanity check's; then it, training's and the latest validation's


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_counts_its_epoch_to_its_end(tmp_path):
    """Resumed at step 5 of 32-batch epochs with max_steps 12: the bar counts batches 6..12 of 12 (Lightning's
    counted from batch 5 on to a total of the 7 remaining steps, and ran past it)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    def fit(max_steps, ckpt_path=None):
        bar, seen = StepProgressBar(), []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                task = bar.progress.tasks[bar.train_progress_bar_id]
                seen.append((int(task.completed), task.total))

        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
        trainer = L.Trainer(max_steps=max_steps, limit_val_batches=0, callbacks=[bar, Record(), checkpoint],
                            logger=False, enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        return seen

    assert fit(5) == [(i, 5) for i in range(1, 6)]  # as far as max_steps ends the epoch
    assert fit(12, ckpt_path=tmp_path / "epoch=0-step=5.ckpt") == [(i, 12) for i in range(6, 13)]


def test_the_progress_line_and_the_summary_say_the_skipped_steps():
    """A run skipping non-finite steps says so where it is watched (steps skipped silently were only in metrics.csv)."""
    from lwm.callbacks.progress import fit_summary

    def trainer(skipped):
        return SimpleNamespace(max_steps=100, global_step=40, current_epoch=1, callback_metrics={},
                               lightning_module=SimpleNamespace(skipped_steps=skipped), checkpoint_callback=None)

    bar = StepProgressBar()
    bar._start = (0.0, 20)
    line = bar.progress_line(trainer(3), now=10.0)
    assert line == "step 40/100 · epoch 1 · 2 steps/s · 3 steps skipped (non-finite loss or gradient) · 0:00:10 " \
                   "elapsed, 0:00:30 to go", line
    assert "skipped" not in bar.progress_line(trainer(0), now=10.0)
    assert fit_summary(trainer(1), 70.0) == "fit done: step 40/100 in 0:01:10 · 1 step skipped (non-finite loss or " \
                                            "gradient)"
    assert "skipped" not in fit_summary(trainer(0), 70.0)

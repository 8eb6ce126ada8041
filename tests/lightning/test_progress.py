from types import SimpleNamespace

from lwm.callbacks.progress import StepProgressBar


def _description(max_epochs, max_steps, global_step=7):
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps, global_step=global_step)
    return bar._get_train_description(3)


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

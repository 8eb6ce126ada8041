from types import SimpleNamespace

from lwm.callbacks.progress import StepProgressBar


def _description(max_epochs, max_steps, global_step=7):
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps, global_step=global_step)
    return bar._get_train_description(3)


def test_step_based_runs_show_the_step_not_a_negative_epoch_count():
    assert _description(-1, 100).strip() == "Epoch 3 · step 7/100"
    assert _description(10, -1).strip() == "Epoch 3/9"

"""Bad settings through `lwm fit`: one `error:` line naming the config key as users type it, before any work
(no config.yaml, no checkpoint, no metrics.csv), instead of a traceback, a crash mid-run or a silently empty log."""

from __future__ import annotations

import pytest

from tests.lightning.helpers import make_dataset, run


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), files=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # non-finite numbers passed the `<= 0` checks (lr=inf NaNs every weight at step 0)
        (["--model.optim.lr=.inf"], "model.optim.lr must be a finite number, got inf"),
        (["--model.net.rollout_weights=[1, .inf]"], "model.net.rollout_weights must be finite numbers, got (1.0, inf)"),
        (["--model.net.mlp_ratio=.inf"], "model.net.mlp_ratio must be a finite number, got inf"),  # OverflowError
        (["--model.net.height=18"], "model.net.height and model.net.width must be positive multiples of 4"),
        # trainer settings Lightning accepts, then divides by (ZeroDivisionError) or logs nothing with
        (["--trainer.val_check_interval=0"], "trainer.val_check_interval must be > 0"),
        (["--trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches must be >= 1"),
        (["--trainer.log_every_n_steps=0"], "trainer.log_every_n_steps must be >= 1"),
        # callbacks: a ValueError traceback, or nothing logged
        (["--revival.every_n_steps=0"], "revival.every_n_steps must be >= 1"),
        (["--flops.peak_tflops=-1"], "flops.peak_tflops must be a finite number > 0"),  # a negative MFU
        (["--probes.max_samples=0"], "probes.max_samples must be >= 4"),  # no probes at all
        (["--sensitivity.t=6", "--wandb.mode=offline"], "sensitivity.t must be < data.window (6: frames 0..5"),  # nothing logged
        (["--progress_bar.refresh_rate=-1"], "progress_bar.refresh_rate must be >= 0"),  # the bar off, silently
        (["--sensitivity.seed=-1"], "sensitivity.seed must be >= 0, got -1"),  # at the first validation
        (["--rollout_videos.fps=100000"], "rollout_videos.fps must be at most 1000, got 100000"),  # PyAV, after it
        (["--model_summary.max_depth=-5", "--trainer.enable_model_summary=true"],
         "model_summary.max_depth must be -1 (all), 0 (none) or > 0, got -5"),  # Lightning's, at the fit's start
        (["--seed_everything=-5"], "Parser key \"seed_everything\": … Given value: -5"),  # numpy's bounds
        # a link to the last step file: stale after a stop on a signal and at the end of fit
        (["--checkpoint.save_last=link"], "checkpoint.save_last=link: lwm needs true"),
        (["--checkpoint.save_last=false"], "checkpoint.save_last=False: lwm needs true"),
        (["--checkpoint.dirpath=${trainer.nothere}/c"], "Interpolation key '..trainer.nothere' not found … "
                                                        "full_key: fit.checkpoint.dirpath"),  # a traceback
        # jsonargparse's own message, on one line: the key, the choices and the value given
        (["--wandb.mode=onlin"], "Parser key \"wandb.mode\": … 'offline' … onlin"),
        (["--trainer.precision=7"], "Parser key \"trainer.precision\": … 'bf16-mixed' … 7"),
        # a negative number in an exponent's form, given apart from its key: argparse took it for an option
        (["--model.optim.lr", "-1e-3"], "model.optim.lr must be > 0, got -0.001"),
        (["--trainer.max_steps=0"], "trainer.max_steps=0: a fit of no step"),  # it ran, and wrote nothing but a config
        # lwm always checkpoints: Lightning's own line
        (["--trainer.enable_checkpointing=false"], "Trainer was configured with `enable_checkpointing=False`"),
    ],
)
def test_bad_setting_is_one_error_line_naming_the_key(manifest, tmp_path, capsys, extra, message):
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=2", *extra) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    first, *rest = message.split(" … ")  # the line starts with the first part and names the others
    assert len(errors) == 1 and errors[0].startswith(f"error: {first}") and all(p in errors[0] for p in rest), errors
    assert "Traceback" not in err
    assert not root.exists() or not any(root.iterdir())  # nothing written (a wandb folder neither)


@pytest.mark.slow
def test_a_checkpoint_dirpath_or_data_setting_found_only_later_is_refused_first(manifest, tmp_path, capsys):
    """A checkpoint folder that is a file failed at the first save, after the training; a negative epoch length
    or an unknown worker start method crashed after config.yaml was written."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for extra, message in (([f"--checkpoint.dirpath={afile}"], f"checkpoint.dirpath={afile}: exists and is not a "
                                                                 "folder"),
                           (["--data.batches_per_epoch=-3"], "data.batches_per_epoch must be >= 1"),
                           (["--data.multiprocessing_context=bogus", "--data.num_workers=1"], "")):
        root = tmp_path / "run"
        assert run(manifest, root, "--trainer.max_steps=2", *extra) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), errors
        assert extra[0].split("=")[0][2:] in errors[0]  # the key it names
        assert not root.exists() or not any(root.iterdir())


@pytest.mark.slow
def test_an_interpolation_names_a_key_of_the_same_config_under_every_verb(manifest, tmp_path, capsys):
    """``${trainer.default_root_dir}`` in a config file (or on the command line) follows the command line's
    override under fit and under our verbs (jsonargparse resolves over ``fit.*`` under lwm fit: it was a traceback);
    an interpolation naming no key is one line."""
    from lwm.cli.main import main
    from lwm.utils.args import relative_interpolations
    from tests.lightning.helpers import TINY

    config = tmp_path / "c.yaml"
    config.write_text("checkpoint:\n  dirpath: ${trainer.default_root_dir}/ckpts\n")
    root = tmp_path / "run"
    assert run(manifest, root, "--config", str(config), "--trainer.max_steps=1") == 0
    assert (root / "ckpts/last.ckpt").is_file() and not (root / "checkpoints").exists()
    capsys.readouterr()
    assert main(["resume-info", "--config", str(TINY), "--config", str(config), f"--trainer.default_root_dir={root}"]) == 0
    assert capsys.readouterr().out.split() == [str(root), str(root / "ckpts/last.ckpt")]

    assert relative_interpolations(["--checkpoint.dirpath=${trainer.default_root_dir}/c", "--a.b", "${a.c}-${x}",
                                    "--e=${oc.env:HOME}", "${trainer.x}"]) == [
        "--checkpoint.dirpath=${..trainer.default_root_dir}/c", "--a.b", "${.c}-${..x}", "--e=${oc.env:HOME}",
        "${trainer.x}"]


def test_a_negative_number_given_apart_from_its_key_joins_it():
    from lwm.utils.args import negative_values_joined

    assert negative_values_joined(["--a", "-1e-3", "--b", "-.5", "-2", "--c=-1", "-x", "--d", "-inf", "--e", "-f"]) == [
        "--a=-1e-3", "--b=-.5", "-2", "--c=-1", "-x", "--d=-inf", "--e", "-f"]


@pytest.mark.slow
@pytest.mark.parametrize(("body", "message"), [
    ("model:\n  net:\n", "model.net is empty, not a section of keys"),  # a TypeError traceback
    ("model:\n  optim: 5\n", "model.optim is 5, not a section of keys"),
    ("model: 5\n", "model is 5, not a section of keys"),
    ("trainer: 5\n", "trainer is 5, not a section of keys"),  # dropped silently: a run on Lightning's defaults
    ("data:\n", "data is empty, not a section of keys"),
])
def test_an_empty_or_single_value_section_of_a_config_file_is_one_line_naming_it(manifest, tmp_path, capsys, body,
                                                                                   message):
    extra = tmp_path / "extra.yaml"
    extra.write_text(body)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=2", f"--config={extra}") == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --config {extra}: {message} (give it keys, or leave it out)"], errors
    assert not root.exists()


def test_an_override_before_a_config_that_sets_the_key_again_is_refused(manifest, tmp_path, capsys):
    """jsonargparse lets the later --config win: the override was lost without a word."""
    from lwm.cli.main import main
    from tests.lightning.helpers import TINY

    root = tmp_path / "run"
    assert main(["fit", "--trainer.max_steps=2", "--config", str(TINY), f"--data.manifest={manifest}",
                 f"--trainer.default_root_dir={root}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --trainer.max_steps comes before --config {TINY}, which sets it again (a later config "
                      f"wins): put the overrides after the --config files"], errors
    assert not root.exists()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--optimizer=SGD"], ["--lr_scheduler=StepLR"]])
def test_lightnings_optimizer_options_are_refused(manifest, tmp_path, capsys, extra):
    """`--optimizer SGD` replaced the module's AdamW, decay groups and schedule with a Lightning warning only."""
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=1", *extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    key = extra[0][2:].split("=")[0]
    assert len(errors) == 1 and errors[0].startswith(f'error: Parser key "{key}": '), errors
    assert not root.exists()


@pytest.mark.slow
def test_a_config_yaml_of_a_run_from_before_keeps_loading(manifest, tmp_path):
    """The config.yaml of runs before lwm left Lightning's optimizer arguments out holds them as null."""
    old = tmp_path / "config.yaml"
    old.write_text("optimizer: null\nlr_scheduler: null\n")
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=1", f"--config={old}") == 0

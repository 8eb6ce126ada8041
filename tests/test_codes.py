"""Code dictionaries: counts on hand-made codes, merging, sampling, the file, and `lwm codes` == the fit callback."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from lwm.cli.main import main
from lwm.inference.dictionary import CodeDictionary, collect, dictionaries_step, load_dictionaries, save_dictionaries
from lwm.utils.errors import DataError
from tests.lightning.helpers import make_dataset, run, tiny_args


def test_counts_of_hand_made_codes():
    d = CodeDictionary((3, 4))
    d.update(torch.tensor([[[0, 1], [2, 3]], [[0, 1], [0, 1]]]))  # [2, 2, L]: (0,1) x3, (2,3) x1
    d.update(torch.tensor([[2, 3], [1, 0]]))
    assert d.tuples.tolist() == [[0, 1], [1, 0], [2, 3]] and d.counts.tolist() == [3, 1, 2] and d.total == 6
    other = CodeDictionary((3, 4))
    other.update(torch.tensor([[1, 0], [2, 2]]))
    d.merge(other)
    assert d.tuples.tolist() == [[0, 1], [1, 0], [2, 2], [2, 3]] and d.counts.tolist() == [3, 2, 1, 2]


def test_sampling_by_frequency_and_uniformly():
    d = CodeDictionary((2, 2))
    d.update(torch.tensor([[0, 0]] * 9 + [[1, 1]]))
    g = torch.Generator().manual_seed(0)
    freq = d.sample((4000,), "frequency", g)
    assert freq.shape == (4000, 2) and set(map(tuple, freq.tolist())) <= {(0, 0), (1, 1)}
    assert (freq[:, 0] == 0).float().mean().item() == pytest.approx(0.9, abs=0.02)
    uni = d.sample((20, 200), "uniform", g)
    assert uni.shape == (20, 200, 2) and (uni[..., 0] == 0).float().mean().item() == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize("by", ["frequency", "uniform"])
def test_each_rows_draws_have_the_dictionarys_distribution_and_the_first_draws_do_not_depend_on_how_many(by):
    d = CodeDictionary((4,))
    d.update(torch.tensor([[0]] * 5 + [[3]] * 5))  # two tuples, equal counts: 1/2 each either way
    drawn = d.sample((2, 2000), by, torch.Generator().manual_seed(0))[..., 0]
    for row in drawn:  # sorted or grouped draws would give row 0 the small tuples only
        assert (row == 0).float().mean().item() == pytest.approx(0.5, abs=0.05)
    every = CodeDictionary((4, 8))  # every tuple once: draws that tell random streams apart
    every.update(torch.cartesian_prod(torch.arange(4), torch.arange(8)))
    draws = [every.sample(shape, by, torch.Generator().manual_seed(5)).reshape(-1, 2) for shape in ((1,), (3,), (2, 4))]
    assert torch.equal(draws[0], draws[1][:1]) and torch.equal(draws[1], draws[2][:3])  # (multinomial's n=1: not)


def test_file_round_trip_loads_with_weights_only(tmp_path):
    d = CodeDictionary((3,))
    d.update(torch.tensor([[0], [2], [2]]))
    path = save_dictionaries(tmp_path / "codes.pt", {"Action_Encoder": d}, windows=3)
    raw = torch.load(path, weights_only=True)
    assert raw["windows"] == 3
    back = load_dictionaries(path)["Action_Encoder"]
    assert back.codebook_sizes == (3,) and torch.equal(back.tuples, d.tuples) and torch.equal(back.counts, d.counts)
    with pytest.raises(DataError, match="code dictionary not found"):
        load_dictionaries(tmp_path / "nope.pt")


@pytest.mark.slow
def test_lwm_codes_equals_the_dictionaries_written_at_the_end_of_fit(tmp_path, capsys, monkeypatch):
    manifest = make_dataset(tmp_path / "data", files=5)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=3", "--data.val_size_percent=0") == 0
    at_fit = load_dictionaries(root / "checkpoints/codes.pt")
    args = tiny_args(manifest, root, f"--ckpt_path={root / 'checkpoints/last.ckpt'}", f"--out={tmp_path / 'c.pt'}",
                     "--model.net.d_model=48", verb="codes")  # the model is the checkpoint's (d_model 32)
    assert main(args) == 0
    again = load_dictionaries(tmp_path / "c.pt")
    assert dictionaries_step(tmp_path / "c.pt") == dictionaries_step(root / "checkpoints/codes.pt") == 3
    for name in ("Action_Encoder", "World_Encoder"):
        assert torch.equal(at_fit[name].tuples, again[name].tuples) and torch.equal(at_fit[name].counts, again[name].counts)
        assert at_fit[name].total > 0
    out = capsys.readouterr().out
    assert "code tuples in use" in out and " transitions; most frequent" in out and " windows; most frequent" in out
    # 3 seeded windows: the checkpoint's seed picks them, whatever data.seed says (a resume with another seed
    # rewrites RUN_DIR/config.yaml; the fit's own windows are the checkpoint's seed's)
    import lwm.cli.codes

    encoded, collect = [], lwm.cli.codes.collect

    def spy(model, loader, *rest):
        encoded.append(list(loader.sampler))  # the (file, start) windows encoded
        return collect(model, loader, *rest)

    monkeypatch.setattr(lwm.cli.codes, "collect", spy)
    for seed in (0, 7):
        assert main([*args, "--max-windows=3", f"--data.seed={seed}", f"--out={tmp_path / f'seed{seed}.pt'}"]) == 0
    assert len(encoded[0]) == 3 and encoded[0] == encoded[1]
    monkeypatch.undo()
    assert main(["codes", "--ckpt_path", str(tmp_path / "missing.ckpt")]) == 2
    with pytest.warns(UserWarning, match="data.window = 5, but .* was trained on 6-frame windows"):
        assert main([*args, "--data.window=5"]) == 0  # another window: other codes, said
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "data", bad)  # (this process may still hold the originals open)
    entry = next(e for e in json.loads(manifest.read_text())["files"] if e["split"] == "train")
    victim = bad / entry["path"]
    indexed = victim.stat()
    with h5py.File(victim, "r+") as f:  # goes bad after indexing: its windows would count as codes
        f["latents"][1] = np.inf
    # unseen by the manifest's stamps (its size and time kept; a changed time is refused at setup: test_datamodule)
    os.utime(victim, ns=(indexed.st_atime_ns, indexed.st_mtime_ns))
    capsys.readouterr()
    assert main([*args, f"--data.manifest={bad / manifest.name}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite latents (NaN/inf) in" in errors[0] and str(victim.resolve()) in errors[0], errors


def test_merge_adds_the_other_dictionarys_counts():
    a, b = CodeDictionary((3,)), CodeDictionary((3,))
    a.update(torch.tensor([[0], [1]]))
    b.update(torch.tensor([[1], [1], [1], [2], [2]]))
    a.merge(b)
    assert a.tuples.tolist() == [[0], [1], [2]] and a.counts.tolist() == [1, 4, 2] and a.total == 7


class FakeEncoders:
    """A stand-in world model for :func:`collect`: every window gets code 0 at one level of 4 codes."""

    quantizers = {"Action_Encoder": SimpleNamespace(codebook_sizes=(4,)),
                  "World_Encoder": SimpleNamespace(codebook_sizes=(4,))}

    def encode_actions(self, x):
        return SimpleNamespace(indices=torch.zeros(x.shape[0], x.shape[1] - 1, 1, dtype=torch.long))

    def encode_world(self, x):
        return SimpleNamespace(indices=torch.zeros(x.shape[0], 1, dtype=torch.long))


@pytest.mark.slow
def test_a_fit_resumed_with_training_over_writes_missing_dictionaries(tmp_path, caplog):
    """A preemption answered at the last step (or during the dictionaries) is requeued; the resumed fit's training
    loop does not run (Lightning skips it), so the dictionaries are written at the fit's end where missing or of
    another step, the same as the finished fit's, and left alone where there."""
    manifest = make_dataset(tmp_path / "data", files=5)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=3", "--data.val_size_percent=0") == 0
    codes = root / "checkpoints/codes.pt"
    at_fit = load_dictionaries(codes)
    codes.unlink()
    assert run(manifest, root, "--trainer.max_steps=3", "--data.val_size_percent=0", "--ckpt_path=last") == 0
    assert dictionaries_step(codes) == 3 and "missing or not of step 3" in caplog.text
    again = load_dictionaries(codes)
    for name in ("Action_Encoder", "World_Encoder"):
        assert torch.equal(at_fit[name].tuples, again[name].tuples) and torch.equal(at_fit[name].counts, again[name].counts)
    before = codes.stat().st_mtime_ns
    caplog.clear()
    assert run(manifest, root, "--trainer.max_steps=3", "--data.val_size_percent=0", "--ckpt_path=last") == 0
    assert codes.stat().st_mtime_ns == before and "missing or not of step" not in caplog.text  # there: left alone


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("codes")
    manifest = make_dataset(tmp / "data", files=5)
    assert run(manifest, tmp / "run", "--trainer.max_steps=3", "--data.val_size_percent=0") == 0
    return tmp, tmp / "run/checkpoints/last.ckpt", manifest


def _codes(tmp, ckpt, *extra) -> list[str]:
    return ["codes", "--config", str(tmp / "run/config.yaml"), "--ckpt_path", str(ckpt), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["checkpoint", "checkpoint as .pt", "manifest", "h5 file", "folder", "ckpt name",
                                    "file parent"])
def test_codes_out_that_is_not_a_code_dictionary_is_refused_before_any_work(trained, capsys, monkeypatch, target):
    """`--out` replaced whatever it named with the dictionary (a checkpoint, the manifest, a data file: exit 0), and
    a folder failed after all the encoding, naming a temporary file."""
    import lwm.cli.codes

    tmp, ckpt, manifest = trained
    copy = tmp / "weights.pt"  # the checkpoint under a name that does not say so
    copy.write_bytes(ckpt.read_bytes())
    out = {"checkpoint": ckpt, "checkpoint as .pt": copy, "manifest": manifest, "h5 file": tmp / "data/ep00.h5", "folder": tmp / "data",
           "ckpt name": tmp / "new.ckpt", "file parent": manifest / "codes.pt"}[target]
    expected = {
        "folder": f"{out}: is a folder, not a file to write (--out)",
        "checkpoint": f"--out {out}: a .ckpt name is a checkpoint's; name the code dictionary e.g. codes.pt",
        "ckpt name": f"--out {out}: a .ckpt name is a checkpoint's; name the code dictionary e.g. codes.pt",
        "file parent": f"{out}: cannot be created, not a folder: {manifest} (--out)",
    }.get(target, f"--out {out}: exists and is not a code dictionary, refusing to replace it (remove it or choose "
                  f"another --out)")
    before = {p: p.read_bytes() for p in (ckpt, copy, manifest, tmp / "data/ep00.h5")}
    monkeypatch.setattr(lwm.cli.codes, "collect", lambda *a, **k: pytest.fail("encoded before the refusal"))
    assert main(_codes(tmp, ckpt, "--out", str(out))) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [f"error: {expected}"]
    assert {p: p.read_bytes() for p in before} == before and not (tmp / "new.ckpt").exists()


@pytest.mark.slow
def test_codes_out_rewrites_a_code_dictionary_and_the_default_path(trained):
    """An existing dictionary at --out is replaced (as is the default codes.pt beside last.ckpt); the files are
    the same dictionary (same windows, same step)."""
    tmp, ckpt, manifest = trained
    default = ckpt.parent / "codes.pt"
    other = tmp / "other.pt"
    save_dictionaries(other, {"Action_Encoder": CodeDictionary((3,))}, windows=1, global_step=99)
    assert main(_codes(tmp, ckpt, "--out", str(other))) == 0
    assert main(_codes(tmp, ckpt)) == 0
    for path in (other, default):
        assert dictionaries_step(path) == 3 and torch.load(path, weights_only=True)["windows"] > 1
    assert torch.equal(load_dictionaries(other)["World_Encoder"].counts, load_dictionaries(default)["World_Encoder"].counts)


def test_is_dictionary_file_tells_a_dictionary_from_other_files(tmp_path):
    from lwm.inference.dictionary import is_dictionary_file

    d = CodeDictionary((2,))
    d.update(torch.tensor([[1]]))
    assert is_dictionary_file(save_dictionaries(tmp_path / "codes.pt", {"Action_Encoder": d}, windows=1))
    torch.save({"state_dict": {"w": torch.zeros(1)}, "epoch": 0, "global_step": 3}, tmp_path / "ckpt.pt")
    torch.save({"Action_Encoder": {"tuples": torch.zeros(1)}, "windows": 1}, tmp_path / "partial.pt")
    (tmp_path / "m.json").write_text('{"files": []}')
    assert not any(is_dictionary_file(tmp_path / n) for n in ("ckpt.pt", "partial.pt", "m.json", "missing.pt"))


def test_a_file_torch_will_not_load_with_weights_only_is_refused_without_torchs_advice(tmp_path):
    """torch's message advised loading with weights_only=False: wrong here, a code dictionary is plain tensors."""
    import argparse

    pickled, text = tmp_path / "namespace.pt", tmp_path / "text.pt"
    torch.save({"Action_Encoder": argparse.Namespace(tuples=1)}, pickled)  # an object torch will not unpickle
    text.write_text("no")
    namespace = "Unsupported global: GLOBAL argparse.Namespace was not an allowed global by default"
    for path, reason in ((pickled, namespace), (text, "Unsupported operand 110")):
        with pytest.raises(DataError) as e:
            load_dictionaries(path)
        assert str(e.value) == (f"{path}: not a code dictionary of `lwm codes` (torch.load with weights_only=True: "
                                f"{reason})")
    torch.save({"state_dict": {"w": torch.zeros(1)}, "windows": 1}, tmp_path / "ckpt.pt")  # loads, is not one
    with pytest.raises(DataError, match=r"not a code dictionary of `lwm codes` \(state_dict holds w, not "
                                        r"codebook_sizes, counts, tuples\)"):
        load_dictionaries(tmp_path / "ckpt.pt")


@pytest.mark.slow
def test_codes_without_config_reads_the_runs_own(trained, capsys):
    """`lwm codes --ckpt_path RUN/checkpoints/last.ckpt` (or RUN) without --config: the run's config.yaml, as given
    explicitly (without it, the package defaults' window and data settings made another dictionary)."""
    tmp, ckpt, _ = trained
    given, found, from_run = tmp / "given.codes.pt", tmp / "found.codes.pt", tmp / "run.codes.pt"
    assert main(_codes(tmp, ckpt, "--out", str(given))) == 0
    capsys.readouterr()
    assert main(["codes", "--ckpt_path", str(ckpt), "--out", str(found)]) == 0
    assert f"lwm codes: the run's config {tmp / 'run/config.yaml'}" in capsys.readouterr().err
    assert main(["codes", "--ckpt_path", str(tmp / "run"), "--out", str(from_run)]) == 0
    expected = torch.load(given, weights_only=True)
    for path in (found, from_run):
        assert torch.load(path, weights_only=True).keys() == expected.keys()
        for name in ("Action_Encoder", "World_Encoder"):
            for key, value in expected[name].items():
                assert torch.equal(torch.load(path, weights_only=True)[name][key], value), (path, name, key)
        assert torch.load(path, weights_only=True)["windows"] == expected["windows"]


def test_codes_last_without_a_config_asks_which_run(capsys):
    assert main(["codes", "--ckpt_path", "last"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --ckpt_path last: which run's? Give --config CFG (its trainer.default_root_dir), or the "
                      "run's folder as --ckpt_path RUN_DIR"], errors

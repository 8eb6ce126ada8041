"""Code dictionaries: counts on hand-made codes, merging, sampling, the file, and `lwm codes` == the fit callback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lwm.cli import main
from lwm.codes import CodeDictionary, collect, dictionaries_step, load_dictionaries, save_dictionaries
from lwm.errors import DataError
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
    with pytest.raises(ValueError, match="expected 2 levels"):
        d.update(torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="codebook sizes differ"):
        d.merge(CodeDictionary((3, 5)))


def test_sampling_by_frequency_and_uniformly():
    d = CodeDictionary((2, 2))
    d.update(torch.tensor([[0, 0]] * 9 + [[1, 1]]))
    g = torch.Generator().manual_seed(0)
    freq = d.sample((4000,), "frequency", g)
    assert freq.shape == (4000, 2) and set(map(tuple, freq.tolist())) <= {(0, 0), (1, 1)}
    assert (freq[:, 0] == 0).float().mean().item() == pytest.approx(0.9, abs=0.02)
    uni = d.sample((20, 200), "uniform", g)
    assert uni.shape == (20, 200, 2) and (uni[..., 0] == 0).float().mean().item() == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="sampling must be one of"):
        d.sample((1,), "mode")
    with pytest.raises(ValueError, match="empty"):
        CodeDictionary((2,)).sample((1,))


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


def test_lwm_codes_equals_the_dictionaries_written_at_the_end_of_fit(tmp_path, capsys):
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
    assert "code tuples in use" in capsys.readouterr().out
    assert main(["codes", "--ckpt_path", str(tmp_path / "missing.ckpt")]) == 2


def test_merge_adds_the_other_dictionarys_counts():
    a, b = CodeDictionary((3,)), CodeDictionary((3,))
    a.update(torch.tensor([[0], [1]]))
    b.update(torch.tensor([[1], [1], [1], [2], [2]]))
    a.merge(b)
    assert a.tuples.tolist() == [[0], [1], [2]] and a.counts.tolist() == [1, 4, 2] and a.total == 7


def test_collect_stops_at_max_windows_across_batches():
    class Fake:
        quantizers = {"Action_Encoder": SimpleNamespace(codebook_sizes=(4,)),
                      "World_Encoder": SimpleNamespace(codebook_sizes=(4,))}

        def encode_actions(self, x):
            return SimpleNamespace(indices=torch.zeros(x.shape[0], x.shape[1] - 1, 1, dtype=torch.long))

        def encode_world(self, x):
            return SimpleNamespace(indices=torch.zeros(x.shape[0], 1, dtype=torch.long))

    loader = [{"latents": torch.zeros(2, 3, 1, 1, 1)} for _ in range(4)]  # 8 windows in batches of 2
    dictionaries, windows = collect(Fake(), loader, torch.device("cpu"), max_windows=5)
    assert windows == 5 and dictionaries["World_Encoder"].total == 5
    assert dictionaries["Action_Encoder"].total == 5 * 2

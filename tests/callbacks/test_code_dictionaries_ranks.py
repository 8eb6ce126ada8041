"""Under 2 gloo ranks: the end-of-fit code dictionaries add every rank's counts once; when one rank's windows hold
NaN, they and the stop after non-finite steps in a row raise the same error line on every rank, naming the bad
windows of every rank (a rank raising alone would leave the others waiting in a collective until the timeout)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lwm.callbacks import CodeDictionaries
from lwm.inference.dictionary import load_dictionaries
from lwm.utils.errors import DataError, NonFiniteLossError
from tests.test_codes import FakeEncoders

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out


class _Loader(list):
    def __init__(self, batches, paths):
        super().__init__(batches)
        self.dataset = SimpleNamespace(paths=paths)


def _on_rank(rank: int, port: int, results, body: Callable[[int], None]) -> None:
    """``body(rank)`` in a 2-rank gloo group; ``results[rank]`` its error line, or "no error"."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        body(rank)
        results[rank] = "no error"
    except (DataError, NonFiniteLossError) as e:
        results[rank] = str(e)
    finally:
        dist.destroy_process_group()


def _two_ranks(body: Callable[[int], None]) -> dict[int, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_on_rank, args=(port, results, body), nprocs=2, join=True)
    return dict(results)


def _counted(rank: int, root: str) -> None:
    n = 2 + rank  # rank 0: 2 windows of 3 frames (1 world code, 2 action codes each), rank 1: 3
    batch = {"latents": torch.zeros(n, 3, 1, 1, 1), "file_index": torch.zeros(n, dtype=torch.long),
             "start": torch.zeros(n, dtype=torch.long)}
    trainer = SimpleNamespace(datamodule=SimpleNamespace(code_loader=lambda _: _Loader([batch], [f"/data/r{rank}.h5"])),
                              callbacks=[], world_size=2, fast_dev_run=False, is_global_zero=rank == 0,
                              checkpoint_callback=None, default_root_dir=root, global_step=7,
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))
    module = SimpleNamespace(model=FakeEncoders(), device=torch.device("cpu"), training=True, eval=lambda: None,
                             train=lambda mode=True: None)
    CodeDictionaries().on_train_end(trainer, module)


@pytest.mark.timeout(120)
def test_the_ranks_dictionaries_are_added_once_each(tmp_path):
    assert _two_ranks(functools.partial(_counted, root=str(tmp_path))) == {0: "no error", 1: "no error"}
    dictionaries = load_dictionaries(tmp_path / "codes.pt")
    assert dictionaries["World_Encoder"].counts.tolist() == [5] and dictionaries["Action_Encoder"].counts.tolist() == [10]
    assert torch.load(tmp_path / "codes.pt", weights_only=True)["windows"] == 5


def _code_dictionaries(rank: int) -> None:
    latents = torch.zeros(2, 3, 1, 1, 1)
    if rank == 1:
        latents[1, 2] = float("nan")  # this rank's second window went bad after indexing
    batch = {"latents": latents, "file_index": torch.tensor([0, 1]), "start": torch.tensor([0, 4])}
    loader = _Loader([batch], [f"/data/r{rank}_a.h5", f"/data/r{rank}_b.h5"])
    trainer = SimpleNamespace(datamodule=SimpleNamespace(code_loader=lambda n: loader), callbacks=[], world_size=2,
                              fast_dev_run=False,
                              is_global_zero=rank == 0, checkpoint_callback=None, default_root_dir="/nonexistent",
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))
    module = SimpleNamespace(model=FakeEncoders(), device=torch.device("cpu"), training=True, eval=lambda: None,
                             train=lambda mode=True: None)
    CodeDictionaries().on_train_end(trainer, module)


@pytest.mark.timeout(120)
def test_a_bad_window_on_one_rank_stops_every_rank_with_its_line():
    results = _two_ranks(_code_dictionaries)
    assert results[0] == results[1] and "non-finite latents (NaN/inf) in 1 window(s): /data/r1_b.h5 (frames 4..6)" in results[0]


def _nonfinite_stop(rank: int) -> None:
    from lwm.training.module import WorldModelModule
    from tests.lightning.test_module import NET

    module = WorldModelModule(net=NET, max_nonfinite=3)
    latents = torch.zeros(2, 3, 1, 1, 1)
    if rank == 1:
        latents[0, 1] = float("nan")  # only this rank's batch holds the file gone bad
    module._last_batch = {"latents": latents, "file_index": torch.tensor([0, 1]), "start": torch.tensor([0, 4])}
    train_set = SimpleNamespace(paths=[f"/data/r{rank}_a.h5", f"/data/r{rank}_b.h5"])
    module._trainer = SimpleNamespace(world_size=2, global_step=7, datamodule=SimpleNamespace(train_set=train_set))
    module._check_in_a_row(3)  # every rank: their skip counts are all-reduced, equal


@pytest.mark.timeout(120)
def test_a_nonfinite_stop_names_the_bad_windows_of_every_rank():
    """Every rank stops at the same step; each names the bad windows of all ranks, not only its own (rank 0's
    line, usually the one read, named no file)."""
    results = _two_ranks(_nonfinite_stop)
    for rank in (0, 1):
        assert "non-finite latents: /data/r1_a.h5 (frames 0..2)" in results[rank], results[rank]

"""The end-of-fit code dictionaries under 2 gloo ranks, when one rank's windows hold NaN: every rank raises the
same error line (a rank raising alone would leave the others waiting in the gather until the timeout)."""

from __future__ import annotations

import datetime
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lwm.callbacks import CodeDictionaries
from lwm.errors import DataError
from tests.test_codes import FakeEncoders


class _Loader(list):
    def __init__(self, batches, paths):
        super().__init__(batches)
        self.dataset = SimpleNamespace(paths=paths)


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    latents = torch.zeros(2, 3, 1, 1, 1)
    if rank == 1:
        latents[1, 2] = float("nan")  # this rank's second window went bad after indexing
    batch = {"latents": latents, "file_index": torch.tensor([0, 1]), "start": torch.tensor([0, 4])}
    loader = _Loader([batch], [f"/data/r{rank}_a.h5", f"/data/r{rank}_b.h5"])
    trainer = SimpleNamespace(datamodule=SimpleNamespace(code_loader=lambda n: loader), callbacks=[], world_size=2,
                              is_global_zero=rank == 0, checkpoint_callback=None, default_root_dir="/nonexistent")
    module = SimpleNamespace(model=FakeEncoders(), device=torch.device("cpu"), training=True, eval=lambda: None,
                             train=lambda mode=True: None)
    try:
        CodeDictionaries().on_train_end(trainer, module)
        results[rank] = "no error"
    except DataError as e:
        results[rank] = str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_bad_window_on_one_rank_stops_every_rank_with_its_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(port, results), nprocs=2, join=True)
    assert results[0] == results[1] and "non-finite latents (NaN/inf) in 1 window(s): /data/r1_b.h5 (frames 4..6)" in results[0]

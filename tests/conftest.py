"""Suite-wide settings: one intra-op thread per test process (pytest runs 2 workers on 2 cores; more threads
only oversubscribe the machine and make tiny CPU steps several times slower)."""

import sys

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _no_wandb_run_left_in_progress():
    """An in-process fit refused after its wandb run started leaves ``wandb.run`` set (a CLI process would exit):
    finished here, or a later test's WandbLogger reuses it (one without a login then starts)."""
    yield
    wandb = sys.modules.get("wandb")
    if getattr(wandb, "run", None) is not None:
        wandb.finish()


def pytest_collection_modifyitems(items):
    """Every test not marked ``slow`` is in the unit tier (``make test-fast``: ``-m unit``)."""
    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)

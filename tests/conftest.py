"""Suite-wide settings: one intra-op thread per test process (pytest runs 2 workers on 2 cores; more threads
only oversubscribe the machine and make tiny CPU steps several times slower)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    torch.set_num_threads(1)
    yield


def pytest_collection_modifyitems(items):
    """Every test not marked ``slow`` is in the unit tier (``make test-fast``: ``-m unit``)."""
    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)

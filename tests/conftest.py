"""Suite-wide settings: one intra-op thread per test process (pytest runs 2 workers on 2 cores; more threads
only oversubscribe the machine and make tiny CPU steps several times slower)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    torch.set_num_threads(1)
    yield

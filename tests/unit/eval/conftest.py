import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding runs many tiny matmuls (a 1-8 token verify forward): with MKL threads on a shared
    2-core machine thread start-up dominates and they run 10-100x slower, so these tests use one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

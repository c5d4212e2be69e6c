"""One intra-op thread for these tests: their tensors are tiny, and on a shared 2-core machine two spinning OpenMP
threads per op made the suite several times slower."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

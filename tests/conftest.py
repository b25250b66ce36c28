"""Fixtures shared by the model tests; one thread per process (tests and the runs they start)."""
import os
import sys

import pytest
import torch

# 2 cores: torch's default thread pool oversubscribes them as soon as a test and a Ray worker (or two ranks) run at
# once; measured, a single model test then went from ~1 s to over 100 s.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_ray_left_in_the_test_process():
    """No test leaves a Ray running in this process (runs start theirs in subprocesses): one started by accident
    (`ray.get` or `.remote()` start a Ray when none is up) held Ray's default ports until the suite ended, every
    later private Ray's agent retried its port, and a `ray start --head` was left without a job agent."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this test left a Ray running in the test process")


@pytest.fixture
def batch():
    """4 rows of 3 tasks (mixed), padded inputs and padded label positions, vocabulary 64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 64, (4, 9), generator=g)
    am = torch.ones_like(x)
    am[1, 6:] = 0
    am[3, 4:] = 0
    x[am == 0] = 0
    y = torch.randint(3, 64, (4, 5), generator=g)
    y[2, 3:] = -100  # padded label positions
    return dict(input_ids=x, attention_mask=am, labels=y, task_ids=torch.tensor([0, 1, 2, 0]))

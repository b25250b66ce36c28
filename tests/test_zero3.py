"""Every method under DeepSpeed ZeRO-3 on CPU: 2 ranks, partitioned parameters, forward/backward/step, generation."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


METHODS = ("hyperprompt-share", "hyperprompt-sep", "hyperprompt-global", "mtl", "prompt_tuning", "adapter",
           "hyperformer", "prefix", "lora", "mam", "pha")


def test_zero3_step_every_method(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "workers" / "zero3_step.py"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", str(port), str(worker), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in METHODS:
        for rep in reports:
            r = rep[name]
            # ZeRO-3 partitions every parameter (backbone and method): nothing is held whole on a rank
            assert r["partitioned"]
            assert bool(r["local_shapes"]) == (name != "mtl")
            assert all(s == [0] for s in r["local_shapes"].values()), r["local_shapes"]
            # the first forward under ZeRO-3 equals the unpartitioned model with the same weights
            assert abs(r["losses"][0] - r["plain_loss"]) < 1e-5
            assert r["losses"][-1] < r["losses"][0]
            assert all(r["changed"].values()), r["changed"]  # the optimizer updated every method parameter
            assert r["backbone_changed"]
            assert r["extra"] == r["plain_extra"] and (r["extra"]["total"] > 0) == (name != "mtl")
            assert r["generated"] == r["expected"]  # synced generation under ZeRO-3 == the plain model's
            assert r["frozen"] == r["expected"]  # ... also from task tensors frozen under ZeRO-3
            assert r["merged"] == (name == "lora") and r["merge_equal"]  # LoRA's merge of the gathered weights
            # the best weights: written whole, one parameter at a time, and read back exactly after the weights moved
            assert r["best"] == {"moved": True, "restored": True, "whole": True}, r["best"]
        # the ranks agree on the (gathered) updated parameters' fate and the counts
        assert reports[0][name]["extra"] == reports[1][name]["extra"]
    for rep in reports:  # every parameter persistent (whole copies beside the partitions): the forward sees them
        assert rep["persistent"]["best"] == {"moved": True, "restored": True, "whole": True}, rep["persistent"]
        assert abs(rep["persistent"]["loss"] - rep["persistent"]["expected_loss"]) < 1e-5, rep["persistent"]

"""Every method under DeepSpeed ZeRO-3 on CPU: 2 ranks, partitioned parameters, forward/backward/step, generation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


METHODS = ("hyperprompt-share", "hyperprompt-sep", "hyperprompt-global", "mtl", "prompt_tuning", "adapter",
           "hyperformer", "prefix", "lora", "mam", "pha")


def run_workers(worker: str, out_dir, timeout: int, ranks: int = 2) -> None:
    """Run tests/workers/<worker> on `ranks` ranks under torchrun (gloo, DeepSpeed on CPU); it writes its reports to
    `out_dir`."""
    from hpsearch.train.launch import free_port

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                          "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                          str(Path(__file__).parent / "workers" / worker), str(out_dir)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]


def test_zero3_step_every_method(tmp_path):
    run_workers("zero3_step.py", tmp_path, timeout=900)
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
            assert r["engines_alive"] == 0  # released: DeepSpeed keeps no partitioned model of an earlier method
            # the best weights: written whole, one parameter at a time, and read back exactly after the weights moved,
            # each rank reading its own partitions (half of every parameter, up to the padding of odd sizes)
            share = r["best"].pop("read_share")
            assert r["best"] == {"moved": True, "restored": True, "whole": True}, r["best"]
            assert 0.45 <= share <= 0.55, (name, share)
        # the ranks agree on the (gathered) updated parameters' fate and the counts
        assert reports[0][name]["extra"] == reports[1][name]["extra"]
    for rep in reports:  # every parameter persistent (whole copies beside the partitions): the forward sees them
        share = rep["persistent"]["best"].pop("read_share")
        assert rep["persistent"]["best"] == {"moved": True, "restored": True, "whole": True}, rep["persistent"]
        assert 0.45 <= share <= 0.55, share  # its partitions only: the whole copies were released first
        assert abs(rep["persistent"]["loss"] - rep["persistent"]["expected_loss"]) < 1e-5, rep["persistent"]


def test_zero3_build_under_zero_init_equals_the_whole_build(tmp_path):
    """The recipe's ZeRO-3 build (`hpsearch.train.build.ModelBuilder`): only rank 0 builds the whole model; every rank
    builds the structure under `deepspeed.zero.Init` (partitioned from the start) and receives rank 0's values. For
    every method setup of the shared tester, the gathered weights equal a whole build's, parameter by parameter."""
    run_workers("zero3_build.py", tmp_path, timeout=600)
    from test_methods import SETUPS

    for rank in (0, 1):
        report = json.loads((tmp_path / f"build{rank}.json").read_text())
        for precision in ("fp32", "bf16"):  # buffers come from rank 0 too, in the skeleton's dtype
            assert report.pop(f"buffer_module_{precision}") == {"buffer": True, "params": True}, precision
        assert set(report) == set(SETUPS)
        for name, r in report.items():
            assert r["stage"] == 3 and r["partitioned"], name  # every parameter partitioned on every rank
            assert r["made_on"] == ([0] if rank == 0 else []), name  # the whole model: rank 0 alone
            assert r["names_equal"] and r["tied"], name
            assert r["equal"] and all(r["equal"].values()), (name, [n for n, e in r["equal"].items() if not e])
            assert r["requires_grad_equal"] and r["buffers_equal"], name
            # stages 0-2: every rank builds the whole model itself, the same weights
            assert r["stage0_made_on"] == [rank] and r["stage0_whole"] and r["stage0_equal"], name

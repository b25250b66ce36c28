"""Checkpoints never run code: a pickle payload is refused (before anything starts, and at DeepSpeed's own load)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpsearch.errors import UserError
from hpsearch.train import checkpoints


class Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_checkpoint(folder: Path, marker: Path) -> Path:
    """A folder shaped like a DeepSpeed ZeRO checkpoint (`latest`, `state/…_model_states.pt`) carrying a payload."""
    (folder / "state").mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}, "x": Payload(marker)},
               folder / "state" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (folder / "latest").write_text("state")
    return folder


def test_payload_is_live(tmp_path):
    """The payload really runs when unpickled as DeepSpeed does it (weights_only=False): the tests below mean it."""
    ckpt = evil_checkpoint(tmp_path / "ckpt", tmp_path / "ran")
    torch.load(ckpt / "state" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    assert (tmp_path / "ran").exists()


def test_resume_from_a_payload_checkpoint_is_refused_in_one_line(tmp_path):
    ckpt = evil_checkpoint(tmp_path / "ckpt", tmp_path / "ran")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "hpsearch.train", "--local", "--resume-from", str(ckpt),
                           f"train.output_dir={tmp_path}/out", "train.max_steps=3"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "refused" in proc.stderr and "posix.system" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "out").exists()  # nothing started


class DeepSpeedLikeEngine:
    """Loads as DeepSpeed's TorchCheckpointEngine does: `torch.load(path, weights_only=False)`."""

    def load_checkpoint(self, directory, tag, **kwargs):
        path = Path(directory) / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        state = torch.load(path, map_location="cpu", weights_only=False)
        return str(path), state


def test_deepspeed_style_load_is_forced_weights_only(tmp_path):
    """A resume from Tune's storage skips the command's check: the load itself must refuse the payload."""
    ckpt = evil_checkpoint(tmp_path / "ckpt", tmp_path / "ran")
    with pytest.raises(UserError, match="refused, it holds posix.system"):
        checkpoints.load(DeepSpeedLikeEngine(), ckpt, tag="state")
    assert not (tmp_path / "ran").exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored afterwards


def test_plain_weights_load_and_corrupt_files_are_named(tmp_path):
    (tmp_path / "ok" / "state").mkdir(parents=True)
    f = tmp_path / "ok" / "state" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(3)}, "step": 4, "rng": {"cpu": torch.get_rng_state()}}, f)
    checkpoints.check_files(tmp_path / "ok")
    assert checkpoints.load(DeepSpeedLikeEngine(), tmp_path / "ok", tag="state")["step"] == 4
    f.write_bytes(f.read_bytes()[:200])  # truncated: an interrupted copy
    with pytest.raises(UserError, match="zero_pp_rank_0_mp_rank_00_model_states.pt is corrupt or incomplete"):
        checkpoints.check_files(tmp_path / "ok")
    with pytest.raises(UserError, match="corrupt or incomplete"):
        checkpoints.load(DeepSpeedLikeEngine(), tmp_path / "ok", tag="state")


def test_a_rank_resuming_downloads_its_own_zero_partitions_and_the_shared_files_only(tmp_path):
    """Each rank resumes from a local copy of the checkpoint in storage; a non-elastic ZeRO load reads its own
    rank's partition files only, so the others' are not fetched (N ranks fetch the partitioned state once in all);
    everything else (DeepSpeed's `latest` and stage 0–2 model states, the report, the manifests) comes whole."""
    from pyarrow import fs
    storage = fs.SubTreeFileSystem(str(tmp_path / "bucket"), fs.LocalFileSystem())
    names = ["latest", "report.json", "best.json", "manifest_rank_0.json", "manifest_rank_1.json",
             "state/mp_rank_00_model_states.pt"]
    partitions = {rank: [f"state/zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                         f"state/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                         f"state/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] for rank in range(12)}
    for i, name in enumerate(names + [n for ns in partitions.values() for n in ns]):
        path = tmp_path / "bucket" / "run" / "checkpoint_000040" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (1000 + i))
    for rank in (1, 10):
        local = Path(checkpoints.download_for_rank(storage, "run/checkpoint_000040/", rank))
        got = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        assert got == sorted(names + partitions[rank])  # rank 10's, not rank 1's or 0's
        for name in got:
            assert (local / name).read_bytes() == (tmp_path / "bucket/run/checkpoint_000040" / name).read_bytes()
    # rank 0 re-reporting a checkpoint whose report Ray never took fetches it whole: it is reported as the checkpoint
    local = Path(checkpoints.download_for_rank(storage, "run/checkpoint_000040", None))
    assert sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()) == \
        sorted(names + [n for ns in partitions.values() for n in ns])


def test_a_resume_is_checked_against_the_checkpoints_run_config(tmp_path):
    """A checkpoint keeps its run config (and pretraining's corpus settings); --resume-from with other values of the
    fields a resume keeps is one line naming them, and with --local a checkpoint of several ranks says to drop
    --local. Paths may change (another machine)."""
    import json

    from hpsearch.config import load_config
    from hpsearch.errors import UserError
    from hpsearch.train import checkpoints

    run = load_config(None, ["train.num_workers=2"]).to_dict()
    corpus = {"noise_density": 0.15, "mean_span_length": 3.0, "path": "/a/corpus"}
    folder = tmp_path / "step_20"
    (folder / "state").mkdir(parents=True)
    checkpoints.write_config(folder, {**run, "corpus": corpus})
    (folder / checkpoints.REPORT).write_text(json.dumps({"step": 20}))
    checkpoints.check_resume_dir(folder, {**run, "corpus": {**corpus, "path": "/b/corpus"}})  # the same run
    other = load_config(None, ["train.num_workers=2", "train.lr=1e-2", "data.seed=3"]).to_dict()
    with pytest.raises(UserError, match=r"was trained with data.seed=0 \(this run: 3\), train.lr=0.001 \(this run: "
                                        r"0.01\); a resume continues that run as it was"):
        checkpoints.check_resume_dir(folder, other)
    with pytest.raises(UserError, match=r"was trained with corpus.noise_density=0.15 \(this run: 0.5\)"):
        checkpoints.check_resume_dir(folder, {**run, "corpus": {**corpus, "noise_density": 0.5}})
    one = load_config(None, ["train.num_workers=1"]).to_dict()
    with pytest.raises(UserError, match=r"was written by 2 ranks and --local runs one .*: resume it without --local"):
        checkpoints.check_resume_dir(folder, one, local=True)
    with pytest.raises(UserError, match=r"is at step 20, not before train.max_steps=20; set train.max_steps above"):
        checkpoints.check_resume_dir(folder, load_config(None, ["train.num_workers=2",
                                                                "train.max_steps=20"]).to_dict())

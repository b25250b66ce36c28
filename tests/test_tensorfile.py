"""The best weights read back by ranges (`hpsearch/train/tensorfile.py`, `bestweights.load_best`): each range equals
safetensors' own reading of the file, damaged files are refused, and a run's model gets the file's values."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from pyarrow import fs
from safetensors import safe_open
from safetensors.torch import save_file

from hpsearch.errors import UserError
from hpsearch.train import bestweights, checkpoints
from hpsearch.train.tensorfile import TensorFile


@pytest.fixture
def tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {"w": torch.randn(7, 5, generator=g), "b16": torch.randn(3, 4, 2, generator=g).to(torch.bfloat16),
              "ids": torch.randint(-9, 9, (11,), generator=g), "one": torch.tensor([2.5], dtype=torch.float16)}
    path = tmp_path / "w.safetensors"
    save_file(values, str(path), metadata={"note": "x"})
    return path, values


def test_ranges_equal_safetensors_own_reading(tensors):
    path, values = tensors
    with TensorFile(fs.LocalFileSystem(), str(path)) as f, safe_open(str(path), "pt") as ref:
        assert f.names == set(values) and all(f.shape(n) == list(values[n].shape) for n in values)
        read = 0
        for name in values:
            flat = ref.get_tensor(name).reshape(-1)
            whole = f.read(name)
            assert torch.equal(whole, flat) and whole.dtype == flat.dtype
            for start, count in ((0, 1), (1, flat.numel() - 2), (flat.numel() - 1, 1), (3 % flat.numel(), 0)):
                if count >= 0 and start + count <= flat.numel():
                    assert torch.equal(f.read(name, start, count), flat[start:start + count]), (name, start, count)
                    read += count * flat.element_size()
        assert f.bytes_read == read + sum(v.numel() * v.element_size() for v in values.values())
        with pytest.raises(ValueError):
            f.read("w", 30, 10)  # past its 35 elements


def test_damaged_files_are_refused(tensors, tmp_path):
    path, _ = tensors
    data = path.read_bytes()
    def header(entries) -> bytes:
        text = json.dumps(entries).encode()
        return len(text).to_bytes(8, "little") + text + b"\0" * 64

    crafted = [header(h) for h in (
        {"x": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}},     # a float dimension
        {"x": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}},  # a bool one
        {"x": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}},   # negative ones
        {"x": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},       # before the data
        {"x": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}},    # past the end
        {"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}},         # an unknown dtype
        {"x": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}},          # not a list
        [1, 2])]
    nested = b"[" * 200_000
    crafted.append(len(nested).to_bytes(8, "little") + nested)  # json's recursion limit
    for i, damaged in enumerate((data[:-1], b"\xff" * 8 + data[8:], data[:8] + b"[" + data[9:], data[:20],
                                 *crafted)):
        bad = tmp_path / f"bad{i}.safetensors"
        bad.write_bytes(damaged)
        with pytest.raises(ValueError):
            TensorFile(fs.LocalFileSystem(), str(bad))


def test_load_best_puts_the_files_values_in_and_names_a_wrong_file(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    engine = SimpleNamespace(module=model)
    best = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    save_file(best, str(tmp_path / "best.safetensors"))
    read = bestweights.load_best(engine, 0, fs.LocalFileSystem(), str(tmp_path / "best.safetensors"))
    assert all(torch.equal(p, best[n]) for n, p in model.named_parameters())
    assert read == sum(v.numel() * v.element_size() for v in best.values())
    save_file({k: v for k, v in best.items() if k != "1.bias"}, str(tmp_path / "lacks.safetensors"))
    save_file({**best, "1.weight": torch.zeros(3, 2)}, str(tmp_path / "shape.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    for name, says in (("lacks", "lacks 1.bias"), ("shape", "holds 1.weight in another shape"),
                       ("junk", "is unreadable"), ("missing", "is gone")):
        with pytest.raises(UserError, match=f"best weights .*{name}.safetensors {says}"):
            bestweights.load_best(engine, 0, fs.LocalFileSystem(), str(tmp_path / f"{name}.safetensors"))



def test_a_passing_failure_while_loading_is_not_taken_for_the_checkpoints_fault(tmp_path, monkeypatch):
    """A trial's retry may get past an I/O error, memory or a peer rank gone mid-load: those keep their own type
    (a UserError marks the trial failed for good: study.deterministic). A checkpoint of another config is a
    UserError, as before."""
    from hpsearch.tune.study import deterministic

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    save_file({n: p.detach() for n, p in model.named_parameters()}, str(tmp_path / "best.safetensors"))
    engine = SimpleNamespace(module=model)

    def failing_read(*args, **kwargs):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr("hpsearch.train.tensorfile.TensorFile", failing_read)
    with pytest.raises(OSError, match="reading the best weights .* failed .*Input/output error") as e:
        bestweights.load_best(engine, 0, fs.LocalFileSystem(), str(tmp_path / "best.safetensors"))
    assert not isinstance(e.value, UserError) and not deterministic(f"{type(e.value).__name__}: {e.value}")

    (tmp_path / "state").mkdir()
    for error, permanent in ((RuntimeError("[gloo] Connection closed by peer"), False), (MemoryError(), False),
                             (OSError(5, "Input/output error"), False),
                             (RuntimeError('Error(s) in loading state_dict for T5: Unexpected key(s) "x.y"'), True),
                             (KeyError("exp_avg"), True)):
        def load_checkpoint(*args, error=error, **kwargs):
            raise error
        with pytest.raises(Exception) as e:
            checkpoints.load(SimpleNamespace(load_checkpoint=load_checkpoint), tmp_path, "state")
        assert isinstance(e.value, UserError) == permanent, (error, e.value)
        assert deterministic(f"{type(e.value).__name__}: {e.value}") == permanent

"""Ranges of the tensors in a safetensors file, read where the file is (a folder or a bucket, any pyarrow filesystem).

A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}},
offsets relative to the end of the header) and each tensor's bytes, row-major. Elements `start` to `start + count`
of a tensor's flattened values are therefore one byte range, which is what a ZeRO-3 rank holds of a parameter:
`read` fetches that range alone (a ranged read in a bucket), so every rank reads its own partitions and no rank
reads or receives the whole model. Header errors, unknown dtypes and ranges outside the data are `ValueError`s.
"""
from __future__ import annotations

import json
import math

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # safetensors' own limit


def _ints(values) -> bool:
    return all(type(v) is int and v >= 0 for v in values)  # not bool, not float


class TensorFile:
    """`with TensorFile(filesystem, path) as f`: `f.names`, `f.shape(name)`, `f.read(name, start, count)`;
    `f.bytes_read` counts the tensor bytes this reader fetched."""

    def __init__(self, filesystem, path: str):
        self.file = filesystem.open_input_file(path)
        self.bytes_read = 0
        try:
            size = self.file.size()
            n = int.from_bytes(self.file.read_at(8, 0), "little")
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ValueError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(self.file.read_at(n, 8))
            if not isinstance(header, dict):
                raise ValueError(f"{path}: not a safetensors header")
            header.pop("__metadata__", None)
            self.base, self.entries = 8 + n, header
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                shape = entry["shape"]
                if not (_ints([begin, end, *shape]) and entry["dtype"] in DTYPES and self.base + end <= size
                        and end - begin == math.prod(shape) * DTYPES[entry["dtype"]].itemsize):
                    raise ValueError(f"{path}: tensor {name} does not fit its header")
        except (KeyError, TypeError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
            self.close()
            raise ValueError(f"{path}: not a safetensors header ({type(e).__name__})") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def names(self) -> set[str]:
        return set(self.entries)

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements [start, start + count) of `name`'s flattened values (default: all), 1-D, in the file's dtype."""
        entry = self.entries[name]
        dtype = DTYPES[entry["dtype"]]
        numel = math.prod(entry["shape"])
        count = numel - start if count is None else count
        if start < 0 or count < 0 or start + count > numel:
            raise ValueError(f"elements {start}..{start + count} of {name} (it has {numel})")
        if count == 0:
            return torch.empty(0, dtype=dtype)
        data = self.file.read_at(count * dtype.itemsize, self.base + entry["data_offsets"][0] + start * dtype.itemsize)
        self.bytes_read += len(data)
        return torch.frombuffer(bytearray(data), dtype=dtype)

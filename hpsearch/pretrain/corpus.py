"""The pretraining corpus: unlabelled text, training text only.

    texts = read_corpus(cfg.corpus, cfg.data)     # a folder of .txt / .jsonl, or the suite's training inputs

- A folder (`corpus.path`): every `*.txt` (one text per non-empty line) and `*.jsonl` (one JSON object per line,
  its `corpus.text_field`) below it, in sorted path order. A file whose name says it is a validation or test split
  (`validation`, `valid`, `val`, `dev`, `test`, as a word of its name or its folder's) is refused: pretraining on
  the rows a comparison is scored on would leak them into the backbone.
- No path: the source texts of the suite's **training** split (`data.*`, after the split protocol, so rows the
  protocol holds out for validation are not read either); never a label, never a validation or test row.

`Chunks` tokenizes the texts once, concatenates them (T5 packs its corpus the same way) and cuts the stream into
pieces of `corpus.max_length - 1` tokens; the last `corpus.heldout_chunks` pieces are held out to measure the
objective on text the model has not trained on.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from hpsearch.errors import ConfigError, DataError

HELD_OUT_WORDS = ("validation", "valid", "val", "dev", "test", "eval")
_WORDS = re.compile(r"[a-z]+")


def held_out_name(path: Path, root: Path) -> bool:
    """Whether a file's name, or a folder between `root` and it, names a validation or test split."""
    parts = [path.stem, *path.relative_to(root).parent.parts]
    return any(w in HELD_OUT_WORDS for part in parts for w in _WORDS.findall(part.lower()))


def read_folder(root: Path, text_field: str = "text") -> list[str]:
    root = root.expanduser()
    if not root.is_dir():
        raise ConfigError(f"corpus.path: {root}: no such directory; expected a folder of .txt or .jsonl text")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
    for path in files:
        if held_out_name(path, root):
            raise DataError(f"corpus.path: {path} is a validation or test file; pretraining reads training text "
                            "only (move it out of the corpus folder)")
    texts = [t for path in files for t in _read_file(path, text_field)]
    if not texts:
        raise DataError(f"corpus.path: {root} holds no text (expected non-empty *.txt lines or *.jsonl rows)")
    return texts


def _read_file(path: Path, text_field: str) -> Iterator[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; save it as UTF-8") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".txt":
            yield " ".join(line.split())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not a JSON object ({e.msg})") from None
        value = row.get(text_field) if isinstance(row, dict) else None
        if not isinstance(value, str):
            raise DataError(f"{path}:{number}: no string field {text_field!r} (set corpus.text_field)")
        if value.strip():
            yield " ".join(value.split())


def suite_texts(suite) -> list[str]:
    """The source text of every training row of the suite, in task order (no targets, no other split)."""
    texts = [example.source for task in suite.tasks for example in suite.split(task, "train")]
    if not texts:
        raise DataError(f"data.tasks: no training rows in {suite.source} to pretrain on")
    return texts


def read_corpus(corpus, data) -> list[str]:
    """The texts `corpus` (CorpusConfig) names: its folder, or the training inputs of the suite `data` names."""
    if corpus.path:
        return read_folder(Path(corpus.path), corpus.text_field)
    from hpsearch.data import load_suite
    return suite_texts(load_suite(data))


def describe_corpus(corpus, data) -> str:
    """What `read_corpus` reads, in words for the backbone's pretrain.json: the folder, or the suite's source and
    the tasks it resolves to (the default task list stands for every task folder the source has)."""
    if corpus.path:
        return str(corpus.path)
    from hpsearch.data.sources import resolve_tasks
    return f"training inputs of {data.source} ({', '.join(resolve_tasks(data))})"


class Chunks:
    """The corpus as token pieces of `length` ids (eos not included): `train` and `heldout` lists."""

    def __init__(self, texts: list[str], tokenizer, length: int, heldout: int):
        ids: list[int] = []
        for start in range(0, len(texts), 4096):  # the fast tokenizer in batches, no special tokens
            for row in tokenizer(texts[start:start + 4096], add_special_tokens=False)["input_ids"]:
                ids.extend(row)
        pieces = [ids[k:k + length] for k in range(0, len(ids), length)]
        if pieces and len(pieces[-1]) < 2:
            pieces.pop()
        if len(pieces) <= heldout:
            raise DataError(f"the corpus makes {len(pieces)} pieces of {length} tokens, not more than the "
                            f"{heldout} held out (corpus.heldout_chunks); give more text or hold out fewer")
        self.train, self.heldout = pieces[:len(pieces) - heldout], pieces[len(pieces) - heldout:]
        self.tokens = len(ids)

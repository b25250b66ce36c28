"""The pretraining corpus: unlabelled text, training text only.

    texts = read_corpus(cfg.corpus, cfg.data)     # a folder of .txt / .jsonl, or the suite's training inputs

- A folder (`corpus.path`): every `*.txt` (one text per non-empty line) and `*.jsonl` (one JSON object per line,
  its `corpus.text_field`) below it, in sorted path order. A file whose name says it is a validation or test split
  (`validation`, `valid`, `val`, `dev`, `test`, as a word of its name or its folder's) is refused: pretraining on
  the rows a comparison is scored on would leak them into the backbone.
- No path: the source texts of the suite's **training** split (`data.*`, after the split protocol, so rows the
  protocol holds out for validation are not read either); never a label, never a validation or test row.

`Chunks` tokenizes the texts once, holds out whole texts (seeded, from across the corpus) for
`corpus.heldout_chunks` pieces, leaves out of training every text that shares a 13-token run with them, and
concatenates each part (T5 packs its corpus the same way) into pieces of `corpus.max_length - 1` tokens: the held-out
objective is measured on text the model has not trained on.
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
        # lines end at \n alone: str.splitlines() also breaks at U+2028, \x0c and others, which a JSON string may
        # hold raw (a valid row was refused, and every later line number was off)
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; save it as UTF-8") from None
    for number, line in enumerate(lines, 1):
        line = line.removesuffix("\r")
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


OVERLAP_NGRAM = 13  # a training text sharing a run of this many tokens with a held-out text is dropped (GPT-3's test)


def check_backbone_corpus(backbone: str, data) -> None:
    """Before fine-tuning on `data` (DataConfig): a backbone this library pretrained on the training inputs of the
    same source must have been split with the same `data.data_seed`. The split protocol draws a large task's
    validation rows from its train file with that seed: with another, most of them (988 of SST-2's 1,000 here) were
    training text of the backbone, and the fine-tuned scores measured text it had seen. One line, reading one file."""
    info = Path(str(backbone)).expanduser() / "pretrain.json"
    if not info.is_file():
        return
    try:
        made = json.loads(info.read_text())
    except (OSError, ValueError):
        return  # not ours to judge: the backbone's own check reads the checkpoint
    source, seed = made.get("data_source"), made.get("data_seed")
    if source is None or seed is None or data.source in ("synthetic",):
        return
    folder = lambda text: Path(text).expanduser().resolve()
    same = source == data.source or ("hub" not in (source, data.source) and folder(source) == folder(data.source))
    if same and seed != data.data_seed:
        raise ConfigError(f"model.backbone {backbone}: pretrained on the training inputs of {source} split with "
                          f"data.data_seed={seed}; with data.data_seed={data.data_seed} the validation rows drawn "
                          f"from the same train files would be text it trained on: set data.data_seed={seed}")


class Chunks:
    """The corpus as token pieces of `length` ids (eos not included): `train` and `heldout` lists.

    Held out: whole texts, drawn in a seeded order from across the corpus until their tokens fill `heldout` pieces;
    every training text that shares a run of `OVERLAP_NGRAM` tokens with one of them is left out of training (the
    same text again, or one built on the same passage: WSC repeats each passage with other spans), so the held-out
    loss is measured on text the model never trained on. (The corpus's last pieces, held out before, were WSC's
    last training rows, most of whose passages the training pieces held too.) The training texts and the held-out
    ones are each concatenated and cut into pieces, as T5 packs its corpus. `dropped`: the training texts left out."""

    def __init__(self, texts: list[str], tokenizer, length: int, heldout: int, seed: int = 0):
        import numpy as np

        rows: list[list[int]] = []
        for start in range(0, len(texts), 4096):  # the fast tokenizer in batches, no special tokens
            rows.extend(tokenizer(texts[start:start + 4096], add_special_tokens=False)["input_ids"])
        self.tokens = sum(map(len, rows))
        want, held, chosen = heldout * length, 0, set()
        for i in np.random.default_rng([seed, 3]).permutation(len(rows)):
            if held >= want:
                break
            if rows[i] and texts[i] not in chosen:
                chosen.add(texts[i])
                held += len(rows[i])
        grams = {tuple(row[k:k + OVERLAP_NGRAM]) for row, text in zip(rows, texts) if text in chosen
                 for k in range(max(1, len(row) - OVERLAP_NGRAM + 1))}
        n = OVERLAP_NGRAM

        def overlaps(row: list[int]) -> bool:
            return any(tuple(row[k:k + n]) in grams for k in range(max(1, len(row) - n + 1)))

        held_rows, train_rows, self.dropped = [], [], 0
        for row, text in zip(rows, texts):
            if text in chosen:
                held_rows.append(row)
                chosen.discard(text)  # its first copy; another is left out below (it overlaps)
            elif overlaps(row):
                self.dropped += 1
            else:
                train_rows.append(row)
        self.train, self.heldout = _pieces(train_rows, length), _pieces(held_rows, length)[:heldout]
        if len(self.heldout) < heldout or not self.train:
            raise DataError(f"the corpus makes {len(self.train) + len(self.heldout)} pieces of {length} tokens, not "
                            f"more than the {heldout} held out (corpus.heldout_chunks); give more text or hold out "
                            "fewer")


def _pieces(rows: list[list[int]], length: int) -> list[list[int]]:
    """The rows concatenated and cut into pieces of `length` ids (a last piece under 2 ids is left out)."""
    ids = [i for row in rows for i in row]
    pieces = [ids[k:k + length] for k in range(0, len(ids), length)]
    if pieces and len(pieces[-1]) < 2:
        pieces.pop()
    return pieces

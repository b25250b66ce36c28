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


LAYOUT = 2  # how Chunks cuts a corpus (2: held-out texts from across it); a checkpoint of another is not resumed
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

    Held out: whole texts (a text longer than four pieces counts as its pieces' worth of segments, so a corpus of a
    few long documents can still hold some out), drawn in a seeded order from across the corpus until they fill
    `heldout` pieces; every other text or segment that shares a run of `OVERLAP_NGRAM` tokens with them (the same
    text again, or one built on the same passage: WSC repeats each passage with other spans) is left out of
    training, so the held-out loss is measured on text the model never trained on. (The corpus's last pieces, held
    out before, were WSC's last training rows, most of whose passages the training pieces held too.) The training
    part and the held-out part are each concatenated and cut into pieces, as T5 packs its corpus. `dropped`: the
    texts or segments left out of training."""

    def __init__(self, texts: list[str], tokenizer, length: int, heldout: int, seed: int = 0):
        import numpy as np

        units: list[list[int]] = []  # whole texts, or segments of long ones
        keys: list[str | None] = []  # a whole text's own text (its copies are one), a segment's None
        for start in range(0, len(texts), 4096):  # the fast tokenizer in batches, no special tokens
            batch = tokenizer(texts[start:start + 4096], add_special_tokens=False)["input_ids"]
            for text, row in zip(texts[start:start + 4096], batch):
                if len(row) <= 4 * length:
                    units.append(row)
                    keys.append(text)
                else:
                    for k in range(0, len(row), length):
                        units.append(row[k:k + length])
                        keys.append(None)
        self.tokens = sum(map(len, units))
        want, held, chosen, texts_chosen = heldout * length, 0, np.zeros(len(units), bool), set()
        for i in np.random.default_rng([seed, 3]).permutation(len(units)):
            if held >= want:
                break
            if units[i] and (keys[i] is None or keys[i] not in texts_chosen):
                chosen[i] = True
                texts_chosen.add(keys[i])
                held += len(units[i])
        overlapping = _sharing_runs(units, chosen, OVERLAP_NGRAM)
        copies = np.array([k is not None and k in texts_chosen for k in keys], bool) & ~chosen
        dropped = (overlapping | copies) & ~chosen
        self.dropped = int(dropped.sum())
        self.train = _pieces([u for u, c, d in zip(units, chosen, dropped) if not c and not d], length)
        self.heldout = _pieces([u for u, c in zip(units, chosen) if c], length)[:heldout]
        if len(self.heldout) < heldout or not self.train:
            raise DataError(f"the corpus ({self.tokens} tokens) leaves {len(self.train)} pieces of {length} tokens "
                            f"to train on beside {len(self.heldout)} held out (corpus.heldout_chunks: {heldout}; "
                            f"{self.dropped} texts or segments left out for sharing a {OVERLAP_NGRAM}-token run "
                            "with held-out ones); give more text or hold out fewer")


def _sharing_runs(units: list[list[int]], chosen, n: int):
    """Which units share a run of `n` tokens with a chosen unit (a boolean array), from 64-bit hashes of every run
    of each unit, computed for the whole corpus at once (a run crossing two units is none)."""
    import numpy as np

    lengths = np.fromiter(map(len, units), dtype=np.int64, count=len(units))
    flat = np.fromiter((t for u in units for t in u), dtype=np.uint64, count=int(lengths.sum()))
    if flat.size < n:
        return np.zeros(len(units), bool)
    runs = flat.size - n + 1  # a run starts at every position but the last n - 1
    unit = np.repeat(np.arange(len(units)), lengths)[:runs]  # the unit a run starts in
    valid = np.arange(runs) + n <= np.cumsum(lengths)[unit]  # the run ends inside its unit
    hashes = np.zeros(runs, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrapping multiplication: a hash modulo 2^64
        for j in range(n):
            hashes = hashes * np.uint64(1_000_003) + flat[j:j + runs] + np.uint64(j + 1)
    mine, others = chosen[unit] & valid, ~chosen[unit] & valid
    hits = np.isin(hashes[others], np.unique(hashes[mine]))
    out = np.zeros(len(units), bool)
    out[unit[others][hits]] = True
    return out


def _pieces(rows: list[list[int]], length: int) -> list[list[int]]:
    """The rows concatenated and cut into pieces of `length` ids (a last piece under 2 ids is left out)."""
    ids = [i for row in rows for i in row]
    pieces = [ids[k:k + length] for k in range(0, len(ids), length)]
    if pieces and len(pieces[-1]) < 2:
        pieces.pop()
    return pieces

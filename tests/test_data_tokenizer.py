"""Offline tokenizer (T5 ids, deterministic, cached, atomic) and encode_batch."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hpsearch.data import (
    DataConfig,
    Example,
    decode,
    encode_batch,
    get_tokenizer,
    is_offline_shape,
    load_suite,
)
from hpsearch.data.tokenizer import train_tokenizer
from hpsearch.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def suite():
    return load_suite(DataConfig())


@pytest.fixture
def cfg(tmp_path):
    return DataConfig(cache_dir=str(tmp_path / "cache"))


def test_offline_shapes():
    for name in ["t5-tiny", "t5-small", "t5-base", "t5-large", "t5-3b", "t5-11b", "t5-v1_1-base",
                 "t5-v1_1-xxl"]:
        assert is_offline_shape(name)
    for name in ["google-t5/t5-base", "google/t5-v1_1-base", "/ckpt/t5-base", "t5-base-finetuned", "byt5"]:
        assert not is_offline_shape(name)


def test_t5_id_conventions_and_vocab_bound(suite, cfg):
    tokenizer = get_tokenizer("t5-tiny", cfg, suite, vocab_size=512)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert len(tokenizer) <= 512
    ids = tokenizer("first words: red blue").input_ids
    assert ids[-1] == 1 and max(ids) < 512
    # bytes are the base alphabet: any text encodes without <unk> and decodes exactly
    text = "Ünïcode — 日本語 \t tabs  and 🙂"
    ids = tokenizer(text).input_ids
    assert 2 not in ids and tokenizer.decode(ids, skip_special_tokens=True) == text
    # the synthetic suite's sources stay short
    assert max(len(tokenizer(e.source).input_ids) for t in suite.tasks for e in suite.split(t, "train")) <= 16


def test_vocab_is_capped_by_the_model_and_by_the_config(tmp_path):
    glue_like = [f"sentence number {i} about topic {i % 97} and word{i % 1013}" for i in range(3000)]
    small = train_tokenizer(glue_like, 300, tmp_path)
    assert len(small) == 300
    assert max(max(small(t).input_ids) for t in glue_like[:200]) < 300
    cfg = DataConfig(vocab_size=300, cache_dir=str(tmp_path))
    assert len(get_tokenizer("t5-base", cfg, load_suite(cfg), vocab_size=32128)) <= 300
    with pytest.raises(ConfigError, match="vocab_size"):
        get_tokenizer("t5-tiny", cfg, load_suite(cfg), vocab_size=100)


def test_same_texts_same_ids_and_the_cache_is_reused(suite, cfg, tmp_path, monkeypatch):
    first = get_tokenizer("t5-tiny", cfg, suite, 512)
    files = list((Path(cfg.cache_dir) / "tokenizers").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left behind
    other_cache = DataConfig(cache_dir=str(tmp_path / "elsewhere"))
    second = get_tokenizer("t5-tiny", other_cache, suite, 512)
    assert first.get_vocab() == second.get_vocab()
    sources = [e.source for e in suite.split("first", "train")[:50]]
    assert first(sources).input_ids == second(sources).input_ids
    assert files[0].read_bytes() == next((Path(other_cache.cache_dir) / "tokenizers").iterdir()).read_bytes()
    import tokenizers

    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", None)  # a retrain would fail now
    cached = get_tokenizer("t5-tiny", cfg, suite, 512)
    assert cached.get_vocab() == first.get_vocab()
    monkeypatch.undo()


def test_a_damaged_or_unwritable_tokenizer_cache_is_trained_again_and_the_version_is_in_its_key(suite, cfg,
                                                                                                monkeypatch):
    """Like the token-id cache: a cached tokenizer file that is empty or damaged (renamed into place, then the node
    crashed) is trained again and replaced, not an error on every later run; a folder that cannot be written
    keeps the trained tokenizer in the process. Another `tokenizers` version has a cache file of its own."""
    import tokenizers

    first = get_tokenizer("t5-tiny", cfg, suite, 512)
    (cached,) = (Path(cfg.cache_dir) / "tokenizers").iterdir()
    good = cached.read_bytes()
    for damage in (b"", good[: len(good) // 2]):
        cached.write_bytes(damage)
        assert get_tokenizer("t5-tiny", cfg, suite, 512).get_vocab() == first.get_vocab()
        assert cached.read_bytes() == good  # replaced by the same training
    unwritable = DataConfig(cache_dir="/proc/hpsearch-cache")  # not even root can create a folder there
    assert get_tokenizer("t5-tiny", unwritable, suite, 512).get_vocab() == first.get_vocab()
    monkeypatch.setattr(tokenizers, "__version__", "0.0.1")
    get_tokenizer("t5-tiny", cfg, suite, 512)
    assert len(list((Path(cfg.cache_dir) / "tokenizers").iterdir())) == 2


def test_training_is_deterministic_across_processes(tmp_path):
    script = textwrap.dedent(f"""
        from pathlib import Path
        from hpsearch.data.tokenizer import train_tokenizer
        texts = ["the quick brown fox %d jumps over %d lazy dogs" % (i, i * 7 % 13) for i in range(500)]
        train_tokenizer(texts, 400, Path({str(tmp_path)!r}) / __import__("sys").argv[1])
    """)
    for run, seed in (("a", "1"), ("b", "2")):
        subprocess.run([sys.executable, "-c", script, run], check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""})
    [a], [b] = (list((tmp_path / run).iterdir()) for run in "ab")
    assert a.name == b.name and a.read_bytes() == b.read_bytes()


def test_encode_batch(suite, cfg):
    tokenizer = get_tokenizer("t5-tiny", cfg, suite, 512)
    examples = [Example("first words: red", "red", 0), Example("count words: red red blue green", "12", 12.0),
                Example("lacks words: blue blue blue blue blue blue blue blue", "no", 0)]
    batch = encode_batch(examples, [0, 2, 4], tokenizer, cfg)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "decoder_attention_mask", "task_ids"}
    assert batch["task_ids"].dtype == torch.long and batch["task_ids"].tolist() == [0, 2, 4]
    assert batch["input_ids"].shape == batch["attention_mask"].shape and batch["input_ids"].shape[0] == 3
    for row, mask in zip(batch["input_ids"], batch["attention_mask"]):
        length = int(mask.sum())
        assert row[length - 1] == 1 and (row[length:] == 0).all()
    labels, decoder_mask = batch["labels"], batch["decoder_attention_mask"]
    for row, mask in zip(labels, decoder_mask):
        length = int(mask.sum())
        assert row[length - 1] == 1 and (row[length:] == -100).all() and (row[:length] >= 0).all()
    assert (labels == -100).any()  # the targets differ in length, so there is padding
    assert decode(tokenizer, labels.clamp(min=0)) == ["red", "12", "no"]


def test_truncation_keeps_eos(suite, cfg):
    tokenizer = get_tokenizer("t5-tiny", cfg, suite, 512)
    short = DataConfig(max_source_length=8, max_target_length=3)
    long_example = Example("first words: " + "red " * 40, "black white red green", 0)
    batch = encode_batch([long_example], [0], tokenizer, short)
    assert batch["input_ids"].shape == (1, 8) and batch["input_ids"][0, -1] == 1
    assert batch["labels"].shape == (1, 3) and batch["labels"][0, -1] == 1


def test_a_checkpoint_brings_its_own_tokenizer(suite, cfg, tmp_path):
    trained = get_tokenizer("t5-tiny", cfg, suite, 512)
    checkpoint = tmp_path / "checkpoint"
    trained.save_pretrained(checkpoint)
    loaded = get_tokenizer(str(checkpoint), cfg, suite, vocab_size=512)
    assert loaded.get_vocab() == trained.get_vocab()
    assert loaded("first words: red").input_ids == trained("first words: red").input_ids
    with pytest.raises(ConfigError, match="more than the model's vocab_size 100"):
        get_tokenizer(str(checkpoint), cfg, suite, vocab_size=100)


def test_an_unloadable_checkpoint_is_one_line(suite, cfg, monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your internet connection.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(DataError) as e:
        get_tokenizer("google-t5/t5-base", cfg, suite, 32128)
    message = str(e.value)
    assert "google-t5/t5-base" in message and "couldn't connect" in message and "\n" not in message


@pytest.mark.parametrize("lengths", [(128, 16), (12, 2)])  # the defaults, and truncating nearly every row
def test_tokenized_suite_batches_equal_encode_batch(lengths, tmp_path):
    """Training and evaluation collate from ids tokenized once: the tensors must be encode_batch's, row for row,
    on real GLUE rows (CoLA, RTE, STS-B: long and short sources, numeric targets) and on the synthetic suite."""
    import random

    from hpsearch.data.tokens import TokenizedSuite
    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    for source, tasks in (("synthetic", None), (str(glue), ["cola", "rte", "stsb"])):
        cfg = DataConfig(source=source, **({"tasks": tasks} if tasks else {}), max_train_rows=200, max_eval_rows=50,
                         max_source_length=lengths[0], max_target_length=lengths[1],
                         cache_dir=str(tmp_path / "cache"))
        suite = load_suite(cfg)
        tokenizer = get_tokenizer("t5-tiny", cfg, suite, 8192)
        tokens = TokenizedSuite(suite, tokenizer, cfg)
        rng = random.Random(0)
        for split in ("train", "validation"):
            for _ in range(5):
                picks = [(t, rng.randrange(len(suite.split(suite.tasks[t], split))))
                         for t in (rng.randrange(len(suite.tasks)) for _ in range(7))]
                want = encode_batch([suite.split(suite.tasks[t], split)[i] for t, i in picks], [t for t, _ in picks],
                                    tokenizer, cfg)
                got = tokens.batch(picks, split)
                assert set(got) == set(want)
                for key in want:
                    assert torch.equal(got[key], want[key]), (source, split, key)


class Counting:
    """A tokenizer that counts its calls (the rest is the wrapped tokenizer's)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)


def test_token_ids_are_cached_on_disk_under_the_tokenizer_the_length_and_the_texts(tmp_path):
    """The next TokenizedSuite reads the ids its predecessor stored instead of tokenizing; another maximum length,
    another tokenizer or a damaged file tokenize again (and give the tokenizer's ids)."""
    from hpsearch.data.tokens import TokenizedSuite

    cfg = DataConfig(max_train_rows=200, max_eval_rows=50, cache_dir=str(tmp_path / "cache"))
    suite = load_suite(cfg)
    task = suite.tasks[0]
    tokenizer = Counting(get_tokenizer("t5-tiny", cfg, suite, 8192))
    want = TokenizedSuite(suite, tokenizer, cfg).ids(task, "train")
    assert tokenizer.calls == 2 and len(list((tmp_path / "cache" / "tokens").glob("*.npz"))) == 2  # sources, targets
    direct = tokenizer.tokenizer([r.source for r in suite.split(task, "train")], max_length=cfg.max_source_length,
                                 truncation=True)["input_ids"]
    assert want[0] == direct and len(want[0]) == 200

    again = Counting(tokenizer.tokenizer)
    assert TokenizedSuite(suite, again, cfg).ids(task, "train") == want and again.calls == 0  # read from disk

    shorter = DataConfig(**{**cfg.__dict__, "max_source_length": 6})
    got = TokenizedSuite(suite, again, shorter).ids(task, "train")
    assert again.calls == 1 and got[1] == want[1] and got[0] != want[0] and max(map(len, got[0])) == 6

    small = DataConfig(**{**cfg.__dict__, "vocab_size": 300})
    other = Counting(get_tokenizer("t5-tiny", small, suite, 8192))
    got = TokenizedSuite(suite, other, cfg).ids(task, "train")
    assert other.calls == 2 and got[0] != want[0]

    left = Counting(tokenizer.tokenizer)
    left.tokenizer.truncation_side = "left"  # the same definition, other ids
    try:
        got = TokenizedSuite(suite, left, shorter).ids(task, "train")
    finally:
        left.tokenizer.truncation_side = "right"
    assert left.calls == 2 and got[0] != TokenizedSuite(suite, again, shorter).ids(task, "train")[0]

    files = sorted((tmp_path / "cache" / "tokens").glob("*.npz"))
    for k, path in enumerate(files):  # cut short, or one byte flipped at a time further in
        data = bytearray(path.read_bytes())
        if k % 2:
            data[k * 7 % len(data)] ^= 0xFF
        path.write_bytes(bytes(data if k % 2 else data[:100]))
    damaged = Counting(tokenizer.tokenizer)
    assert TokenizedSuite(suite, damaged, cfg).ids(task, "train") == want


def test_damaged_token_files_read_as_absent(tmp_path):
    """Every single-byte corruption of a stored file reads as no file (or as the very rows stored), never as an
    error: it is a cache, and the run tokenizes again."""
    from hpsearch.data.tokens import read_ids, write_ids

    rows = [[5, 6, 7], [8], [9, 10]]
    path = tmp_path / "ids.npz"
    write_ids(path, rows)
    good = path.read_bytes()
    for position in range(0, len(good), 3):
        for flip in (0x01, 0x80, 0xFF):
            data = bytearray(good)
            data[position] ^= flip
            path.write_bytes(bytes(data))
            assert read_ids(path, 3) in (None, rows), position
    assert read_ids(tmp_path / "absent.npz", 3) is None


def test_the_token_cache_keeps_the_most_recently_used_files_within_its_budget(tmp_path):
    """`prune`: least recently used (a read marks a file used) files go first until the folder fits the budget;
    the file just written stays even alone over it; a killed writer's temporary file goes after an hour, a live
    one's stays. Through TokenizedSuite: a budget of one file keeps only the latest, and 0 writes nothing."""
    import os
    import time

    from hpsearch.data.tokens import STALE_TEMPORARY_S, TokenizedSuite, prune, read_ids, write_ids

    folder = tmp_path / "tokens"
    rows = [[5, 6, 7, 8] * 50] * 20
    paths = [folder / f"{name}.npz" for name in "abcd"]
    now = time.time()
    for k, path in enumerate(paths[:3]):
        assert write_ids(path, rows)
        os.utime(path, (now - 100 + k, now - 100 + k))  # written a, b, c in that order
    size = paths[0].stat().st_size
    assert read_ids(paths[0], len(rows)) == rows  # a used now: b is the least recently used
    stale, live = folder / ".x.npz.1.ab.tmp.npz", folder / ".y.npz.2.cd.tmp.npz"
    for path, age in ((stale, STALE_TEMPORARY_S + 60), (live, 5)):
        path.write_bytes(b"partial")
        os.utime(path, (now - age, now - age))
    assert write_ids(paths[3], rows)
    prune(folder, 3 * size, keep=paths[3])
    assert sorted(p.name for p in folder.iterdir()) == [".y.npz.2.cd.tmp.npz", "a.npz", "c.npz", "d.npz"]
    prune(folder, 0, keep=paths[3])  # over budget alone: the file just written stays
    assert sorted(p.name for p in folder.iterdir()) == [".y.npz.2.cd.tmp.npz", "d.npz"]

    cfg = DataConfig(max_train_rows=50, max_eval_rows=20, cache_dir=str(tmp_path / "cache"))
    suite = load_suite(cfg)
    tokenizer = get_tokenizer("t5-tiny", cfg, suite, 8192)
    one = DataConfig(**{**cfg.__dict__, "token_cache_mb": 1e-6})  # under any file's size: the latest alone stays
    tokens = TokenizedSuite(suite, tokenizer, one)
    for task in suite.tasks[:2]:
        tokens.ids(task, "train")
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 1
    off = DataConfig(**{**cfg.__dict__, "token_cache_mb": 0, "cache_dir": str(tmp_path / "off")})
    TokenizedSuite(suite, Counting(tokenizer), off).ids(suite.tasks[0], "train")
    assert not (tmp_path / "off" / "tokens").exists()


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "big", True])
def test_a_bad_token_cache_budget_is_named(value):
    from hpsearch.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.token_cache_mb: .*; expected a number of megabytes >= 0"):
        DataConfig(token_cache_mb=value).validate()


def test_evaluation_batches_rows_shortest_first_and_never_tokenizes_again(tmp_path):
    """`Evaluator.evaluate` (the recipe's validation and test scoring) sorts each task's rows by source length, so
    a batch's rows have similar lengths, and collates them from the ids tokenized once: a second evaluation calls
    the tokenizer not at all. A model that answers each row with its own target scores 100 on every task: the
    predictions reach their rows through the sort."""
    from types import SimpleNamespace

    from hpsearch.config import load_config
    from hpsearch.data.tokens import TokenizedSuite
    from hpsearch.train.evaluate import Evaluator

    data = DataConfig(max_train_rows=20, max_eval_rows=40, cache_dir=str(tmp_path / "cache"))
    suite = load_suite(data)
    tokenizer = Counting(get_tokenizer("t5-tiny", data, suite, 8192))
    tokens = TokenizedSuite(suite, tokenizer, data)
    answers = {}  # source ids -> target ids, over every task's validation rows
    for task in suite.tasks:
        for src, tgt in zip(*tokens.ids(task, "validation")):
            answers[tuple(src)] = tgt
    calls = tokenizer.calls
    batches: list[tuple[int, list[int]]] = []  # (task, each row's source length)

    class Oracle:  # a model that generates each row's target
        def eval(self):
            pass

        train = freeze_prompts = eval

        def generate(self, input_ids, attention_mask, task_ids, **kwargs):
            rows = [input_ids[i][attention_mask[i].bool()].tolist() for i in range(len(input_ids))]
            batches.append((int(task_ids[0]), [len(r) for r in rows]))
            out = torch.zeros(len(rows), 1 + max(len(answers[tuple(r)]) for r in rows), dtype=torch.long)
            for i, r in enumerate(rows):  # after the decoder's start token (pad), as generate returns them
                out[i, 1:1 + len(answers[tuple(r)])] = torch.tensor(answers[tuple(r)])
            return out

    cfg = load_config(None, ["train.eval_batch_size=4"])
    evaluator = Evaluator(SimpleNamespace(module=Oracle()), suite, tokens, cfg, 0, 1, torch.device("cpu"))
    for _ in range(2):
        batches.clear()
        metrics = evaluator.evaluate("validation")
        assert metrics["score"] == 100.0 and all(metrics[f"task/{t}/score"] == 100.0 for t in suite.tasks)
        for t in range(len(suite.tasks)):
            mine = [n for task, lengths in batches if task == t for n in lengths]
            assert len(mine) == len(suite.split(suite.tasks[t], "validation")) and mine == sorted(mine), mine
        assert len({n for _, lengths in batches for n in lengths}) > 3  # rows of several lengths to sort
    assert tokenizer.calls == calls  # every batch collated from the stored ids


def test_every_target_must_fit_what_training_keeps_and_evaluation_generates(tmp_path):
    """A label word cut by `train.max_new_tokens` never parses: with a 300-token vocabulary 'not_entailment' takes 9
    tokens, and a perfect model scored 44.9 on RTE. A number cut by `data.max_target_length` trains on another
    value ('3' for '3.8'). Each is a one-line ConfigError naming the field and what would fit."""
    from hpsearch.data.tokenizer import check_targets_fit, longest_target, offline_tokenizer

    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    cfg = DataConfig(source=str(glue), tasks=["rte", "mrpc", "stsb"], vocab_size=300, max_train_rows=200,
                     max_eval_rows=20, cache_dir=str(tmp_path / "cache"))
    suite = load_suite(cfg)
    tokenizer = get_tokenizer("t5-tiny", cfg, suite, 8192)
    words = {t: len(tokenizer(t, add_special_tokens=False).input_ids) for t in ("not_entailment", "not_equivalent")}
    # the drivers' check counts with the same BPE without transformers' wrapper (config.check_run_data)
    assert longest_target(offline_tokenizer(cfg, suite, 8192), suite.tasks) == longest_target(tokenizer, suite.tasks)
    longest = max(words.values())
    assert longest > 8, words  # cut by the default max_new_tokens=8
    with pytest.raises(ConfigError, match=rf"^train.max_new_tokens: 8 cannot generate (rte|mrpc)'s target "
                                          rf"'not_(entailment|equivalent)' \({longest} tokens with this tokenizer\); "
                                          rf"expected at least {longest}$"):
        check_targets_fit(tokenizer, suite.tasks, 16, 8)
    with pytest.raises(ConfigError, match=rf"^data.max_target_length: {longest} cuts .* expected at least "
                                          rf"{longest + 1}$"):
        check_targets_fit(tokenizer, suite.tasks, longest, longest)
    check_targets_fit(tokenizer, suite.tasks, longest + 1, longest)  # fits exactly
    stsb = ["stsb"]
    numbers = max(len(tokenizer(t, add_special_tokens=False).input_ids) for t in ("0.0", "3.8", "5.0", "4.6"))
    with pytest.raises(ConfigError, match=r"^data.max_target_length: 2 cuts stsb's target '\d\.\d'"):
        check_targets_fit(tokenizer, stsb, 2, 8)
    assert numbers >= 2


def test_a_pretrained_checkpoints_tokenizer_checks_the_targets_before_anything_starts(tmp_path):
    """A local checkpoint with the tokenizer `python -m hpsearch.pretrain` writes (transformers' own fast one): the
    drivers read it with `tokenizers` alone and count every target as the workers' transformers tokenizer does, so a
    label word it cuts is one line before anything starts (each worker said it after Ray had started). A tokenizer
    transformers loads as a model's own class (T5's adjusts its pre-tokenizer) is left to the workers."""
    import json

    from hpsearch.config import check_run_data, load_config
    from hpsearch.data.tokenizer import longest_target, plain_checkpoint_tokenizer
    from hpsearch.model.backbones import named_config
    from hpsearch.pretrain.config import CorpusConfig
    from hpsearch.pretrain.objective import corpus_tokenizer

    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    cfg = load_config(None, [f"data.source={glue}", "data.tasks=rte,mrpc,stsb", "data.max_train_rows=200",
                             "data.max_eval_rows=20", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300"])
    suite = load_suite(cfg.data)
    checkpoint = tmp_path / "backbone"  # as python -m hpsearch.pretrain writes it: its BPE with T5's sentinels,
    texts = [e.source for t in suite.tasks for e in suite.split(t, "train")]  # beside a T5 config
    corpus_tokenizer(texts, 300 + 100, CorpusConfig(), str(tmp_path / "cache")).save_pretrained(checkpoint)
    named_config("t5-tiny", vocab_size=400).save_pretrained(checkpoint)
    driver, worker = plain_checkpoint_tokenizer(str(checkpoint)), get_tokenizer(str(checkpoint), cfg.data, suite, 400)
    assert "<extra_id_0>" in worker.get_vocab() and json.loads((checkpoint / "config.json").read_text())[
        "model_type"] == "t5"
    assert driver is not None and type(driver).__module__.startswith("tokenizers")
    longest = longest_target(worker, suite.tasks)
    assert longest_target(driver, suite.tasks) == longest and longest[0] > 8  # the default max_new_tokens cuts it
    cfg.model.backbone = str(checkpoint)
    with pytest.raises(ConfigError, match=rf"^train.max_new_tokens: 8 cannot generate (rte|mrpc)'s target "
                                          rf"'not_(entailment|equivalent)' \({longest[0]} tokens"):
        check_run_data(cfg)
    cfg.train.max_new_tokens, cfg.data.max_target_length = longest[0], longest[0] + 1
    check_run_data(cfg)  # fits exactly
    cfg.train.max_new_tokens = 8
    settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "T5Tokenizer"}))
    assert plain_checkpoint_tokenizer(str(checkpoint)) is None
    check_run_data(cfg)  # left to the workers


@pytest.mark.parametrize("zero3", [False, True])
def test_two_ranks_evaluation_gathers_once_and_decodes_in_lockstep_only_under_zero3(tmp_path, monkeypatch, zero3):
    """Each rank generates its share of every task's rows; one gather per evaluation brings every task's predictions
    together (it was one per task). `synced_gpus` (a flag all-reduced and read on the host at every decoding step)
    only under ZeRO-3, whose forwards gather parameters collectively. The gather is played by the two evaluators'
    part of the other rank, which answers every row it holds right."""
    from types import SimpleNamespace

    from hpsearch.config import load_config
    from hpsearch.data import decode
    from hpsearch.data.tokens import TokenizedSuite
    from hpsearch.train.evaluate import Evaluator

    data = DataConfig(max_train_rows=20, max_eval_rows=30, cache_dir=str(tmp_path / "cache"))
    suite = load_suite(data)
    tokens = TokenizedSuite(suite, get_tokenizer("t5-tiny", data, suite, 8192), data)
    answers = {tuple(s): t for task in suite.tasks for s, t in zip(*tokens.ids(task, "validation"))}
    synced = []

    class Oracle:
        def eval(self):
            pass

        train = freeze_prompts = eval

        def generate(self, input_ids, attention_mask, task_ids, synced_gpus, **kwargs):
            synced.append(synced_gpus)
            rows = [input_ids[i][attention_mask[i].bool()].tolist() for i in range(len(input_ids))]
            out = torch.zeros(len(rows), 1 + max(len(answers[tuple(r)]) for r in rows), dtype=torch.long)
            for i, r in enumerate(rows):
                out[i, 1:1 + len(answers[tuple(r)])] = torch.tensor(answers[tuple(r)])
            return out

    gathers = []

    def all_gather_object(gathered, obj):  # this rank's predictions, and the other rank's rows answered right
        gathers.append(obj)
        other = {task: {i: decode(tokens.tokenizer, [[0, *target]])[0]
                        for i, target in enumerate(tokens.ids(task, "validation")[1]) if i not in preds}
                 for task, preds in obj.items()}
        gathered[:] = [obj, other]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    cfg = load_config(None, ["train.eval_batch_size=4"])
    engine = SimpleNamespace(module=Oracle(), zero_optimization_partition_weights=lambda: zero3)
    for rank in (0, 1):
        gathers.clear()
        metrics = Evaluator(engine, suite, tokens, cfg, rank, 2, torch.device("cpu")).evaluate("validation")
        assert len(gathers) == 1 and set(gathers[0]) == set(suite.tasks)  # one gather per evaluation, every task
        for task in suite.tasks:  # this rank generated its own share of the rows: every other row
            assert set(gathers[0][task]) == set(range(rank, len(suite.split(task, "validation")), 2))
        assert metrics["score"] == 100.0 and all(metrics[f"task/{t}/score"] == 100.0 for t in suite.tasks)
    assert synced and set(synced) == {zero3}


def test_a_checkpoint_without_its_tokenizer_files_is_refused(tmp_path):
    """transformers builds T5's slow tokenizer around nothing for a folder without tokenizer files: every word became
    <unk> (id 2) and training went on. The workers refuse it, as the drivers do before anything starts."""
    from hpsearch.model.backbones import load_backbone

    folder = tmp_path / "backbone"
    load_backbone("t5-tiny").save_pretrained(folder)
    data = DataConfig(max_train_rows=10, max_eval_rows=4, cache_dir=str(tmp_path / "cache"))
    suite = load_suite(data)
    with pytest.raises(ConfigError, match=r"backbone has no tokenizer \(tokenizer.json or spiece.model\)"):
        get_tokenizer(str(folder), data, suite, 4096)
    train_tokenizer(["some words here", "and more there"] * 20, 300, tmp_path / "cache").save_pretrained(folder)
    tokenizer = get_tokenizer(str(folder), data, suite, 4096)  # with its files: its own tokenizer
    assert 2 not in tokenizer("some words", add_special_tokens=False).input_ids

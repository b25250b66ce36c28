"""`python -m hpsearch.pretrain`: T5 span corruption (hand-worked and counted), the corpus reader (training text
only), a run with Ray Train that lowers the loss and whose backbone fine-tunes, and resume = an uninterrupted run."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpsearch.errors import ConfigError, DataError
from hpsearch.pretrain.config import CorpusConfig
from hpsearch.pretrain.corpus import describe_corpus, read_folder, suite_texts
from hpsearch.pretrain.spans import corrupt, noise_mask, span_counts

ROOT = Path(__file__).resolve().parents[1]
GLUE = ROOT.parent / "shared" / "data" / "glue"
TINY = ["model.backbone=t5-tiny", "data.source=synthetic", "data.synthetic_train_rows=300",
        "data.synthetic_eval_rows=40", "corpus.max_length=32", "corpus.heldout_chunks=16", "train.lr=3e-3",
        "train.warmup_steps=2", "train.micro_batch_size=8", "train.eval_batch_size=8"]


def pretrain(*args, cwd, timeout=600):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "hpsearch.pretrain", *args, "--tracking-uri",
                           f"sqlite:///{cwd}/mlflow.db"], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- span corruption -----------------------------------------------------------------------------------------------
def test_span_corruption_against_a_hand_worked_example():
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    mask = [False, False, True, True, False, False, False, True]
    inputs, targets = corrupt(ids, mask, sentinels=[99, 98, 97], eos=1)
    assert inputs == [5, 6, 99, 9, 10, 11, 98, 1]       # each span -> its sentinel, eos appended
    assert targets == [99, 7, 8, 98, 12, 1]             # sentinel, the tokens it hid; eos appended
    assert corrupt([5, 6, 7], [True, False, False], [99], eos=1) == ([99, 6, 7, 1], [99, 5, 1])
    assert corrupt([5, 6], [False, False], [99], eos=1) == ([5, 6, 1], [1])
    # corpus.targets=full: the same inputs, the whole original piece as the target
    assert corrupt(ids, mask, sentinels=[99, 98, 97], eos=1, full=True) == (inputs, [*ids, 1])
    with pytest.raises(ValueError, match="sentinel"):
        corrupt([5, 6, 7, 8], [True, False, True, False], [99], eos=1)


def _runs(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of True, in order."""
    runs, n = [], 0
    for m in list(mask) + [False]:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_noise_masks_have_t5s_counts_and_mean_span_length():
    # T5's rule, by hand: round(L x 0.15) noise tokens in round(noise / 3) spans (half to even, as numpy and tf round)
    assert span_counts(127, 0.15, 3.0) == (19, 6)
    assert span_counts(10, 0.15, 3.0) == (2, 1)       # 1.5 -> 2 noise tokens, 2/3 -> 1 span
    assert span_counts(3, 0.15, 3.0) == (1, 1)        # at least one noise token ...
    assert span_counts(1, 0.15, 3.0) == (0, 0)        # ... unless nothing can stay
    lengths = []
    for length in (2, 5, 31, 127):
        for seed in range(30):
            mask = noise_mask(length, 0.15, 3.0, np.random.default_rng(seed))
            noise, spans = span_counts(length, 0.15, 3.0)
            runs = _runs(mask)
            assert int(mask.sum()) == noise and len(runs) == spans, (length, seed, mask)
            assert not mask[0]  # the sequence starts with kept tokens
            if length == 127:
                lengths += runs
    assert np.mean(lengths) == pytest.approx(19 / 6)  # the mean span length the counts fix


def test_span_lengths_are_a_uniformly_random_split():
    """T5 splits the 19 noise tokens of a 127-token piece into 6 non-empty runs uniformly over all compositions:
    the first run has length k with probability C(19 - k - 1, 4) / C(18, 5). A chi-square test against that law
    over 3,000 masks (a biased split, e.g. equal runs or cuts drawn with replacement, fails it)."""
    from math import comb

    from scipy.stats import chisquare

    first = [_runs(noise_mask(127, 0.15, 3.0, np.random.default_rng([5, s])))[0] for s in range(3000)]
    expected = np.array([comb(19 - k - 1, 4) / comb(18, 5) for k in range(1, 15)])
    assert expected.sum() == pytest.approx(1.0)
    bins = [1, 2, 3, 4, 5, 6]  # and 7+ together
    observed = [first.count(k) for k in bins] + [sum(k >= 7 for k in first)]
    probs = list(expected[:6]) + [expected[6:].sum()]
    assert chisquare(observed, np.array(probs) * len(first)).pvalue > 1e-3
    assert len({tuple(noise_mask(127, 0.15, 3.0, np.random.default_rng(s))) for s in range(30)}) == 30  # random


def test_a_batch_is_its_pieces_corrupted(tmp_path):
    """Every row of a training batch, its sentinels filled back from its target, is the piece it was cut from;
    eos ends inputs and targets and appears nowhere else (no span crosses it)."""
    from hpsearch.pretrain.config import load_pretrain_config
    from hpsearch.pretrain.objective import SpanCorruption

    cfg, corpus = load_pretrain_config(None, [*TINY, f"data.cache_dir={tmp_path}", "corpus.targets=spans"])
    assert CorpusConfig().targets == "full"  # the default; T5's short targets here
    import dataclasses
    objective = SpanCorruption(cfg, 0, 1, {"corpus": dataclasses.asdict(corpus)})
    sentinels = set(objective.sentinels)
    assert len(sentinels) == 100 and max(sentinels) < objective.model.t5.config.vocab_size
    for _ in range(3):
        picks = next(copy.deepcopy(objective.sampler))
        batch = objective.batch()
        assert batch["input_ids"].shape[0] == len(picks) == 8
        for row, (_, piece_index) in enumerate(picks):
            piece = objective.chunks.train[piece_index]
            inputs = batch["input_ids"][row][batch["attention_mask"][row] == 1].tolist()
            targets = batch["labels"][row][batch["labels"][row] != -100].tolist()
            assert inputs[-1] == targets[-1] == objective.eos
            assert objective.eos not in inputs[:-1] + targets[:-1]
            spans, current = {}, None
            for token in targets[:-1]:
                if token in sentinels:
                    current = spans.setdefault(token, [])
                else:
                    current.append(token)
            rebuilt = [t for token in inputs[:-1] for t in (spans[token] if token in sentinels else [token])]
            assert rebuilt == piece
            assert sum(map(len, spans.values())) == span_counts(len(piece), 0.15, 3.0)[0]

    # corpus.targets=full: the same corrupted inputs (the same masks), the whole piece and eos as the target
    cfg, corpus = load_pretrain_config(None, [*TINY, f"data.cache_dir={tmp_path}", "corpus.targets=full"])
    full = SpanCorruption(cfg, 0, 1, {"corpus": dataclasses.asdict(corpus)})
    spans_first = objective.heldout[0][0]
    picks, batch = next(copy.deepcopy(full.sampler)), full.batch()
    for row, (_, piece_index) in enumerate(picks):
        targets = batch["labels"][row][batch["labels"][row] != -100].tolist()
        assert targets == [*full.chunks.train[piece_index], full.eos]
        assert set(sentinels) & set(batch["input_ids"][row].tolist())  # the inputs are still corrupted
    assert full.heldout[0][0] == spans_first and full.heldout[0][1] == [*full.chunks.heldout[0], full.eos]
    with pytest.raises(ConfigError, match="corpus.targets: 'all' is not one of spans, full"):
        load_pretrain_config(None, ["corpus.targets=all"])
    for bad in ("nan", "inf", "0.5"):  # nan < 1 is False: it passed, then int(nan) was a traceback
        with pytest.raises(ConfigError, match=r"corpus.mean_span_length: .*; expected a finite number >= 1"):
            load_pretrain_config(None, [f"corpus.mean_span_length={bad}"])


# ---- the corpus ----------------------------------------------------------------------------------------------------
def test_the_corpus_reader_reads_text_and_refuses_validation_and_test_files(tmp_path):
    ok = tmp_path / "ok"
    (ok / "news").mkdir(parents=True)
    (ok / "a.txt").write_text("one text\n\n  two   texts \n")
    (ok / "news" / "b.jsonl").write_text('{"text": "three"}\n{"text": "four", "id": 1}\n')
    (ok / "contest-devices.txt").write_text("five\n")  # words that merely contain "test" or "dev" are fine
    assert read_folder(ok) == ["one text", "two texts", "five", "three", "four"]
    for name in ("validation.jsonl", "test.txt", "dev/news.txt", "rte/val.jsonl", "my_test_set.txt"):
        bad = tmp_path / name.replace("/", "_").replace(".", "_")
        (bad / name).parent.mkdir(parents=True)
        (bad / "train.txt").write_text("fine\n")
        (bad / name).write_text('{"text": "held out"}\n' if name.endswith(".jsonl") else "held out\n")
        with pytest.raises(DataError, match="validation or test file"):
            read_folder(bad)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: no string field 'text'"):
        read_folder(broken)
    # a JSON string may hold U+2028 or U+0085 raw, a text line a form feed; lines end at \n (and \r\n) alone
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "train.jsonl").write_bytes('{"text": "a\u2028b"}\r\n{"text": "c\u0085d"}\n'.encode())
    (odd / "more.txt").write_bytes(b"e\x0cf\ng\n")
    assert read_folder(odd) == ["e f", "g", "a b", "c d"]
    (odd / "train.jsonl").write_bytes('{"text": "a\u2028b"}\n{"body": 1}\n'.encode())
    with pytest.raises(DataError, match=r"train.jsonl:2: no string field"):  # the line numbers count \n only
        read_folder(odd)


def test_held_out_pieces_are_whole_texts_the_model_never_trains_on(tmp_path):
    """The held-out pieces were the corpus's last: on the default GLUE corpus, WSC's last training rows, whose
    passages the training pieces also held (WSC repeats each passage with other spans; 63 % of the held-out 12-token
    runs were in training). Held out now: whole texts drawn (seeded) from across the corpus; every training text
    sharing a 13-token run with one of them (a copy, a passage with other spans) is left out of training."""
    from hpsearch.pretrain.corpus import OVERLAP_NGRAM, Chunks
    from hpsearch.pretrain.objective import corpus_tokenizer

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    passages = [" ".join(rng.choice(words, 30)) for _ in range(120)]
    # each passage twice, with different spans (as WSC), and some whole texts repeated
    texts = [f"{p} span: {rng.choice(words)}" for p in passages for _ in range(2)] + passages[:10]
    tokenizer = corpus_tokenizer(texts, 512, CorpusConfig(), str(tmp_path))
    chunks = Chunks(texts, tokenizer, 31, 8, seed=1)
    assert len(chunks.heldout) == 8 and chunks.train
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    stream = [i for piece in chunks.train for i in piece]
    runs = {tuple(stream[k:k + OVERLAP_NGRAM]) for k in range(len(stream) - OVERLAP_NGRAM + 1)}
    held = [k for k, row in enumerate(ids) if any(row[:OVERLAP_NGRAM] == p[j:j + OVERLAP_NGRAM]
                                                   for p in chunks.heldout for j in range(len(p)))]
    assert held and not any(tuple(ids[k][:OVERLAP_NGRAM]) in runs for k in held)  # nothing of them in training
    assert max(held) - min(held) > len(texts) / 2  # from across the corpus, not its end
    assert chunks.dropped >= len({passages[k // 2] for k in held if k < 240}) // 2  # their other copies left out
    assert Chunks(texts, tokenizer, 31, 8, seed=1).heldout == chunks.heldout  # seeded
    assert Chunks(texts, tokenizer, 31, 8, seed=2).heldout != chunks.heldout
    # a corpus of one long document: its segments are held out (it made one unit, and no training text was left)
    book = [" ".join(rng.choice(words, 3000))]
    one = Chunks(book, tokenizer, 31, 4, seed=1)
    stream = [i for piece in one.train for i in piece]
    assert len(one.heldout) == 4 and len(stream) + sum(map(len, one.heldout)) >= 0.95 * one.tokens
    assert not any(tuple(p[:OVERLAP_NGRAM]) in {tuple(stream[k:k + OVERLAP_NGRAM]) for k in range(len(stream))}
                   for p in one.heldout)
    with pytest.raises(DataError, match=r"leaves \d+ pieces of 31 tokens to train on beside \d+ held out "
                                        r"\(corpus.heldout_chunks: 500; 0 texts or segments left out"):
        Chunks(book, tokenizer, 31, 500)


def test_the_default_corpus_is_the_training_inputs_only():
    from hpsearch.data import DataConfig, load_suite

    suite = load_suite(DataConfig())
    texts = suite_texts(suite)
    # every training row's input, and none of another split's (counted from the suite's own sizes)
    assert len(texts) == sum(suite.sizes("train")) and all(isinstance(t, str) and t for t in texts)
    assert not set(texts) & {e.source for t in suite.tasks for s in ("validation", "test") for e in suite.split(t, s)}
    assert describe_corpus(CorpusConfig(), DataConfig()) == (f"training inputs of synthetic "
                                                             f"({', '.join(suite.tasks)})")
    if GLUE.is_dir():  # real rows: no validation or test input, no label, reaches the corpus
        # (SST-2's own train and validation files share a few short phrases, so it is not among these)
        suite = load_suite(DataConfig(source=str(GLUE), tasks=["rte", "cb", "mrpc"]))
        texts = set(suite_texts(suite))
        held_out = {e.source for t in suite.tasks for s in ("validation", "test") for e in suite.split(t, s)}
        assert len(texts) > 6_000 and len(held_out) > 700 and not texts & held_out
        assert not texts & {e.target for t in suite.tasks for e in suite.split(t, "train")}
        # the backbone's pretrain.json names the tasks the default list resolves to, not the synthetic names
        every = DataConfig(source=str(GLUE))
        assert describe_corpus(CorpusConfig(), every) == (f"training inputs of {GLUE} (cola, sst2, mrpc, stsb, "
                                                          "mnli, qnli, rte, boolq, cb, copa, wic, wsc, scitail)")
        assert describe_corpus(CorpusConfig(path="texts/"), every) == "texts/"


def test_a_backbone_pretrained_on_the_suite_is_fine_tuned_with_the_seed_it_was_split_with(tmp_path):
    """The split protocol draws a large task's validation rows from its train file with `data.data_seed`: a
    backbone pretrained on the suite's training inputs at one seed has trained on most of the validation rows of
    another seed's split (SST-2: all but a few of its 1,000 here). Fine-tuning it with another seed is one line."""
    from hpsearch.data import DataConfig, load_suite
    from hpsearch.pretrain.corpus import check_backbone_corpus

    if GLUE.is_dir():  # the leak itself, on the real rows
        corpus = set(suite_texts(load_suite(DataConfig(source=str(GLUE), tasks=["sst2"], data_seed=42))))
        seen = lambda seed: sum(e.source in corpus for e in load_suite(
            DataConfig(source=str(GLUE), tasks=["sst2"], data_seed=seed)).split("sst2", "validation"))
        assert seen(7) > 900 and seen(42) < 50, (seen(7), seen(42))
    backbone = tmp_path / "backbone"
    backbone.mkdir()
    (backbone / "pretrain.json").write_text(json.dumps({"data_source": str(GLUE), "data_seed": 42}))
    with pytest.raises(ConfigError, match=rf"model.backbone {backbone}: pretrained on the training inputs of .*glue "
                                          r"split with data.data_seed=42; with data.data_seed=7 .* set "
                                          r"data.data_seed=42$"):
        check_backbone_corpus(str(backbone), DataConfig(source=str(GLUE), data_seed=7))
    check_backbone_corpus(str(backbone), DataConfig(source=str(GLUE), data_seed=42))  # the same split
    check_backbone_corpus(str(backbone), DataConfig(source="synthetic", data_seed=7))  # other rows altogether
    (backbone / "pretrain.json").write_text(json.dumps({"data_source": None, "data_seed": 42}))  # corpus.path
    check_backbone_corpus(str(backbone), DataConfig(source=str(GLUE), data_seed=7))


# ---- runs ----------------------------------------------------------------------------------------------------------
def heldout_loss_of(backbone: Path, objective) -> float:
    """The held-out loss of an exported backbone (the objective's corrupted inputs and targets), computed with stock
    T5 (HF's own loss per row)."""
    from transformers import T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration.from_pretrained(backbone).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in objective.heldout:
            out = t5(input_ids=torch.tensor([inputs]), labels=torch.tensor([targets]))
            total += out.loss.item() * len(targets)
            tokens += len(targets)
    return total / tokens


@pytest.mark.slow
def test_pretraining_resume_equals_an_uninterrupted_run_and_exports_the_best_weights(tmp_path):
    import dataclasses

    from hpsearch.pretrain.config import load_pretrain_config
    from hpsearch.pretrain.objective import SpanCorruption

    args = ["--local", *TINY, "train.max_steps=12", "train.eval_every=6", "train.log_every=6"]
    full = pretrain(*args, f"train.output_dir={tmp_path}/full", cwd=tmp_path)
    resumed = pretrain(*args, f"train.output_dir={tmp_path}/resumed", "--resume-from",
                       str(tmp_path / "full" / "checkpoints" / "step_6"), cwd=tmp_path)
    assert full["step"] == resumed["step"] == 12
    assert resumed["loss"] == pytest.approx(full["loss"], rel=1e-5)
    assert resumed["heldout_loss"] == pytest.approx(full["heldout_loss"], rel=1e-5)
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / run / "backbone" / "model.safetensors") for run in ("full", "resumed"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # the export is the best held-out step's weights: stock T5 on them gives the held-out loss reported there
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    best = max(rows, key=lambda r: r["heldout_accuracy"])
    assert full["best_step"] == best["step"]
    cfg, corpus = load_pretrain_config(None, TINY)
    assert cfg.train.embedding_lr_scale == 20  # the default: the runs above resumed two AdamW groups
    assert corpus.targets == "full"  # ...and trained on the default's whole-piece targets
    objective = SpanCorruption(cfg, 0, 1, {"corpus": dataclasses.asdict(corpus)})
    assert heldout_loss_of(tmp_path / "full" / "backbone", objective) == pytest.approx(best["heldout_loss"],
                                                                                          rel=1e-4)


@pytest.mark.slow
def test_pretraining_with_ray_lowers_the_loss_and_its_backbone_fine_tunes(tmp_path):
    # one learning rate for all (the default's 20 x for the embeddings suits 1,500 steps at 5e-4, not 40 at 3e-3)
    # and T5's short targets (spans), for which the 1-nat drop below was set; the resume test above runs the
    # defaults (two AdamW groups, full targets)
    out = pretrain(*TINY, "train.max_steps=40", "train.eval_every=10", "train.log_every=10", "train.num_workers=2",
                   "train.embedding_lr_scale=1", "corpus.targets=spans", "train.cpus_per_worker=0.9",
                   "train.zero_stage=3",
                   f"train.output_dir={tmp_path}/pre", cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    # the held-out texts are ones it never trains on (not the corpus's last pieces): a smaller drop than training's
    assert rows[-1]["heldout_loss"] < rows[0]["heldout_loss"] - 0.5 and rows[-1]["loss"] < rows[0]["loss"] - 1.0
    backbone = Path(out["backbone"])
    assert backbone == tmp_path / "pre" / "backbone"
    assert {"config.json", "model.safetensors", "tokenizer.json", "pretrain.json"} <= {p.name for p in
                                                                                          backbone.iterdir()}
    assert json.loads((backbone / "pretrain.json").read_text())["targets"] == "spans"  # which objective made it
    # it loads as a backbone: its weights become the fine-tuned model's T5, its tokenizer is the checkpoint's
    from safetensors.torch import load_file

    from hpsearch.model import build_model
    model = build_model(str(backbone), "hyperprompt", ["rte", "cb"])
    saved = load_file(backbone / "model.safetensors")
    state = model.t5.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "hpsearch.train", "--local", f"model.backbone={backbone}",
                           "train.max_steps=4", "train.eval_every=4", "data.synthetic_train_rows=100",
                           "data.synthetic_eval_rows=20", f"train.output_dir={tmp_path}/ft"], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["step"] == 4
    # one MLflow run with every evaluation's metrics and the loss curve
    from mlflow import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("hpsearch/pretrain").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["corpus.noise_density"] == "0.15"
    assert run.data.params["corpus.targets"] == "spans"  # the override, recorded
    history = client.get_metric_history(run.info.run_id, "heldout_loss")
    assert sorted(m.step for m in history) == [10, 20, 30, 40]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["loss.png"]


def test_the_loss_curve_skips_a_line_cut_short_and_a_file_an_earlier_run_left(tmp_path):
    """The plot ran in the command's `finally`: a metrics.jsonl whose last line a kill cut short raised there,
    replacing the run's error with a traceback and leaving its MLflow run RUNNING; and a reused folder's file from
    an earlier run became this run's curve."""
    import time

    from hpsearch.pretrain.__main__ import _plot

    history = tmp_path / "metrics.jsonl"
    history.write_text('{"step": 10, "loss": 5.0, "heldout_loss": 5.2}\n{"step": 20, "loss": 4.0, "heldout_lo')
    assert _plot(tmp_path) == tmp_path / "loss.png" and (tmp_path / "loss.png").stat().st_size > 1000
    (tmp_path / "loss.png").unlink()
    assert _plot(tmp_path, since=time.time() + 60) is None and not (tmp_path / "loss.png").exists()


def test_a_pretraining_checkpoint_of_another_corpus_layout_is_not_resumed(tmp_path):
    """How the corpus is cut into training and held-out pieces changed (held-out texts from across the corpus): a
    checkpoint written before would resume on a re-cut stream, its sampler's positions and its best score meaning
    other pieces. Its config has no layout: it counts as layout 1, and the resume is one line."""
    import dataclasses

    from hpsearch.pretrain.config import load_pretrain_config
    from hpsearch.pretrain.corpus import LAYOUT
    from hpsearch.train import checkpoints

    cfg, corpus = load_pretrain_config(None, TINY)
    run = {**cfg.to_dict(), "corpus": dataclasses.asdict(corpus), "corpus_layout": {"version": LAYOUT}}
    (tmp_path / "state").mkdir()
    checkpoints.write_config(tmp_path, {k: v for k, v in run.items() if k != "corpus_layout"})
    assert checkpoints.resume_differences(tmp_path, run) == {"corpus_layout.version": (1, LAYOUT)}
    checkpoints.write_config(tmp_path, run)
    assert checkpoints.resume_differences(tmp_path, run) == {}
    fine_tuning = cfg.to_dict()  # a fine-tuning checkpoint has no corpus: nothing to compare
    checkpoints.write_config(tmp_path, fine_tuning)
    assert checkpoints.resume_differences(tmp_path, fine_tuning) == {}


def test_a_corpus_folder_needs_no_suite_folder(tmp_path):
    """With `corpus.path` the suite is not read, yet its default folder (the repo's `../shared/data/glue`) had to
    exist: pretraining on a folder of text from anywhere else failed on a setting it does not use. The data
    section's other fields are still checked."""
    from hpsearch.pretrain.config import load_pretrain_config

    (tmp_path / "a.txt").write_text("some text\n")
    cfg, corpus = load_pretrain_config(None, [f"corpus.path={tmp_path}", "data.source=/no/such/folder"])
    assert corpus.path == str(tmp_path)
    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    for source in (str(glue), "/no/such/folder"):  # a suite's own tasks stay valid with it (not synthetic ones)
        cfg, _ = load_pretrain_config(None, [f"corpus.path={tmp_path}", f"data.source={source}", "data.tasks=cola,rte"])
        assert cfg.data.source == source and cfg.data.tasks == ["cola", "rte"]
    with pytest.raises(ConfigError, match="data.source: folder '/no/such/folder' does not exist"):
        load_pretrain_config(None, ["data.source=/no/such/folder"])
    with pytest.raises(ConfigError, match="data.temperature"):
        load_pretrain_config(None, [f"corpus.path={tmp_path}", "data.temperature=-1"])


def test_pretraining_on_a_corpus_folder_runs_where_no_suite_folder_is(tmp_path):
    """The same through the recipe: the loop read the run config again with the data source's folder required, so a
    run from a folder without `../shared/data/glue` beside it failed in the loop (after the MLflow run was made)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("".join(f"line {i} of some plain text to pretrain on\n" for i in range(400)))
    out = pretrain("--local", "model.backbone=t5-tiny", f"corpus.path={corpus}", "corpus.max_length=32",
                   "corpus.heldout_chunks=4", "train.max_steps=2", "train.eval_every=2", "train.micro_batch_size=8",
                   f"train.output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    assert out["step"] == 2 and not (tmp_path.parent / "shared").exists()

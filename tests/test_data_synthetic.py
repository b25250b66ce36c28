"""The synthetic suite: its properties, determinism, and a tiny T5 that beats the majority class on it."""
import collections
import pickle
import time

import pytest
import torch

from hpsearch.data import (
    DataConfig,
    MultiTaskSampler,
    decode,
    encode_batch,
    get_task,
    get_tokenizer,
    load_suite,
    score_task,
    suite_score,
)
from hpsearch.data.synthetic import COLORS, SYNTHETIC_SUITE


@pytest.fixture(scope="module")
def suite():
    return load_suite(DataConfig())


def words(example):
    return example.source.split("words: ", 1)[1].split()


def test_default_suite_meets_the_requirements(suite):
    assert suite.tasks == SYNTHETIC_SUITE and len(suite.tasks) >= 5
    specs = [get_task(t) for t in suite.tasks]
    assert any(s.is_regression for s in specs)                                 # number-valued task
    assert any(s.labels and len(s.labels) >= 3 for s in specs)                 # three or more classes
    assert min(len(suite.split(t, "train")) for t in suite.tasks) <= 200       # a low-resource task
    assert suite.describe()["tasks"]["lacks"]["splits"] == {"train": 100, "validation": 100, "test": 100}
    assert suite.describe()["tasks"]["first"]["splits"] == {"train": 1000, "validation": 100, "test": 100}


def test_targets_follow_the_documented_rules(suite):
    for task in suite.tasks:
        for split in ("train", "validation", "test"):
            for ex in suite.split(task, split):
                w = words(ex)
                assert 4 <= len(w) <= 8 and set(w) <= set(COLORS)
                expected = {"first": w[0], "last": w[-1], "count": str(w.count("red")),
                            "contains": "yes" if "blue" in w else "no",
                            "lacks": "no" if "blue" in w else "yes"}[task]
                assert ex.target == expected
                assert ex.source.startswith(f"{task} words: ")


def test_tasks_share_inputs_and_give_conflicting_targets(suite):
    inputs = {t: [words(e) for e in suite.split(t, "train")] for t in suite.tasks}
    assert inputs["lacks"] == inputs["contains"][:100]  # the same inputs...
    assert inputs["first"] == inputs["last"] == inputs["contains"]
    targets = {t: [e.target for e in suite.split(t, "train")] for t in suite.tasks}
    assert all(a != b for a, b in zip(targets["contains"], targets["lacks"]))  # ...opposite answers
    disagree = sum(a != b for a, b in zip(targets["first"], targets["last"])) / len(targets["first"])
    assert disagree > 0.7  # 5/6 expected
    # validation/test inputs are shared too, and never seen in training
    test_inputs = [words(e) for e in suite.split("first", "test")]
    assert test_inputs == [words(e) for e in suite.split("lacks", "test")]
    train_inputs = {tuple(w) for w in inputs["first"]}
    for split in ("validation", "test"):
        assert not train_inputs & {tuple(words(e)) for e in suite.split("first", split)}


def test_suite_pickles_for_remote_workers(suite):
    copy = pickle.loads(pickle.dumps(suite))
    assert copy.tasks == suite.tasks and copy.split("count", "test") == suite.split("count", "test")
    assert copy.describe() == suite.describe()


def test_generation_is_deterministic_and_sizes_are_configurable(suite):
    again = load_suite(DataConfig())
    for split in ("train", "validation", "test"):
        assert all(suite.split(t, split) == again.split(t, split) for t in suite.tasks)
    other = load_suite(DataConfig(data_seed=7))
    assert other.split("first", "train") != suite.split("first", "train")
    sized = load_suite(DataConfig(tasks=["count", "lacks"], synthetic_train_rows=300,
                                  synthetic_small_train_rows=40, synthetic_eval_rows=61))
    assert sized.tasks == ["count", "lacks"]
    assert sized.sizes("train") == [300, 40] and sized.sizes("validation") == [30, 30]
    assert sized.sizes("test") == [31, 31]
    unprefixed = load_suite(DataConfig(task_prefix=False, tasks=["first"]))
    assert unprefixed.split("first", "train")[0].source.startswith("words: ")


@pytest.fixture
def one_thread():
    """One torch thread: much faster than two oversubscribed ones when other work shares the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tiny_t5_trained_briefly_beats_the_majority_class(suite, tmp_path, one_thread):
    """300 steps of a 2-layer d_model=64 T5 on CPU (a few seconds). `contains` and `lacks` give opposite
    answers to the same inputs: a model that ignored the task would have accuracies summing to 100 on them."""
    torch.manual_seed(0)
    cfg = DataConfig(batching="mixed", cache_dir=str(tmp_path))
    tokenizer = get_tokenizer("t5-tiny", cfg, suite, vocab_size=512)
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(
        vocab_size=512, d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = MultiTaskSampler(suite.sizes(), 32, cfg.temperature, cfg.batching, seed=0)
    start = time.time()
    model.train()
    for _, batch in zip(range(300), sampler):
        examples = [suite.split(suite.tasks[t], "train")[r] for t, r in batch]
        inputs = encode_batch(examples, [t for t, _ in batch], tokenizer, cfg)
        inputs.pop("task_ids")  # plain T5: the task is known only from the text prefix
        loss = model(**inputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    trained, majority = {}, {}
    for task_id, task in enumerate(suite.tasks):
        examples = suite.split(task, "test")
        inputs = encode_batch(examples, [task_id] * len(examples), tokenizer, cfg)
        with torch.no_grad():
            generated = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                       max_new_tokens=4, do_sample=False)
        trained[task] = score_task(task, decode(tokenizer, generated), examples)["score"]
        most_common = collections.Counter(e.target for e in suite.split(task, "train")).most_common(1)[0][0]
        majority[task] = score_task(task, [most_common] * len(examples), examples)["score"]
    print(f"trained {trained} majority {majority} in {time.time() - start:.1f}s")
    assert suite_score(trained) > suite_score(majority) + 15
    assert trained["contains"] > 90 and trained["lacks"] > 90  # task conditioning is used
    assert trained["count"] > 50 and majority["count"] == 0.0

"""Temperature sampling: proportions, one-task and mixed batches, rank sharding, determinism, resume."""
import collections
import itertools
import json

import pytest

from hpsearch.data import MultiTaskSampler, task_probabilities
from hpsearch.errors import DataError

SIZES = [1000, 100, 10]


def expected(sizes, temperature):
    weights = [n ** (1 / temperature) if n else 0.0 for n in sizes]
    return [w / sum(weights) for w in weights]


def take(sampler, steps):
    return list(itertools.islice(sampler, steps))


def test_probabilities_by_hand():
    assert task_probabilities(SIZES, 1) == pytest.approx([1000 / 1110, 100 / 1110, 10 / 1110])
    roots = [1000 ** 0.5, 10.0, 10 ** 0.5]
    assert task_probabilities(SIZES, 2) == pytest.approx([r / sum(roots) for r in roots])
    assert task_probabilities(SIZES, float("inf")) == pytest.approx([1 / 3] * 3)
    assert task_probabilities([5, 0, 5], 10) == pytest.approx([0.5, 0.0, 0.5])
    assert task_probabilities([400_000, 1], 0.01)[0] == pytest.approx(1.0)  # no overflow
    for bad in ([], [3, -1]):
        with pytest.raises(ValueError):
            task_probabilities(bad, 1)
    with pytest.raises(DataError, match="no task has training rows"):  # e.g. only BoolQ and WiC offline
        MultiTaskSampler([0, 0], 8, 10.0)
    with pytest.raises(ValueError):
        task_probabilities(SIZES, 0)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 10.0, 1e9])
def test_one_task_batches_follow_the_temperature(temperature):
    steps = 12_000
    batches = take(MultiTaskSampler(SIZES, 4, temperature, "task", seed=1), steps)
    assert all(len({t for t, _ in b}) == 1 and len(b) == 4 for b in batches)
    counts = collections.Counter(b[0][0] for b in batches)
    for task, p in enumerate(expected(SIZES, temperature)):
        tolerance = 4 * (p * (1 - p) / steps) ** 0.5 + 1e-3
        assert counts[task] / steps == pytest.approx(p, abs=tolerance)


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_mixed_batches_follow_the_temperature_per_row(temperature):
    batches = take(MultiTaskSampler(SIZES, 16, temperature, "mixed", seed=2), 1500)
    slots = [t for b in batches for t, _ in b]
    assert any(len({t for t, _ in b}) > 1 for b in batches)
    counts = collections.Counter(slots)
    for task, p in enumerate(expected(SIZES, temperature)):
        assert counts[task] / len(slots) == pytest.approx(p, abs=4 * (p * (1 - p) / len(slots)) ** 0.5 + 1e-3)


@pytest.mark.parametrize("batching", ["task", "mixed"])
def test_rows_cycle_through_each_task_once_per_epoch(batching):
    sizes = [30, 7, 0, 12]
    sampler = MultiTaskSampler(sizes, 5, 1.0, batching, seed=4)
    seen = collections.defaultdict(list)
    for batch in take(sampler, 200):
        for task, row in batch:
            seen[task].append(row)
    assert 2 not in seen  # a task without rows is never sampled
    for task, rows in seen.items():
        n = sizes[task]
        assert all(0 <= r < n for r in rows)
        for start in range(0, len(rows) - n + 1, n):  # every full epoch is a permutation
            assert sorted(rows[start:start + n]) == list(range(n))


@pytest.mark.parametrize("batching", ["task", "mixed"])
def test_ranks_agree_on_tasks_and_read_disjoint_shards(batching):
    world, per_rank, steps = 3, 4, 60
    ranks = [take(MultiTaskSampler(SIZES, per_rank, 2.0, batching, seed=7, rank=r, world_size=world), steps)
             for r in range(world)]
    single = take(MultiTaskSampler(SIZES, per_rank * world, 2.0, batching, seed=7), steps)
    for step in range(steps):
        parts = [ranks[r][step] for r in range(world)]
        assert all(len(p) == per_rank for p in parts)
        # the global batch is the single-process batch of size per_rank * world, cut into rank shards
        assert sum(parts, []) == single[step]
        if batching == "task":
            assert len({t for p in parts for t, _ in p}) == 1
    # over the run, no (task, row) is read by two ranks before the task's epoch wraps
    first_epoch = collections.defaultdict(set)
    for r in range(world):
        for batch in ranks[r]:
            for task, row in batch:
                first_epoch[(task, row)].add(r)
    consumed = collections.Counter(t for b in single for t, _ in b)
    for (task, _row), readers in first_epoch.items():
        if consumed[task] <= SIZES[task]:
            assert len(readers) == 1


def test_same_seed_same_batches_other_seed_other_batches():
    a = take(MultiTaskSampler(SIZES, 8, 10, "task", seed=5), 50)
    b = take(MultiTaskSampler(SIZES, 8, 10, "task", seed=5), 50)
    c = take(MultiTaskSampler(SIZES, 8, 10, "task", seed=6), 50)
    assert a == b and a != c


@pytest.mark.parametrize("batching", ["task", "mixed"])
def test_resume_from_state_dict_is_exact(batching):
    sizes = [50, 9, 3]  # small tasks: the resume point lies past several epoch boundaries
    original = MultiTaskSampler(sizes, 6, 2.0, batching, seed=11, rank=1, world_size=2)
    take(original, 37)
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON checkpoint
    expected_next = take(original, 25)
    resumed = MultiTaskSampler(sizes, 6, 2.0, batching, seed=11, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert take(resumed, 25) == expected_next


def test_resume_refuses_another_dataset_or_seed():
    state = MultiTaskSampler(SIZES, 2, 1.0, seed=1).state_dict()
    with pytest.raises(ValueError, match="sizes"):
        MultiTaskSampler([1000, 100, 11], 2, 1.0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        MultiTaskSampler(SIZES, 2, 1.0, seed=2).load_state_dict(state)


def test_bad_arguments():
    for kwargs in ({"batching": "round-robin"}, {"rank": 2, "world_size": 2}, {"seed": -1}):
        with pytest.raises(ValueError):
            MultiTaskSampler(SIZES, 2, 1.0, **kwargs)
    with pytest.raises(ValueError):
        MultiTaskSampler(SIZES, 0, 1.0)

"""Few-shot transfer (`python -m hpsearch.transfer`): growing a trained model by one task keeps every old task's
output, a new task copied from task s behaves exactly as s, PHA retrieves by its prototypes, and the command runs end
to end on 4 SciTail shots from a model trained here."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from t5_testing import logits, tiny_config

from hpsearch.model import build_model
from hpsearch.transfer import grow

ROOT = Path(__file__).resolve().parents[1]
GLUE = ROOT.parent / "shared" / "data" / "glue"
TASKS = ["a", "b", "c"]
SETUPS = {
    "hyperprompt-sep": ("hyperprompt", dict(variant="sep", placement="both", prompt_length_encoder=3,
                                            prompt_length_decoder=2, bottleneck=4)),
    "hyperprompt-global": ("hyperprompt", dict(variant="global", placement="both", prompt_length_encoder=3,
                                               prompt_length_decoder=2, bottleneck=4, task_embedding_dim=5,
                                               layer_task_dim=6, projection_hidden=7)),
    "prompt_tuning": ("prompt_tuning", dict(prompt_length=3)),
    "adapter": ("adapter", dict(bottleneck=4)),
    "hyperformer": ("hyperformer", dict(reduction_factor=8, hyperformer_task_dim=5, hyperformer_projected_dim=6,
                                        hyperformer_hidden_dim=7)),
    "prefix": ("prefix", dict(prompt_length=3, prefix_hidden=5)),
    "lora": ("lora", dict(lora_rank=2)),
    "mam": ("mam", dict(mam_prefix_length=2, prefix_hidden=5, bottleneck=4)),
    "pha": ("pha", dict(bottleneck=4, pha_dim=5, pha_retriever_hidden=6, pha_hidden=7)),
}


def trained_and_grown(name, source):
    method, kw = SETUPS[name]
    torch.manual_seed(0)
    trained = build_model(tiny_config(), method, TASKS, **kw).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # away from the init, so that every task's parameters differ
        for n, p in trained.named_parameters():
            if not n.startswith("t5."):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    torch.manual_seed(1)
    grown = build_model(tiny_config(), method, [*TASKS, "new"], **kw).eval()
    grown.t5.load_state_dict(trained.t5.state_dict())
    grow(trained, grown, source)
    return trained, grown


@pytest.mark.parametrize("name", SETUPS)
def test_grown_model_keeps_old_tasks_and_copies_the_source_task(name, batch):
    trained, grown = trained_and_grown(name, source=1)
    # old tasks untouched: equal up to float rounding (Global and PHA compute over every task at once, and a batched
    # product over 4 tasks may round differently from one over 3 on some CPUs: 1.3e-6 measured on an AMD EPYC)
    assert (logits(grown, batch) - logits(trained, batch)).abs().max() <= 1e-5
    as_new = logits(grown, {**batch, "task_ids": torch.full((4,), 3)})
    as_source = logits(trained, {**batch, "task_ids": torch.full((4,), 1)})
    assert (as_new - as_source).abs().max() <= 1e-5  # the new task starts as task 1
    _, scratch = trained_and_grown(name, source=None)
    assert (logits(scratch, {**batch, "task_ids": torch.full((4,), 3)}) - as_source).abs().max() > 1e-3


def test_pha_nearest_task_is_its_prototype_retrieval(batch):
    import torch.nn.functional as F
    rows = {k: v for k, v in batch.items() if k != "task_ids"}
    am = batch["attention_mask"]
    differs = 0
    for seed in range(30):  # at least 6 perturbations, and on until retrieval and the lowest loss disagree once
        trained, _ = trained_and_grown("pha", source=None)
        trained.cfg.pha_loss_weight = 0.0  # the loss without PHA's own terms, which reward the nearest prototype
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            trained.prototypes.weight.add_(torch.randn(trained.prototypes.weight.shape, generator=g))
        sims, losses = [], []
        with torch.no_grad():  # by hand: the encoder under each task, the retriever on the masked mean, cosine
            for task in range(3):
                out = trained(**rows, task_ids=torch.full((4,), task))
                pooled = torch.stack([out.encoder_last_hidden_state[i, am[i].bool()].mean(0) for i in range(4)])
                z = F.normalize(trained.retriever(pooled), dim=-1)
                sims.append(float((z @ F.normalize(trained.prototypes.weight[task], dim=0)).mean()))
                losses.append(float(out.loss))
        want = max(range(3), key=sims.__getitem__)
        assert trained.nearest_task(rows) == want
        differs += want != losses.index(min(losses))
        if differs and seed >= 5:
            break
    assert differs  # retrieval by prototypes is not the default lowest-loss choice


def test_default_nearest_task_is_the_lowest_loss_task(batch):
    trained, _ = trained_and_grown("adapter", source=None)
    rows = {k: v for k, v in batch.items() if k != "task_ids"}
    with torch.no_grad():
        losses = [float(trained(**rows, task_ids=torch.full((4,), t)).loss) for t in range(3)]
    assert len(set(losses)) == 3 and trained.nearest_task(rows) == losses.index(min(losses))


def test_shots_drawn_from_test_rows_share_no_input_text_with_a_scored_row():
    """SciTail: one hypothesis, many premises, spread through the file; its rows mostly share a label."""
    from hpsearch.data import get_task
    from hpsearch.transfer import disjoint_from

    spec = get_task("scitail")
    rows = [json.loads(line) for line in open(GLUE / "scitail" / "test.jsonl")]
    examples = [spec.example(r) for r in rows]
    shared = [r for r in rows[200:] if r["hypothesis"] in {s["hypothesis"] for s in rows[:200]}]
    assert len(shared) > 500  # what the shots were drawn from before
    pool = disjoint_from(examples[200:], examples[:200], spec.fields)
    # the same rows, picked from the raw fields (whitespace as the source text has it)
    norm = lambda text: " ".join(text.split())
    texts = {norm(r[f]) for r in rows[:200] for f in spec.fields}
    expected = [e for r, e in zip(rows[200:], examples[200:]) if not {norm(r[f]) for f in spec.fields} & texts]
    assert 900 < len(pool) < 1200 and pool == expected


def transfer(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpsearch.transfer", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


@pytest.mark.slow
def test_transfer_end_to_end_on_4_scitail_shots(tmp_path):
    src = tmp_path / "src"
    train = subprocess.run([sys.executable, "-m", "hpsearch.train", "--local", "model.method=pha",
                            "data.batching=mixed", "train.max_steps=10", "train.eval_every=10",
                            "train.micro_batch_size=8", "data.synthetic_train_rows=100",
                            "data.synthetic_eval_rows=20", "data.max_target_length=3", f"train.output_dir={src}"],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    out = transfer("--from", str(src), "--task", "scitail", "--shots", "4", "--seeds", "2", "--steps", "3",
                   "--eval-rows", "16", "--data", str(GLUE), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "transfer.json").read_text())
    assert result["method"] == "pha" and result["task"] == "scitail" and result["shots"] == 4
    assert result["test_rows"] == 16 and result["shots_from"].startswith("test rows after the first 16")
    assert "sharing no premise, hypothesis or other input text with a scored row" in result["shots_from"]
    # the source run kept 3 target tokens, which its tokenizer (trained on the synthetic suite) needs more than for
    # 'entailment': the new task's targets are kept whole (else no 'entailment' row could ever be scored right)
    assert re.search(r"scitail's target '\w+' is (\d+) tokens in the source run's tokenizer: its targets are \d+ "
                     r"long here \(the source run's data.max_target_length is 3\)", out.stdout), out.stdout[-2000:]
    for init in ("nearest", "scratch"):
        assert set(result["scores"][init]) == {"0", "1"}
        assert all(0 <= v <= 100 for v in result["scores"][init].values())
    assert set(result["nearest_task"].values()) <= set(result["source_tasks"])
    assert "| nearest - scratch (paired) |" in (tmp_path / "out" / "transfer.md").read_text()
    assert "| nearest |" in out.stdout
    # bad input: one line, exit 2, nothing written
    for args, phrase in ((["--from", str(tmp_path / "nope"), "--task", "scitail"], "is not a run's output folder"),
                         (["--from", str(src), "--task", "scitail"], "has no scitail/ folder"),
                         (["--from", str(src), "--task", "first", "--data", str(GLUE)], "already one of"),
                         (["--from", str(src), "--task", "scitail", "--shots", "0"], "--shots: 0")):
        bad = transfer(*args, "--out", str(tmp_path / "bad"), cwd=tmp_path)
        assert bad.returncode == 2 and phrase in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert not (tmp_path / "bad").exists()

"""`python -m hpsearch.params` for every method: meta device (no download, no memory), formula terms printed."""
import json

import pytest

from hpsearch.config import load_config
from hpsearch.model.config import METHODS
from hpsearch.params import count, main


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backbone", ["t5-base", "t5-11b"])
def test_every_method_counts_on_the_meta_device(method, backbone, capsys):
    report = count(load_config(None, [f"model.method={method}", f"model.backbone={backbone}"]), 8)
    assert report["method"] == method
    assert report["extra_params"] == report["formula_total"] == sum(report["extra_breakdown"].values())
    assert main([f"model.method={method}", f"model.backbone={backbone}", "--num-tasks", "8"]) == 0
    text = capsys.readouterr().out
    assert f"formula: {report['formula']}" in text and f"= {report['formula_total']:,}" in text
    for symbol, value in report["formula_terms"].items():
        assert f"{symbol}={value:,}" in text


def test_baselines_sizes_on_t5_base(capsys):
    """Anchors from the papers / definitions, T5-Base (d = 768, 12 + 12 blocks), 8 tasks."""
    run = lambda *o: count(load_config(None, ["model.backbone=t5-base", *o]), 8)
    assert run("model.method=prompt_tuning", "model.prompt_length=16")["extra_params"] == 8 * 16 * 768
    adapter = run("model.method=adapter", "model.bottleneck=24", "model.adapter_sites=ffn")
    assert adapter["extra_params"] == 8 * 24 * (2 * 768 * 24 + 24 + 768)
    hyperformer = run("model.method=hyperformer")
    assert hyperformer["formula_terms"]["b"] == 24                         # 768 // 32, the paper's T5-Base b
    assert round(hyperformer["extra_percent"] / 8, 2) == 0.29              # the paper: 0.29 % per task
    assert main(["model.method=hyperformer", "model.backbone=t5-base", "--num-tasks", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["formula_total"] == hyperformer["extra_params"]


def test_unified_view_sizes_on_t5_base():
    """He et al.'s per-layer counts, T5-Base (d = d_i = 768, 12 + 12 self-attentions, 12 cross-attentions, 24 FFNs),
    8 tasks: LoRA r*d*4 (q and v); prefix: per kind of attention (encoder self, decoder self, cross) the l*d rows
    and Li & Liang's MLP; MAM: the same prefix (l = 30) + a parallel adapter per FFN."""
    run = lambda *o: count(load_config(None, ["model.backbone=t5-base", *o]), 8)
    assert run("model.method=lora", "model.lora_rank=8")["extra_params"] == 8 * 24 * 8 * 768 * 4
    prefix = run("model.method=prefix", "model.prompt_length=30", "model.prefix_hidden=800")
    assert prefix["extra_params"] == 3 * (8 * 30 * 768 + (768 * 800 + 800) + (800 * 12 * 2 * 768 + 12 * 2 * 768))
    mam = run("model.method=mam", "model.prefix_hidden=800", "model.bottleneck=512")  # the paper's l = 30, b = 512
    assert mam["extra_params"] - prefix["extra_params"] == 8 * 24 * (768 * 512 + 512 + 512 * 768 + 768)
    assert mam["formula_terms"]["l"] == 30


def test_the_default_task_count_is_the_suite_the_source_resolves(capsys):
    """The default task list stands for the source's own suite: a GLUE folder's 13 tasks, the hub's 8; counting
    len(data.tasks) gave the synthetic suite's 5 for every source (found by an independent review)."""
    from pathlib import Path

    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    for overrides, tasks in (([], 5), ([f"data.source={glue}"], 13), (["data.source=hub"], 8),
                             ([f"data.source={glue}", "data.tasks=rte,mrpc"], 2)):
        assert main([*overrides, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["extra_params"] == count(load_config(None, overrides), tasks)["extra_params"], overrides

"""Config loading (YAML + overrides) and the `python -m hpsearch.params` command."""
import json
import subprocess
import sys

import pytest

from hpsearch.config import load_config
from hpsearch.errors import ConfigError


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_yaml_and_overrides_fill_typed_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  variant: sep\n  bottleneck: 8\ntrain:\n  lr: 3e-4\n  max_steps: 50\n")
    cfg = load_config(path, ["model.placement=decoder", "train.lr=1e-3", "model.hypernet_bias=true",
                             "model.dropout=null"])
    assert (cfg.model.variant, cfg.model.bottleneck, cfg.model.placement) == ("sep", 8, "decoder")
    assert cfg.train.lr == 1e-3 and cfg.train.max_steps == 50 and cfg.model.hypernet_bias is True
    assert cfg.model.dropout is None
    assert cfg.flat()["model.variant"] == "sep"


@pytest.mark.parametrize("text,overrides,match", [
    ("model:\n  variant: sep\n  bottlenek: 8\n", [], r"run.yaml:3: unknown field 'model.bottlenek'"),
    ("model:\n  variant: [sep\n", [], r"run.yaml:\d+: malformed YAML"),
    ("modle:\n  variant: sep\n", [], r"run.yaml:1: unknown section 'modle'"),
    ("train:\n  max_steps: many\n", [], r"run.yaml:2: train.max_steps: 'many' is not an integer"),
    ("", ["model.variant=middle"], r"model.variant: 'middle' is not one of share, sep, global"),
    ("", ["train.lr=2"], r"train.lr: 2.0 is out of range"),
    # nan passed every `< 0` check and failed once Ray had started (a CPU count that is no number)
    ("", ["train.cpus_per_worker=nan"], r"train.cpus_per_worker: nan; expected a finite number > 0"),
    ("", ["train.gpus_per_worker=-1"], r"train.gpus_per_worker: -1.0; expected a finite number >= 0"),
    ("", ["train.weight_decay=inf"], r"train.weight_decay: inf is out of range; expected a finite number >= 0"),
    ("", ["train.grad_clip=nan"], r"train.grad_clip: nan is out of range; expected a finite number >= 0"),
    ("", ["train.embedding_lr_scale=0"], r"train.embedding_lr_scale: 0.0 is out of range; expected 0 < scale"),
    ("", ["train.optimizer=sgd"], r"train.optimizer: 'sgd' is not one of adamw, adafactor"),
    ("", ["train.host_allocator=jemalloc"], r"train.host_allocator: 'jemalloc' is not one of auto, reuse, system"),
    ("train:\n  optimizer: adafactor\n  zero_stage: 3\n", [],
     r"train.optimizer: adafactor needs each weight whole \(train.zero_stage=0, no offload; got zero_stage=3,"),
    ("", ["train.optimizer=adafactor", "train.offload_optimizer=true"], r"got zero_stage=auto, offload_optimizer=True"),
    ("", ["train.optimizer=adafactor", "train.embedding_lr_scale=20"],
     r"train.embedding_lr_scale: 20 with adafactor, whose steps already scale with each weight's size"),
    ("", ["train.optimizer=adafactor", "train.use_gpu=true"], r"adafactor needs train.precision=fp32"),
    ("", ["model.vocab_size=4"], r"model.vocab_size: 4 is out of range; expected an integer from 8 to 1,048,576"),
    ("", ["model.vocab_size=100000000"], r"model.vocab_size: 100000000 is out of range"),
    ("", ["train.lr"], r"expected key=value"),
    ("", ["train.precision=bf16"], r"needs GPU workers"),
])
def test_bad_config_is_one_line_error(tmp_path, text, overrides, match):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(path, overrides)
    assert "\n" not in str(e.value)


def test_params_command_matches_formula_offline():
    out = run("-m", "hpsearch.params", "model.backbone=t5-base", "model.variant=share", "model.placement=both",
              "model.prompt_length_encoder=16", "model.prompt_length_decoder=6", "model.bottleneck=32",
              "--num-tasks", "8", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    d, l, T, M, b = 768, 16 + 6, 8, 24, 32
    assert report["extra_params"] == d * l * T + 4 * b * d * M
    assert report["backbone_params"] == 222_903_552  # published size of T5-Base (tied embeddings)
    assert set(report) >= {"backbone_params", "extra_params", "extra_breakdown"}
    assert sum(report["extra_breakdown"].values()) == report["extra_params"]
    text = run("-m", "hpsearch.params", "model.backbone=t5-large", "--num-tasks", "3")
    assert text.returncode == 0 and "% of the backbone" in text.stdout


def test_params_command_bad_override_is_one_line():
    out = run("-m", "hpsearch.params", "model.varient=sep")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown field 'model.varient'" in out.stderr
    assert "Traceback" not in out.stderr

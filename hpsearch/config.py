"""Run configs: dataclasses filled from a YAML file and dotted `key=value` overrides, validated on entry.

    cfg = load_config("run.yaml", ["model.variant=global", "train.max_steps=200"])

Sections: `model` (hpsearch.model.config), `data` (hpsearch.data.config), `train` (below). Every mistake is a
one-line `ConfigError` naming the file and line or the override, the field, and what would be valid.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpsearch.data.config import DataConfig
from hpsearch.errors import ConfigError
from hpsearch.model.config import ModelConfig

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adafactor")
HOST_ALLOCATORS = ("auto", "reuse", "system")  # train.host_allocator (hpsearch/train/hostmem.py)


@dataclass
class TrainConfig:
    num_workers: int = 2                  # data-parallel Ray Train workers (one DeepSpeed rank each)
    use_gpu: bool = False                 # GPU workers: NCCL and bf16; CPU workers: gloo and fp32
    cpus_per_worker: float = 0.9          # Ray resources per worker (the Tune driver keeps 0.1 of a CPU)
    gpus_per_worker: float = 1.0
    precision: str = "auto"               # auto = bf16 on GPU, fp32 on CPU
    zero_stage: int | str = "auto"        # 0-3, or auto: 0 when the training state fits a worker or one trains, else 3
    zero_init: bool | str = "auto"        # stage 3: build under deepspeed.zero.Init (auto: on GPU workers)
    offload_optimizer: bool = False       # ZeRO-Offload of optimizer states to CPU
    offload_params: bool = False          # ZeRO-Infinity style parameter offload to CPU (stage 3)
    host_allocator: str = "auto"          # reuse: malloc keeps freed tensor memory (fewer page faults; auto: on CPU
                                          # workers); system: glibc's defaults (hpsearch/train/hostmem.py)
    micro_batch_size: int = 16            # per worker
    grad_accum: int = 1
    max_steps: int = 300                  # optimizer steps
    optimizer: str = "adamw"              # adamw, or adafactor (T5's: steps relative to each weight's RMS; lr ~1e-2)
    lr: float = 1e-3
    embedding_lr_scale: float = 1.0       # the token-embedding table learns at lr x this (pretraining: 20)
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batch_size: int = 64
    max_new_tokens: int = 8
    log_every: int = 20
    seed: int = 0
    output_dir: str = "runs/train"
    max_failures: int = 0                 # Ray Train restarts from the last checkpoint after a worker failure
    keep_checkpoints: int = 2             # --local: the newest N checkpoints stay under output_dir/checkpoints
    debug_nan_at_step: int | None = None  # fault injection (tests): the loss becomes NaN at this step
    debug_nan_gradient_at_step: int | None = None  # fault injection (tests): a finite loss, a NaN gradient
    debug_crash_at_step: int | None = None  # fault injection (tests): rank 0 dies once at this step

    def validate(self) -> None:
        positive = ("num_workers", "micro_batch_size", "grad_accum", "max_steps", "eval_every", "eval_batch_size",
                    "max_new_tokens", "log_every", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}: {getattr(self, name)!r} is out of range; expected an integer >= 1")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.precision in ("bf16", "fp16") and not self.use_gpu:
            raise ConfigError(f"train.precision: {self.precision} needs GPU workers (train.use_gpu=true); "
                              "CPU runs use fp32")
        if self.zero_stage not in (0, 1, 2, 3, "auto"):
            raise ConfigError(f"train.zero_stage: {self.zero_stage!r} is not one of 0, 1, 2, 3, auto")
        if self.zero_init not in (True, False, "auto"):
            raise ConfigError(f"train.zero_init: {self.zero_init!r} is not one of true, false, auto")
        if self.host_allocator not in HOST_ALLOCATORS:
            raise ConfigError(f"train.host_allocator: {self.host_allocator!r} is not one of "
                              f"{', '.join(HOST_ALLOCATORS)}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError("train.offload_optimizer: optimizer offload needs train.zero_stage >= 1")
        if self.offload_params and self.zero_stage not in (3, "auto"):
            raise ConfigError("train.offload_params: parameter offload needs train.zero_stage=3")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer: {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.optimizer == "adafactor":
            # ZeRO stages >= 1 and DeepSpeed's bf16/fp16 optimizers hand the optimizer flat buffers, not the weights:
            # Adafactor would factor nothing and scale its steps by the RMS of a whole buffer
            if self.zero_stage not in (0, "auto") or self.offload_optimizer or self.offload_params:
                raise ConfigError(f"train.optimizer: adafactor needs each weight whole (train.zero_stage=0, no "
                                  f"offload; got zero_stage={self.zero_stage}, offload_optimizer="
                                  f"{self.offload_optimizer}, offload_params={self.offload_params}); use adamw for "
                                  "ZeRO >= 1")
            if self.embedding_lr_scale != 1:
                raise ConfigError(f"train.embedding_lr_scale: {self.embedding_lr_scale:g} with adafactor, whose steps "
                                  "already scale with each weight's size (the embeddings' too); set it to 1")
            if self.precision in ("bf16", "fp16") or (self.precision == "auto" and self.use_gpu):
                raise ConfigError("train.optimizer: adafactor needs train.precision=fp32 (DeepSpeed's 16-bit "
                                  "optimizers flatten the weights); use adamw for 16-bit training")
        if not 0 < self.lr < 1:
            raise ConfigError(f"train.lr: {self.lr!r} is out of range; expected 0 < lr < 1")
        if not 0 < self.embedding_lr_scale <= 1000:
            raise ConfigError(f"train.embedding_lr_scale: {self.embedding_lr_scale!r} is out of range; "
                              "expected 0 < scale <= 1000")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):  # `not >=`: nan and inf are no values here
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ConfigError(f"train.{name}: {value!r} is out of range; expected a finite number >= 0")
        if not 0 < self.cpus_per_worker < math.inf:
            raise ConfigError(f"train.cpus_per_worker: {self.cpus_per_worker!r}; expected a finite number > 0 (Ray "
                              "refuses 0)")
        if not 0 <= self.gpus_per_worker < math.inf:  # 0: CPU workers (the GPU check is the study's)
            raise ConfigError(f"train.gpus_per_worker: {self.gpus_per_worker!r}; expected a finite number >= 0")
        if not self.output_dir:
            raise ConfigError("train.output_dir: empty; expected a directory path")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self, read: bool = True) -> None:
        """Every section; `read=False`: the data source is not looked at (see DataConfig.validate)."""
        self.model.validate()
        self.data.validate(read=read)
        self.train.validate()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """{"model.variant": "global", ...}: one flat key per field (MLflow params, search spaces)."""
        return {f"{s}.{k}": v for s, values in self.to_dict().items() for k, v in values.items()}


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


# ---- typed assignment ---------------------------------------------------------------------------------------------
def _describe(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return "a comma-separated list"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def coerce(value: Any, tp, where: str) -> Any:
    """Convert a YAML value or an override string to the field's annotated type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            if type(None) in options:
                return None
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: {value!r} is not {_describe(tp)}")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {value!r} is not a list")
        (item,) = typing.get_args(tp)
        return [coerce(v, item, where) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
    elif tp in (int, float):
        numeric = (int,) if tp is int else (int, float)  # an int field refuses 2.5; a float field takes 2
        if isinstance(value, numeric) and not isinstance(value, bool):
            return tp(value)
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{where}: {value!r} is not {_describe(tp)}")


def field_types(section: str) -> dict[str, Any]:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def set_field(cfg: RunConfig, dotted: str, value: Any, where: str) -> None:
    section, _, name = dotted.partition(".")
    if section not in SECTIONS or not name:
        raise ConfigError(f"{where}: unknown key {dotted!r}; expected <section>.<field> with section one of "
                          f"{', '.join(SECTIONS)}")
    types_ = field_types(section)
    if name not in types_:
        raise ConfigError(f"{where}: unknown field {dotted!r}; {section} fields: {', '.join(types_)}")
    setattr(getattr(cfg, section), name, coerce(value, types_[name], f"{where}: {dotted}"))


# ---- YAML with line numbers ---------------------------------------------------------------------------------------
def read_yaml(path: str | Path) -> tuple[dict, dict[str, int]]:
    """(mapping, {dotted key: line}) of a YAML file; a parse error names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#x}); save the file as UTF-8") \
            from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text) or {}  # refuses tags such as !!python/object (never constructs them)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise ConfigError(f"{path}{line}: malformed YAML ({problem})") from None
    if node is None:
        return {}, {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: expected a mapping of sections at the top level")
    lines: dict[str, int] = {}

    def walk(n, prefix):
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = f"{prefix}{k.value}"
                if key in lines:  # YAML would keep the last silently
                    raise ConfigError(f"{path}:{k.start_mark.line + 1}: {key!r} is given twice (first on line "
                                      f"{lines[key]}); give it once")
                lines[key] = k.start_mark.line + 1
                walk(v, key + ".")

    walk(node, "")
    return data, lines


def apply_mapping(cfg: RunConfig, data: dict, source: str, lines: dict[str, int] | None = None) -> None:
    """Assign `{section: {field: value}}` onto cfg; unknown sections/fields name the file and line."""
    lines = lines or {}
    where = lambda key: f"{source}:{lines[key]}" if key in lines else source
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{where(section)}: unknown section {section!r}; expected {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{where(section)}: section {section!r} must be a mapping of field: value")
        for name, value in values.items():
            set_field(cfg, f"{section}.{name}", value, where(f"{section}.{name}"))


def parse_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected key=value, e.g. model.variant=global")
    return key.strip(), value.strip()


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = (),
                base: dict | None = None, read: bool = True) -> RunConfig:
    """Defaults <- `base` mapping <- YAML file <- overrides, then validation (`read=False`: without looking at the
    data source, which a worker's objective reads itself, or not at all: pretraining on a corpus folder)."""
    cfg = RunConfig()
    if base:
        apply_mapping(cfg, base, "<defaults>")
    if path is not None:
        data, lines = read_yaml(path)
        apply_mapping(cfg, data, str(path), lines)
    for text in overrides:
        key, value = parse_override(text)
        set_field(cfg, key, value, f"override {text!r}")
    cfg.validate(read)
    return cfg


def absolute_paths(cfg: RunConfig) -> None:
    """Ray runs every worker and trial in a working directory of its own: make the config's local paths absolute
    (in place), in the driver, before Ray starts."""
    if cfg.data.source not in ("synthetic", "hub"):
        cfg.data.source = str(Path(cfg.data.source).expanduser().resolve())
    if cfg.data.cache_dir:
        cfg.data.cache_dir = str(Path(cfg.data.cache_dir).expanduser().resolve())
    cfg.train.output_dir = str(Path(cfg.train.output_dir).expanduser().resolve())
    if Path(cfg.model.backbone).expanduser().is_dir():
        cfg.model.backbone = str(Path(cfg.model.backbone).expanduser().resolve())


# the fields a target's length in tokens and the lengths it must fit depend on (config.check_run_data)
TARGET_FIELDS = ("model.backbone", "model.vocab_size", "data.source", "data.tasks", "data.vocab_size",
                 "data.max_target_length", "train.max_new_tokens")


def check_run_data(cfg: RunConfig, hub: bool = True, targets: bool = True, suite=None) -> None:
    """A run's data, before anything starts (no torch): every task loads (`hub`: also from the hub, which
    downloads), some have training rows, and (`targets`) every target fits `data.max_target_length` and
    `train.max_new_tokens` in the run's tokenizer when it can be read here (an offline shape's, or a local
    checkpoint's that transformers loads unchanged: `check_targets_early`; else each worker finds it after Ray has
    started). `suite`: `cfg.data`'s suite when the caller has loaded it already."""
    if cfg.data.source == "hub" and not hub:
        return
    from hpsearch.data import load_suite
    from hpsearch.data.tokenizer import check_targets_early
    from hpsearch.model.backbones import named_vocab_size

    suite = suite if suite is not None else load_suite(cfg.data)
    if not any(suite.sizes("train")):
        raise ConfigError(f"data.tasks: no task has training rows in {cfg.data.source}")
    if not any(suite.sizes("validation")):  # the run would score NaN and pick no best step, and say nothing
        raise ConfigError(f"data.tasks: no task has validation rows in {cfg.data.source} (a task with fewer than 10k "
                          "training rows halves its validation file into validation and test); expected at least 2 "
                          "rows in a task's validation file")
    if targets:
        check_targets_early(cfg.model.backbone, named_vocab_size(cfg.model.backbone, cfg.model.vocab_size),
                            cfg.data, suite, cfg.train.max_new_tokens)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

"""The `model` section of a run config. Field names are the same everywhere (YAML, overrides, search spaces)."""
from __future__ import annotations

from dataclasses import dataclass

from hpsearch.errors import ConfigError

METHODS = ("mtl", "hyperprompt")
VARIANTS = ("share", "sep", "global")
PLACEMENTS = ("encoder", "decoder", "both")


@dataclass
class ModelConfig:
    backbone: str = "t5-tiny"            # named offline shape, hub id, or local checkpoint dir
    method: str = "hyperprompt"          # mtl | hyperprompt
    variant: str = "global"              # share | sep | global
    placement: str = "both"              # encoder | decoder | both
    prompt_length_encoder: int = 16      # l on the encoder side (paper's best: 16)
    prompt_length_decoder: int = 6       # l on the decoder side (paper's best: 6)
    bottleneck: int = 32                 # b: local hypernetworks d -> b -> d
    task_embedding_dim: int = 32         # t': task embedding k_tau and layer embedding z_m (global)
    layer_task_dim: int = 32             # t: layer-aware task embedding I (global)
    projection_hidden: int = 64          # e: hidden size of the projection net 2t' -> e -> t (global)
    hypernet_bias: bool = False          # biases in the hypernetworks (the paper's counts leave them out)
    train_task_params_only: bool = False  # freeze the backbone (the paper's ablation)
    dropout: float | None = None         # None keeps the backbone's dropout_rate
    vocab_size: int | None = None        # offline shapes only: None keeps the shape's vocabulary

    def prompted_sides(self) -> tuple[str, ...]:
        if self.method != "hyperprompt":
            return ()
        return {"encoder": ("encoder",), "decoder": ("decoder",), "both": ("encoder", "decoder")}[self.placement]

    def prompt_length(self, side: str) -> int:
        if side not in self.prompted_sides():
            return 0
        return self.prompt_length_encoder if side == "encoder" else self.prompt_length_decoder

    def validate(self) -> None:
        def choice(name, options):
            if getattr(self, name) not in options:
                raise ConfigError(f"model.{name}: {getattr(self, name)!r} is not one of {', '.join(options)}")

        choice("method", METHODS)
        choice("variant", VARIANTS)
        choice("placement", PLACEMENTS)
        if not self.backbone:
            raise ConfigError("model.backbone: empty; expected a named shape (e.g. t5-tiny), a hub id or a path")
        for name, low in (("prompt_length_encoder", 0), ("prompt_length_decoder", 0), ("bottleneck", 1),
                          ("task_embedding_dim", 1), ("layer_task_dim", 1), ("projection_hidden", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low or value > 4096:
                raise ConfigError(f"model.{name}: {value!r} is out of range; expected an integer in [{low}, 4096]")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: {self.dropout!r} is out of range; expected 0 <= dropout < 1")
        if self.vocab_size is not None and self.vocab_size < 8:
            raise ConfigError(f"model.vocab_size: {self.vocab_size!r} is too small; expected >= 8")
        if self.method == "mtl" and self.train_task_params_only:
            raise ConfigError("model.train_task_params_only: method=mtl has no task parameters to train alone")

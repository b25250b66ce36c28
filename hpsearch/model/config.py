"""The `model` section of a run config. Field names are the same everywhere (YAML, overrides, search spaces).

`METHOD_FIELDS` says which fields each method can use (the single source of truth for search spaces and
reports); `ModelConfig.active_fields()` narrows that to what one concrete configuration actually uses.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpsearch.errors import ConfigError

METHODS = ("mtl", "hyperprompt", "prompt_tuning", "adapter", "hyperformer", "prefix", "lora", "mam", "pha")
VARIANTS = ("share", "sep", "global")
PLACEMENTS = ("encoder", "decoder", "both")
PROMPT_INITS = ("random", "vocab", "labels")
ADAPTER_SITES = ("ffn", "attention", "both")
ADAPTER_INSERTIONS = ("sequential", "parallel")

# Fields every method uses.
COMMON_FIELDS = ("backbone", "method", "dropout", "vocab_size")
MAX_VOCAB = 2**20  # 4x mT5's 250,112; at t5-small's width, already 2 GiB of fp32 embeddings
# The fields each method can use, beyond COMMON_FIELDS (`mtl` has no task parameters, so no
# train_task_params_only either: it must stay false there).
METHOD_FIELDS: dict[str, tuple[str, ...]] = {
    "mtl": (),
    "hyperprompt": ("variant", "placement", "prompt_length_encoder", "prompt_length_decoder", "bottleneck",
                    "task_embedding_dim", "layer_task_dim", "projection_hidden", "hypernet_bias",
                    "train_task_params_only"),
    "prompt_tuning": ("prompt_length", "prompt_init", "train_task_params_only"),
    "adapter": ("bottleneck", "adapter_sites", "adapter_insertion", "adapter_scale", "train_task_params_only"),
    "hyperformer": ("reduction_factor", "hyperformer_task_dim", "hyperformer_projected_dim",
                    "hyperformer_hidden_dim", "train_task_params_only"),
    "prefix": ("prompt_length", "prefix_hidden", "train_task_params_only"),
    "lora": ("lora_rank", "lora_alpha", "lora_dropout", "train_task_params_only"),
    "mam": ("mam_prefix_length", "prefix_hidden", "bottleneck", "mam_scale", "train_task_params_only"),
    "pha": ("bottleneck", "pha_dim", "pha_retriever_hidden", "pha_hidden", "pha_temperature", "pha_loss_weight",
            "train_task_params_only"),
}
_GLOBAL_ONLY = ("task_embedding_dim", "layer_task_dim", "projection_hidden")


@dataclass
class ModelConfig:
    backbone: str = "t5-tiny"            # named offline shape, hub id, or local checkpoint dir
    method: str = "hyperprompt"          # one of METHODS
    # -- hyperprompt
    variant: str = "global"              # share | sep | global
    placement: str = "both"              # encoder | decoder | both
    prompt_length_encoder: int = 16      # l on the encoder side (paper's best: 16)
    prompt_length_decoder: int = 6       # l on the decoder side (paper's best: 6)
    bottleneck: int = 32                 # b: hyperprompt's local hypernetworks, adapter's and mam's d -> b -> d
    task_embedding_dim: int = 32         # t': task embedding k_tau and layer embedding z_m (global)
    layer_task_dim: int = 32             # t: layer-aware task embedding I (global)
    projection_hidden: int = 64          # e: hidden size of the projection net 2t' -> e -> t (global)
    hypernet_bias: bool = False          # biases in the hypernetworks (the paper's counts leave them out)
    # -- prompt_tuning, prefix
    prompt_length: int = 16              # l: soft prompts per task (prompt_tuning), key/value prefixes per layer
    prompt_init: str = "vocab"           # random | vocab | labels (labels fall back to vocab without label ids)
    # -- adapter
    adapter_sites: str = "both"          # ffn | attention | both: after which sublayers of every block
    adapter_insertion: str = "sequential"  # sequential (on the sublayer output) | parallel (beside it, fed its input)
    adapter_scale: float = 1.0           # s: composition scale of the adapter's output (unified view)
    # -- hyperformer (HyperFormer++; defaults from its released config)
    reduction_factor: int = 32           # adapter bottleneck b = d_model // reduction_factor (T5-Base: 24)
    hyperformer_task_dim: int = 64       # task, layer-id and block-type embeddings
    hyperformer_projected_dim: int = 64  # task projector output (the generators' input)
    hyperformer_hidden_dim: int = 128    # task projector hidden size
    # -- prefix, mam (prefix tuning's reparameterisation MLP d -> h -> layers * 2 * d)
    prefix_hidden: int = 64              # h (Li & Liang: 512, MAM's code: 800; 64 suits t5-tiny's d_model 64)
    # -- lora (self-attention q and v)
    lora_rank: int = 8                   # r
    lora_alpha: float = 8.0              # alpha: the update is (alpha / r) * B A (PEFT's default 8)
    lora_dropout: float = 0.0            # dropout on the input of the LoRA branch (training only)
    # -- mam (He et al. 2022): prefix on self-attention + scaled parallel adapter beside the feed-forward
    mam_prefix_length: int = 30          # l: key/value prefixes per task and layer (the paper's 30)
    mam_scale: float = 4.0               # s: FFN(LN x) + s * U(ReLU(D(LN x))) (the paper's 4)
    # -- pha (Zhao et al. 2023; defaults from its code): prototypes, retriever, hypernetwork, contrastive losses
    pha_dim: int = 64                    # p: prototypes, retriever output, block embeddings, hypernetwork output
    pha_retriever_hidden: int = 128      # r: retriever d -> r -> p
    pha_hidden: int = 128                # h: hypernetwork 2p -> h -> p
    pha_temperature: float = 0.1         # InfoNCE temperature of both auxiliary losses
    pha_loss_weight: float = 0.1         # lambda: L = L_LM + lambda * (L_IR + L_Pro)
    # -- every method with task parameters
    train_task_params_only: bool = False  # freeze the backbone (the paper's ablation; Lester's prompt tuning)
    dropout: float | None = None         # None keeps the backbone's dropout_rate
    vocab_size: int | None = None        # offline shapes only: None keeps the shape's vocabulary

    def prompted_sides(self) -> tuple[str, ...]:
        """The sides whose self-attention carries HyperPrompt key/value prompts (none for other methods): the ones
        `placement` names whose prompt length is not 0 (a side with no prompts gets no generators, which would never
        train yet count as extra parameters)."""
        if self.method != "hyperprompt":
            return ()
        placed = {"encoder": ("encoder",), "decoder": ("decoder",), "both": ("encoder", "decoder")}[self.placement]
        return tuple(side for side in placed if self._length(side) > 0)

    def side_prompt_length(self, side: str) -> int:
        """HyperPrompt's l on `side` (0 when that side is not prompted)."""
        return self._length(side) if side in self.prompted_sides() else 0

    def _length(self, side: str) -> int:
        return self.prompt_length_encoder if side == "encoder" else self.prompt_length_decoder

    def active_fields(self) -> set[str]:
        """The model fields this configuration actually uses (the others have no effect on the model)."""
        used = set(COMMON_FIELDS) | set(METHOD_FIELDS[self.method])
        if self.method == "hyperprompt":
            if self.variant != "global":
                used -= set(_GLOBAL_ONLY)
            if self.placement == "encoder":
                used.discard("prompt_length_decoder")
            elif self.placement == "decoder":
                used.discard("prompt_length_encoder")
        return used

    def validate(self) -> None:
        def choice(name, options):
            if getattr(self, name) not in options:
                raise ConfigError(f"model.{name}: {getattr(self, name)!r} is not one of {', '.join(options)}")

        choice("method", METHODS)
        choice("variant", VARIANTS)
        choice("placement", PLACEMENTS)
        choice("prompt_init", PROMPT_INITS)
        choice("adapter_sites", ADAPTER_SITES)
        choice("adapter_insertion", ADAPTER_INSERTIONS)
        if not self.backbone:
            raise ConfigError("model.backbone: empty; expected a named shape (e.g. t5-tiny), a hub id or a path")
        for name, low in (("prompt_length_encoder", 0), ("prompt_length_decoder", 0), ("bottleneck", 1),
                          ("task_embedding_dim", 1), ("layer_task_dim", 1), ("projection_hidden", 1),
                          ("prompt_length", 1), ("reduction_factor", 1), ("hyperformer_task_dim", 1),
                          ("hyperformer_projected_dim", 1), ("hyperformer_hidden_dim", 1), ("prefix_hidden", 1),
                          ("lora_rank", 1), ("mam_prefix_length", 1), ("pha_dim", 1),
                          ("pha_retriever_hidden", 1), ("pha_hidden", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low or value > 4096:
                raise ConfigError(f"model.{name}: {value!r} is out of range; expected an integer in [{low}, 4096]")
        for name, valid, text in (("lora_alpha", lambda v: 0 < v <= 4096, "0 < lora_alpha <= 4096"),
                                  ("mam_scale", lambda v: 0 < v <= 100, "0 < mam_scale <= 100"),
                                  ("adapter_scale", lambda v: 0 < v <= 100, "0 < adapter_scale <= 100"),
                                  ("lora_dropout", lambda v: 0 <= v < 1, "0 <= lora_dropout < 1"),
                                  ("pha_temperature", lambda v: 0 < v <= 100, "0 < pha_temperature <= 100"),
                                  ("pha_loss_weight", lambda v: 0 <= v <= 100, "0 <= pha_loss_weight <= 100")):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not valid(value):
                raise ConfigError(f"model.{name}: {value!r} is out of range; expected a number with {text}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: {self.dropout!r} is out of range; expected 0 <= dropout < 1")
        if self.vocab_size is not None and not 8 <= self.vocab_size <= MAX_VOCAB:  # mT5's: 250,112
            raise ConfigError(f"model.vocab_size: {self.vocab_size!r} is out of range; expected an integer from 8 "
                              f"to {MAX_VOCAB:,}")
        if self.method == "mtl" and self.train_task_params_only:
            raise ConfigError("model.train_task_params_only: method=mtl has no task parameters to train alone")
        if self.method == "hyperprompt" and not self.prompted_sides() and self.train_task_params_only:
            raise ConfigError("model.train_task_params_only: every placed side's prompt length is 0, so HyperPrompt "
                              "has no task parameters to train alone; give model.prompt_length_encoder or "
                              "model.prompt_length_decoder a length >= 1")


WIDTH_FIELDS = ("model.backbone", "model.method", "model.reduction_factor")  # what check_width reads


def check_width(cfg: ModelConfig, d_model: int) -> None:
    """What a method sizes from the backbone's width must be at least 1 (a one-line ConfigError): HyperFormer++'s
    adapter bottleneck d_model // reduction_factor. The model checks it when built; the drivers check it before
    anything starts, with the width read from the backbone's config (`backbones.backbone_width`)."""
    if cfg.method == "hyperformer" and d_model // cfg.reduction_factor < 1:
        backbone = "" if cfg.backbone.startswith("<") else f" for {cfg.backbone}"  # not "<T5Config>" (model_config)
        raise ConfigError(f"model.reduction_factor: {cfg.reduction_factor} leaves no bottleneck{backbone} "
                          f"(d_model {d_model} // {cfg.reduction_factor} = 0); expected at most {d_model}")

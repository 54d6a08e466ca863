"""Model configs (``configs/*.yaml``): one validated schema, Megatron-LM's argument names.

A config is a flat YAML mapping. Every key below is known; anything else is refused with the
closest known name, and a missing required key names the Megatron-LM flag it stands for.

=================================  ========  ======================  ===========================
key                                type      default                 Megatron-LM flag
=================================  ========  ======================  ===========================
num_layers                         int       required                --num-layers
hidden_size                        int       required                --hidden-size
num_attention_heads                int       required                --num-attention-heads
num_query_groups                   int       = heads (no GQA)        --num-query-groups
ffn_hidden_size                    int       4h (SwiGLU: 8h/3, 64s)  --ffn-hidden-size
kv_channels                        int       h / heads               --kv-channels
vocab_size                         int       258 (byte tokenizer)    --vocab-size (unpadded)
max_position_embeddings            int       = seq_length            --max-position-embeddings
position_embedding_type            str       learned_absolute        --position-embedding-type
rotary_base                        int       10000                   --rotary-base
normalization                      str       LayerNorm               --normalization
norm_epsilon                       float     1e-5                    --norm-epsilon
swiglu                             bool      false                   --swiglu
add_bias_linear                    bool      true                    --disable-bias-linear (neg.)
untie_embeddings_and_output_weights bool     false                   --untie-embeddings-and-...
causal                             bool      true                    (attention mask type)
architecture                       str       gpt                     gpt | bert | dit
layers_per_device                  int       = num_layers            (METP Table 3; ``plan``)
=================================  ========  ======================  ===========================

Training defaults a config may carry (command-line flags override them): ``seq_length``,
``micro_batch_size``, ``global_batch_size``, ``lr``, ``min_lr``, ``lr_warmup_iters``,
``train_iters``, ``weight_decay``, ``clip_grad``, ``tensor_parallel_mode``,
``tensor_model_parallel_size``, ``context_parallel_size``, ``pipeline_model_parallel_size``,
``hidden_dropout``, ``attention_dropout``, ``seed``. Free text: ``name``, ``description``.
"""

from __future__ import annotations

import difflib
from argparse import Namespace
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Optional, Union

import yaml

PACKAGE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "tiny-gpt"

_MODEL_KEYS: Dict[str, tuple] = {
    # key: (type, default, flag); default _REQUIRED means required
    "num_layers": (int, None, "--num-layers"),
    "hidden_size": (int, None, "--hidden-size"),
    "num_attention_heads": (int, None, "--num-attention-heads"),
    "num_query_groups": (int, None, "--num-query-groups"),
    "ffn_hidden_size": (int, None, "--ffn-hidden-size"),
    "kv_channels": (int, None, "--kv-channels"),
    "vocab_size": (int, None, "--vocab-size"),
    "max_position_embeddings": (int, None, "--max-position-embeddings"),
    "position_embedding_type": (str, "learned_absolute", "--position-embedding-type"),
    "rotary_base": (int, 10000, "--rotary-base"),
    "normalization": (str, "LayerNorm", "--normalization"),
    "norm_epsilon": (float, 1e-5, "--norm-epsilon"),
    "swiglu": (bool, False, "--swiglu"),
    "add_bias_linear": (bool, True, "--disable-bias-linear"),
    "untie_embeddings_and_output_weights": (bool, False, "--untie-embeddings-and-output-weights"),
    "causal": (bool, True, "(attention mask)"),
    "architecture": (str, "gpt", "(architecture)"),
    "layers_per_device": (int, None, "(layers per device)"),
}
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
_TRAIN_KEYS: Dict[str, tuple] = {
    "seq_length": (int, "--seq-length"),
    "micro_batch_size": (int, "--micro-batch-size"),
    "global_batch_size": (int, "--global-batch-size"),
    "lr": (float, "--lr"),
    "min_lr": (float, "--min-lr"),
    "lr_warmup_iters": (int, "--lr-warmup-iters"),
    "lr_decay_iters": (int, "--lr-decay-iters"),
    "lr_decay_style": (str, "--lr-decay-style"),
    "train_iters": (int, "--train-iters"),
    "weight_decay": (float, "--weight-decay"),
    "clip_grad": (float, "--clip-grad"),
    "tensor_parallel_mode": (str, "--tensor-parallel-mode"),
    "tensor_model_parallel_size": (int, "--tensor-model-parallel-size"),
    "context_parallel_size": (int, "--context-parallel-size"),
    "pipeline_model_parallel_size": (int, "--pipeline-model-parallel-size"),
    "hidden_dropout": (float, "--hidden-dropout"),
    "attention_dropout": (float, "--attention-dropout"),
    "seed": (int, "--seed"),
}
_TEXT_KEYS = ("name", "description")
_CHOICES = {
    "position_embedding_type": ("learned_absolute", "rope"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "architecture": ("gpt", "bert", "dit"),
    "tensor_parallel_mode": ("tp", "metp", "wallfacer"),
    "lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
}
ALL_KEYS = tuple(_MODEL_KEYS) + tuple(_TRAIN_KEYS) + _TEXT_KEYS


class ConfigError(ValueError):
    """A config file the schema refuses; the message names the file, the key and the fix."""


@dataclass
class ModelConfig:
    """A validated config: model fields resolved to Megatron-LM's defaults, training defaults kept
    apart (``train``) so that command-line flags can override them."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    kv_channels: int
    vocab_size: Optional[int]
    max_position_embeddings: Optional[int]
    position_embedding_type: str
    rotary_base: int
    normalization: str
    norm_epsilon: float
    swiglu: bool
    add_bias_linear: bool
    untie_embeddings_and_output_weights: bool
    causal: bool
    architecture: str
    layers_per_device: int
    name: str = ""
    description: str = ""
    source: str = ""
    train: Dict[str, Any] = field(default_factory=dict)

    def megatron_args(self) -> Dict[str, Any]:
        """The model part as Megatron-LM argument names (for ``validate_args`` namespaces)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name in _MODEL_KEYS and f.name not in ("causal", "architecture",
                                                           "layers_per_device")}
        out["group_query_attention"] = self.num_query_groups != self.num_attention_heads
        return out

    def namespace(self, **extra: Any) -> Namespace:
        return Namespace(**{**self.megatron_args(), **extra})


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, ALL_KEYS, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_type(where: str, key: str, value: Any, typ: type, flag: str) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where}: {key} ({flag}) must be {typ.__name__}, got "
                          f"{type(value).__name__} {value!r}")
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ConfigError(f"{where}: {key} ({flag}) must be one of {', '.join(_CHOICES[key])}, "
                          f"got {value!r}")
    if typ in (int, float) and key not in ("norm_epsilon",) and value < 0:
        raise ConfigError(f"{where}: {key} ({flag}) must be >= 0, got {value}")
    return value


def parse_config(data: Any, where: str = "<config>") -> ModelConfig:
    """Validate a mapping (as loaded from YAML) and resolve Megatron-LM's defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a config is a YAML mapping of keys to values, got "
                          f"{type(data).__name__}")
    unknown = [k for k in data if k not in ALL_KEYS]
    if unknown:
        k = unknown[0]
        raise ConfigError(f"{where}: unknown key {k!r}{_suggest(str(k))}; known keys: "
                          f"{', '.join(ALL_KEYS)}")
    missing = [k for k in REQUIRED if data.get(k) is None]
    if missing:
        k = missing[0]
        raise ConfigError(f"{where}: missing required key {k!r} (Megatron-LM "
                          f"{_MODEL_KEYS[k][2]})")
    model: Dict[str, Any] = {}
    for key, (typ, default, flag) in _MODEL_KEYS.items():
        value = data.get(key)
        model[key] = default if value is None else _check_type(where, key, value, typ, flag)
    for key in REQUIRED:
        if model[key] < 1:
            raise ConfigError(f"{where}: {key} ({_MODEL_KEYS[key][2]}) must be >= 1")
    train = {}
    for key, (typ, flag) in _TRAIN_KEYS.items():
        if data.get(key) is not None:
            train[key] = _check_type(where, key, data[key], typ, flag)
    h, heads = model["hidden_size"], model["num_attention_heads"]
    if model["kv_channels"] is None:
        if h % heads:
            raise ConfigError(f"{where}: hidden_size {h} is not divisible by num_attention_heads "
                              f"{heads} (--num-attention-heads): pick a head count dividing "
                              f"{h} or set kv_channels")
        model["kv_channels"] = h // heads
    if model["num_query_groups"] is None:
        model["num_query_groups"] = heads
    if heads % model["num_query_groups"]:
        raise ConfigError(f"{where}: num_query_groups {model['num_query_groups']} "
                          f"(--num-query-groups) must divide num_attention_heads {heads}")
    if model["ffn_hidden_size"] is None:
        # Megatron-LM's defaults: 4h, or for SwiGLU 2/3 of that rounded down to a multiple of 64.
        model["ffn_hidden_size"] = (int(4 * h * 2 / 3 / 64) * 64) if model["swiglu"] else 4 * h
    if model["layers_per_device"] is None:
        model["layers_per_device"] = model["num_layers"]
    if model["num_layers"] % model["layers_per_device"]:
        raise ConfigError(f"{where}: layers_per_device {model['layers_per_device']} must divide "
                          f"num_layers {model['num_layers']}")
    text = {k: str(data.get(k) or "") for k in _TEXT_KEYS}
    return ModelConfig(**model, **text, source=where, train=train)


def resolve_config_path(name_or_path: Union[str, Path]) -> Path:
    """A path as given, else ``configs/NAME.yaml`` in the working directory, else the package's
    own ``megatron_metp/configs`` (the repository's top-level ``configs/`` links there)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    stem = p.name[:-5] if p.name.endswith(".yaml") else p.name
    for base in (Path.cwd() / "configs", PACKAGE_CONFIGS):
        cand = base / f"{stem}.yaml"
        if cand.is_file():
            return cand
    known = sorted({c.stem for base in (PACKAGE_CONFIGS,) if base.is_dir()
                    for c in base.glob("*.yaml")})
    raise ConfigError(f"--config {name_or_path}: no such file, and no configs/{stem}.yaml; "
                      f"known configs: {', '.join(known) or '(none found)'}")


def load_config(name_or_path: Union[str, Path] = DEFAULT_CONFIG) -> ModelConfig:
    """Read and validate ``configs/<name>.yaml`` (or a path)."""
    path = resolve_config_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return parse_config(data, where=str(path))


def config_from_megatron_args(ns: Namespace) -> ModelConfig:
    """The model of a Megatron-LM argument namespace as a ModelConfig (for the planner: one
    pipeline stage's layers, Megatron's flag semantics: ``--num-query-groups`` counts only with
    ``--group-query-attention``, ``--add-bias-linear`` / ``--disable-bias-linear``)."""
    data = {key: getattr(ns, key, None) for key in _MODEL_KEYS
            if key not in ("causal", "architecture", "layers_per_device", "num_query_groups")}
    if getattr(ns, "group_query_attention", False):
        data["num_query_groups"] = getattr(ns, "num_query_groups", None)
    data["vocab_size"] = data.get("vocab_size") or getattr(ns, "padded_vocab_size", None)
    pp = getattr(ns, "pipeline_model_parallel_size", 1) or 1
    data["layers_per_device"] = ns.num_layers // pp if ns.num_layers % pp == 0 else None
    data = {k: v for k, v in data.items() if v is not None}
    return parse_config(data, where="Megatron-LM arguments")

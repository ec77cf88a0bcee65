"""Read a model directory the way SGLang does, as far as KV-cache sizing needs it.

Mirrors SGLang 0.5.23 `srt/configs/model_config.py` (`ModelConfig._derive_model_shapes`,
`get_num_kv_heads`) and `utils/hf_transformers/common.py` (`get_hf_text_config`): the
attention shape comes from the *text* sub-config of multimodal wrappers (Kimi-K2.5 nests a
DeepSeek-V3 config under `text_config`), and the attention kind (MHA vs MLA) is decided by
the architecture name, exactly as SGLang does, not by the presence of `kv_lora_rank`.
Weight bytes come from `model.safetensors.index.json` `metadata.total_size`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sglang_fleet import input_files

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

# Architectures SGLang 0.5.23 treats as MLA (`_derive_model_shapes`, the branch that sets
# `attention_arch = AttentionArch.MLA` and reads kv_lora_rank / qk_rope_head_dim).
MLA_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV3ForCausalLMNextN",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
        "LongcatFlashForCausalLM",
        "DotsVLMForCausalLM",
        "MistralLarge3ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Eagle3DeepseekV2ForCausalLM",
        "GigaChat35ForCausalLM",
        "MiniCPM3ForCausalLM",
        "DeepseekVL2ForCausalLM",
        "KimiVLForConditionalGeneration",
        "SarvamMLAForCausalLM",
        "Glm5NextForConditionalGeneration",
        "HYV4ForCausalLM",
        "Dots3NoteForCausalLM",
    }
)

# Priority SGLang uses when a wrapper config holds several sub-configs.
_TEXT_SUBCONFIG_KEYS = ("thinker_config", "llm_config", "language_config", "text_config")

# SGLang's `adjust_mem_fraction_for_vlm` falls back to a ViT-L/14 shape when the vision
# config lacks these; Kimi's vision config spells them with a `vt_` prefix.
_DEFAULT_VIT_LAYERS = 24
_DEFAULT_VIT_HIDDEN = 1024
# No real model has a dimension this large; beyond it the arithmetic stops meaning anything.
MAX_DIMENSION = 2**31 - 1


class ModelConfigError(ValueError):
    """The model directory or its config cannot be read as SGLang would."""


@dataclass(frozen=True)
class ModelShape:
    """What the KV-cache and memory heuristics need to know about a model."""

    architecture: str
    attention: Literal["MHA", "MLA"]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    context_length: int
    is_multimodal: bool
    vit_layers: int
    vit_hidden_size: int

    @property
    def is_mla(self) -> bool:
        return self.attention == "MLA"


def _text_config_key(config: dict[str, Any]) -> str | None:
    return next((key for key in _TEXT_SUBCONFIG_KEYS if isinstance(config.get(key), dict)), None)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The sub-config that describes the language model (the config itself for text models)."""
    key = _text_config_key(config)
    return config[key] if key else config


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or text_config(config).get("architectures")
    if not archs:
        raise ModelConfigError("config.json has no 'architectures' list")
    if not isinstance(archs, list):
        raise ModelConfigError(f"config.json: 'architectures' must be a list, got {archs!r}")
    if not isinstance(archs[0], str) or not archs[0]:
        raise ModelConfigError(
            f"config.json: 'architectures' must name classes as strings, got {archs[0]!r}"
        )
    return archs[0]


def _int_field(cfg: dict[str, Any], key: str, *, minimum: int, where: str = "") -> int:
    """cfg[key] as an int in minimum..MAX_DIMENSION; `where` is cfg's path in config.json."""
    value = cfg.get(key)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not minimum <= value <= MAX_DIMENSION
    ):
        raise ModelConfigError(
            f"config.json: '{where}{key}' must be an integer from {minimum} to {MAX_DIMENSION}, "
            f"got {value!r}"
        )
    return value


def _optional_int(cfg: dict[str, Any], key: str, default: int, where: str = "") -> int:
    """An optional dimension: absent, null or 0 mean `default` (SGLang's `or` fallbacks)."""
    if cfg.get(key) is None:
        return default
    return _int_field(cfg, key, minimum=0, where=where) or default


def _vision_shape(config: dict[str, Any]) -> tuple[int, int]:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0, 0
    where = "vision_config."
    layers = _optional_int(vision, "vt_num_hidden_layers", 0, where)
    layers = _optional_int(vision, "num_hidden_layers", layers, where)
    hidden = _optional_int(vision, "vt_hidden_size", 0, where)
    hidden = _optional_int(vision, "hidden_size", hidden, where)
    return layers or _DEFAULT_VIT_LAYERS, hidden or _DEFAULT_VIT_HIDDEN


def _head_dim(text: dict[str, Any], heads: int, where: str) -> int:
    head_dim = _optional_int(text, "head_dim", 0, where)
    if head_dim:
        return head_dim
    hidden = _int_field(text, "hidden_size", minimum=1, where=where)
    if hidden < heads:
        raise ModelConfigError(
            f"config.json: hidden_size {hidden} is smaller than num_attention_heads {heads} "
            "and there is no head_dim: a head would have no dimensions"
        )
    return hidden // heads


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Derive the attention shape from a parsed config.json (SGLang's rules)."""
    if not isinstance(config, dict):
        raise ModelConfigError(f"config.json must be a JSON object, got {type(config).__name__}")
    architecture = _architecture(config)
    text = text_config(config)
    sub = _text_config_key(config)
    where = f"{sub}." if sub else ""
    num_layers = _int_field(text, "num_hidden_layers", minimum=1, where=where)
    heads = _int_field(text, "num_attention_heads", minimum=1, where=where)
    num_kv_heads = _optional_int(text, "num_key_value_heads", heads, where)
    head_dim = _head_dim(text, heads, where)
    v_head_dim = _optional_int(text, "v_head_dim", head_dim, where)
    is_mla = architecture in MLA_ARCHITECTURES
    kv_lora_rank = _optional_int(text, "kv_lora_rank", 0, where)
    qk_rope_head_dim = _optional_int(text, "qk_rope_head_dim", 0, where)
    if is_mla and not (kv_lora_rank and qk_rope_head_dim):
        raise ModelConfigError(
            f"{architecture} is an MLA architecture but config.json lacks "
            "kv_lora_rank / qk_rope_head_dim"
        )
    vit_layers, vit_hidden = _vision_shape(config)
    return ModelShape(
        architecture=architecture,
        attention="MLA" if is_mla else "MHA",
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        # 0: unknown (SGLang then takes the context length from elsewhere or the flag).
        context_length=_optional_int(text, "max_position_embeddings", 0, where),
        # SGLang keys multimodality on an architecture list; every entry of it that a
        # deployment here meets carries a vision_config, which is what we check.
        is_multimodal=isinstance(config.get("vision_config"), dict),
        vit_layers=vit_layers,
        vit_hidden_size=vit_hidden,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = input_files.read_bytes(path, input_files.JSON_LIMIT, "").decode("utf-8")
    except input_files.InputFileError as exc:  # not a regular file, unreadable, too large
        raise ModelConfigError(f"cannot read {path}: {exc.reason}") from exc
    except UnicodeDecodeError as exc:
        raise ModelConfigError(
            f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc
    try:
        data = json.loads(raw)
    except RecursionError as exc:
        raise ModelConfigError(f"{path} nests too deeply to be a model description") from exc
    except ValueError as exc:  # JSONDecodeError, or a number too long to convert
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} does not hold a JSON object")
    return data


def weight_bytes_from_index(index: dict[str, Any]) -> int:
    """`metadata.total_size` of a safetensors index: the checkpoint's tensor bytes."""
    metadata = index.get("metadata") if isinstance(index, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        raise ModelConfigError("model.safetensors.index.json lacks a positive metadata.total_size")
    return total


def _weight_bytes(model_dir: Path) -> int:
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return weight_bytes_from_index(_read_json(index_path))
    # Single-file checkpoints have no index; their file size is the tensor bytes plus a
    # small JSON header, close enough for a memory plan.
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{model_dir} has neither {INDEX_FILE} nor *.safetensors")
    try:
        total = sum(f.stat().st_size for f in files)
    except OSError as exc:
        raise ModelConfigError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    if total <= 0:
        raise ModelConfigError(f"the *.safetensors files in {model_dir} are empty")
    return total


def read_model_dir(model_dir: str | Path) -> tuple[dict[str, Any], int]:
    """Return (config.json as a dict, checkpoint weight bytes) for a model directory."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model path {path} is not a directory")
    return _read_json(path / CONFIG_FILE), _weight_bytes(path)

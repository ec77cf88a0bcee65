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


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The sub-config that describes the language model (the config itself for text models)."""
    for key in _TEXT_SUBCONFIG_KEYS:
        sub = config.get(key)
        if isinstance(sub, dict):
            return sub
    return config


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or text_config(config).get("architectures") or []
    if not archs:
        raise ModelConfigError("config.json has no 'architectures' list")
    return str(archs[0])


def _required_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelConfigError(
            f"config.json: '{key}' must be a non-negative integer, got {value!r}"
        )
    return value


def _vision_shape(config: dict[str, Any]) -> tuple[int, int]:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0, 0
    layers = vision.get(
        "num_hidden_layers", vision.get("vt_num_hidden_layers", _DEFAULT_VIT_LAYERS)
    )
    hidden = vision.get("hidden_size", vision.get("vt_hidden_size", _DEFAULT_VIT_HIDDEN))
    return int(layers), int(hidden)


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Derive the attention shape from a parsed config.json (SGLang's rules)."""
    architecture = _architecture(config)
    text = text_config(config)
    num_layers = _required_int(text, "num_hidden_layers")
    heads = _required_int(text, "num_attention_heads")
    num_kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or _required_int(text, "hidden_size") // max(heads, 1)
    v_head_dim = text.get("v_head_dim") or head_dim
    is_mla = architecture in MLA_ARCHITECTURES
    kv_lora_rank = text.get("kv_lora_rank") or 0
    qk_rope_head_dim = text.get("qk_rope_head_dim") or 0
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
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        v_head_dim=int(v_head_dim),
        kv_lora_rank=int(kv_lora_rank),
        qk_rope_head_dim=int(qk_rope_head_dim),
        context_length=int(text.get("max_position_embeddings") or 0),
        # SGLang keys multimodality on an architecture list; every entry of it that a
        # deployment here meets carries a vision_config, which is what we check.
        is_multimodal=isinstance(config.get("vision_config"), dict),
        vit_layers=vit_layers,
        vit_hidden_size=vit_hidden,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelConfigError(f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} does not hold a JSON object")
    return data


def weight_bytes_from_index(index: dict[str, Any]) -> int:
    """`metadata.total_size` of a safetensors index: the checkpoint's tensor bytes."""
    total = (index.get("metadata") or {}).get("total_size")
    if not isinstance(total, int) or total <= 0:
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
    return sum(f.stat().st_size for f in files)


def read_model_dir(model_dir: str | Path) -> tuple[dict[str, Any], int]:
    """Return (config.json as a dict, checkpoint weight bytes) for a model directory."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model path {path} is not a directory")
    return _read_json(path / CONFIG_FILE), _weight_bytes(path)

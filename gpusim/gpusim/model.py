"""Read a Hugging Face model directory the way SGLang does, without weights.

Only what the memory model needs: attention shape (MHA/GQA or MLA), layer count, dtype,
context length, and total weight bytes from model.safetensors.index.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures SGLang serves with Multi-head Latent Attention (compressed latent KV cache).
MLA_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "Eagle3DeepseekV2ForCausalLM",  # MLA EAGLE-3 drafts (kimi-k2.5-eagle3-mla)
        "KimiK25ForConditionalGeneration",
        "KimiVLForConditionalGeneration",
    }
)
# Architectures on SGLang's multimodal list (configs/model_config.py) that this project meets;
# any config with a `vision_config` counts too (SGLang's has_multimodal_subconfig).
MULTIMODAL_ARCHITECTURES = frozenset(
    {
        "KimiK25ForConditionalGeneration",
        "KimiVLForConditionalGeneration",
        "Llama4ForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
    }
)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# adjust_mem_fraction_for_vlm's getattr defaults (a ViT-L/14) for a vision_config without them.
DEFAULT_VIT_LAYERS = 24
DEFAULT_VIT_HIDDEN_SIZE = 1024


class ModelDirError(ValueError):
    pass


@dataclass(frozen=True)
class ModelShape:
    path: str
    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    torch_dtype: str
    context_len: int
    vocab_size: int
    weight_bytes: int
    is_multimodal: bool = False
    vit_layers: int = DEFAULT_VIT_LAYERS
    vit_hidden_size: int = DEFAULT_VIT_HIDDEN_SIZE
    # `num_nextn_predict_layers` (MTP heads a DeepSeek-style checkpoint carries; 0 or None: none).
    nextn_layers: int | None = None
    # The text config as read (gpusim/placement.py lays the tensors out from it).
    text_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.torch_dtype, 2)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Kimi-K2.5, Llama-4, Qwen-VL) keep the language model nested."""
    nested = config.get("text_config") or config.get("language_config")
    if not isinstance(nested, dict):
        return config
    return {**{k: v for k, v in config.items() if k != "text_config"}, **nested}


def _weight_bytes(model_dir: Path) -> int:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return int(json.loads(index.read_text())["metadata"]["total_size"])
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return sum(s.stat().st_size for s in shards)
    raise ModelDirError(f"no model.safetensors.index.json or *.safetensors in {model_dir}")


def _vision(raw: dict[str, Any], architecture: str) -> tuple[bool, int, int]:
    """Whether SGLang treats the model as multimodal, and its ViT's layers and width."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        vision = {}
        multimodal = architecture in MULTIMODAL_ARCHITECTURES
    else:
        multimodal = True
    layers = int(vision.get("num_hidden_layers", DEFAULT_VIT_LAYERS))
    hidden = int(vision.get("hidden_size", DEFAULT_VIT_HIDDEN_SIZE))
    return multimodal, layers, hidden


def load_model(model_path: str, context_length: int | None = None) -> ModelShape:
    model_dir = Path(model_path)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelDirError(
            f"Can't load the configuration of '{model_path}'. Make sure '{model_path}' is the "
            "correct path to a directory containing a config.json file"
        )
    raw = json.loads(config_file.read_text())
    cfg = _text_config(raw)
    architecture = (raw.get("architectures") or cfg.get("architectures") or ["Unknown"])[0]
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    is_mla = architecture in MLA_ARCHITECTURES or "kv_lora_rank" in cfg
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    multimodal, vit_layers, vit_hidden = _vision(raw, architecture)
    return ModelShape(
        path=str(model_dir),
        architecture=architecture,
        model_type=str(raw.get("model_type", cfg.get("model_type", ""))),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        v_head_dim=int(cfg.get("v_head_dim") or head_dim),
        kv_lora_rank=int(cfg["kv_lora_rank"]) if is_mla else None,
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]) if is_mla else None,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        context_len=int(context_length or cfg.get("max_position_embeddings") or 4096),
        vocab_size=int(cfg.get("vocab_size", 32000)),
        weight_bytes=_weight_bytes(model_dir),
        is_multimodal=multimodal,
        vit_layers=vit_layers,
        vit_hidden_size=vit_hidden,
        nextn_layers=int(cfg["num_nextn_predict_layers"])
        if cfg.get("num_nextn_predict_layers") is not None
        else None,
        text_config=cfg,
    )

"""transformers' defaults for the fields a saved LLaVA config may leave out.

transformers long wrote a model's nested configs as their difference from their class's
defaults, so a LLaVA-1.5 directory's text_config can name no width or depth at all
(llava-1.5-7b-hf's says only its vocabulary, positions and norm epsilon: the rest is
LlamaConfig's defaults, Llama 2 7B's shape). Reading such a directory needs the defaults
transformers would fill in; they are written out here, for the configuration classes a
LLaVA import takes, and tests/test_vlm.py holds them to transformers' own classes.
"""

from __future__ import annotations

from typing import Any

# The language models a LLaVA directory may hold, by text_config.model_type.
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
}

# Gemma 3's language model inside Gemma3ForConditionalGeneration (model_type gemma3: 4B,
# 12B, 27B), whose text_config is saved as its difference from Gemma3TextConfig's
# defaults (Gemma 3 4B's names its width, depth, window and RoPE scaling alone). The
# RoPE bases, the layer pattern and the query scale are import_hf's Gemma defaults.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
}

# The vision towers, by vision_config.model_type.
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 32,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    },
    "siglip_vision_model": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    },
}

# LlavaConfig's and LlavaNextConfig's own fields; a config with no vision_config at all
# gets LLaVA-1.5's CLIP ViT-L/14 at 336 px, with no text_config Llama's defaults.
LLAVA_DEFAULTS: dict[str, Any] = {
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "multimodal_projector_bias": True,
    "tie_word_embeddings": False,
}
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
DEFAULT_VISION_CONFIG: dict[str, Any] = {
    "model_type": "clip_vision_model",
    "intermediate_size": 4096,
    "hidden_size": 1024,
    "patch_size": 14,
    "image_size": 336,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
}

# The image processors' defaults (their PIL forms), by image_processor_type less any
# "Fast" suffix: CLIP's and LLaVA's resize the shorter side and crop the centre, SigLIP's
# resize to a square.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_CLIP_PROCESSOR: dict[str, Any] = {
    "do_resize": True,
    "size": {"shortest_edge": 224},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": _CLIP_MEAN,
    "image_std": _CLIP_STD,
}
PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP_PROCESSOR,
    "LlavaImageProcessor": {**_CLIP_PROCESSOR, "do_pad": False},
    "LlavaNextImageProcessor": {**_CLIP_PROCESSOR, "image_grid_pinpoints": LLAVA_NEXT_PINPOINTS},
    "SiglipImageProcessor": {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 3,
        "do_center_crop": False,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
}


def with_defaults(given: dict[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """`given` with every default it leaves out. A field given as null stays null: a
    saved difference says so where null is not the default (Mistral's sliding_window
    null: no window)."""
    return {**defaults, **(given or {})}

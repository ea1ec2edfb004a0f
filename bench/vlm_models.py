"""Small random-weight LLaVA models built with transformers and saved as Hugging Face
directories (weights, tokenizer, image processor, chat template), as a user brings a
model of their own: what tests/test_vlm.py holds our import and serving to.

"llava": LLaVA-1.5's shape: a CLIP tower read at its layer before last less its class
token, a Llama language model, the image padded to a square first. "llava_next":
LLaVA-NeXT's: a SigLIP tower read at its last two layers with every token kept, a Qwen2
language model (q/k/v biases, its head tied to the token table), images tiled at the best
of three resolutions with an image_newline per row.
Random weights: nothing here is a quality figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.family_models import bpe_tokenizer, randomise

SPECIALS = ["<s>", "</s>", "<image>"]
CORPUS = [
    "Describe the part in the image and name any defect on it.",
    "The label reads SN-2041; the dosage is 5 mg twice a day.",
    "A scratch runs across the left edge; the surface is otherwise clean.",
    "What is wrong with this part? Read the serial number.",
] * 20
# LLaVA-1.5's template, as llava-hf's processors carry it: the images of a turn before its
# text, each as the image token.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
IMAGE_SIZE, PATCH = 32, 8
PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def _tokenizer() -> Any:
    return bpe_tokenizer(CORPUS, SPECIALS, "<s>", "</s>")


def make_llava(directory: Path, family: str) -> tuple[Any, Any]:
    """A small random LLaVA ("llava") or LLaVA-NeXT ("llava_next") model saved in
    `directory` with its processor; returns (model, processor)."""
    import transformers

    # Untyped, or typed without the fields these models set (rope_theta, image_token_index).
    hf: Any = transformers

    directory.mkdir(parents=True)
    tokenizer = _tokenizer()
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<s>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("</s>"),
    }
    vision: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
    }
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    size = {"size": {"shortest_edge": IMAGE_SIZE}, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
    model: Any
    processor: Any
    if family == "llava":
        config: Any = hf.LlavaConfig(
            vision_config=hf.CLIPVisionConfig(**vision),
            text_config=hf.LlamaConfig(**text, rope_theta=50000.0),
            image_token_index=image_token,
        )
        model = hf.LlavaForConditionalGeneration(config)
        processor = hf.LlavaProcessor(
            image_processor=hf.LlavaImageProcessorPil(**size, do_pad=True),
            tokenizer=tokenizer,
            patch_size=PATCH,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP's class token
            chat_template=TEMPLATE,
        )
    else:
        config = hf.LlavaNextConfig(
            vision_config=hf.SiglipVisionConfig(**vision),
            text_config=hf.Qwen2Config(**text),
            image_token_index=image_token,
            tie_word_embeddings=True,  # the head is the token table, and not saved
            image_grid_pinpoints=PINPOINTS,
            vision_feature_select_strategy="full",
            vision_feature_layer=[-2, -1],
        )
        model = hf.LlavaNextForConditionalGeneration(config)
        processor = hf.LlavaNextProcessor(
            image_processor=hf.LlavaNextImageProcessorPil(**size, image_grid_pinpoints=PINPOINTS),
            tokenizer=tokenizer,
            patch_size=PATCH,
            vision_feature_select_strategy="full",
            num_additional_image_tokens=0,
            chat_template=TEMPLATE,
        )
    randomise(model)
    model.eval()
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, processor


def random_image(height: int, width: int, seed: int) -> Image.Image:
    """An RGB image of smooth random colour fields (resizing noise alone would blur it to grey)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    smooth = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
    grain = rng.integers(-20, 21, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(smooth).astype(int) + grain, 0, 255).astype(np.uint8))

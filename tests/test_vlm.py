"""A user's own LLaVA-style vision-language model against transformers itself: small
random-weight LLaVA-1.5 (CLIP tower, Llama) and LLaVA-NeXT (SigLIP tower read at two
layers, Qwen2, anyres tiles with image_newline) models are built with transformers and
saved with their processors (bench/vlm_models.py), built by the text build as `edgectl
build` builds a models.qa.source, and served: the image part by edge/vlm, the language
model by the text engine from rows spliced into its prompt. The pixels, the prompt's
tokens (the image token expanded as the processor expands it) and the float logits over
every image and text position must be transformers'; greedy tokens equal; the INT4 build
serves the image; the Hub's older layouts and sparse configs import alike; other
vision-language models, and what LLaVA sets that we do not serve, are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.common import free_port
from bench.vlm_models import make_llava, random_image
from edge.text.kv.prefix_cache import PrefixCache
from edge.text.model.checkpoint import IMAGE_PART, load_checkpoint
from edge.text.model.splice import Splice
from edge.text.prompt import Prompter
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams
from edge.vlm.vision_language import VisionLanguage
from engines.text.hf_defaults import PROCESSOR_DEFAULTS, TEXT_DEFAULTS, VISION_DEFAULTS
from engines.text.import_gguf import SourceModelError
from engines.text.import_hf import read_source
from engines.text.text_build import build_text_engine
from tests.conftest import edgectl, write_profile

SYSTEM = "Answer briefly."
QUESTION = "What is wrong with this part?"
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["llava", "llava_next"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(str(request.param))
    model, processor = make_llava(root / "source", str(request.param))
    built = build_text_engine(root / "engines", "none", "float", False, str(root / "source"))
    return {"name": request.param, "hf": model, "processor": processor, "root": root, "ckpt": built}


def _messages(images: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [*[{"type": "image"}] * images, {"type": "text", "text": QUESTION}]},
    ]


def _theirs(vlm: dict[str, Any], image: Any) -> Any:
    """transformers' processor's inputs for the question about `image`."""
    processor = vlm["processor"]
    text = processor.apply_chat_template(_messages(1), add_generation_prompt=True, tokenize=False)
    return processor(images=[image], text=text, return_tensors="pt", add_special_tokens=False)


def _ours(ckpt: Path, image: Any) -> tuple[Any, Any, Any]:
    """Our checkpoint, image part and prompt for the question about `image`."""
    ours = load_checkpoint(ckpt)
    eye = VisionLanguage.load(ckpt)
    prompt = eye.prompt(Prompter(ours.tokenizer, ours.chat, SYSTEM), QUESTION, None, [image])
    return ours, eye, prompt


def test_the_build_carries_the_image_part_and_prompts_as_the_processor(vlm: dict[str, Any]) -> None:
    assert all((vlm["ckpt"] / name).is_file() for name in IMAGE_PART)
    image = random_image(45, 80, seed=1)  # wide: LLaVA pads it square, LLaVA-NeXT tiles it 2x2 and unpads
    theirs = _theirs(vlm, image)
    _, eye, prompt = _ours(vlm["ckpt"], image)
    pixels = theirs["pixel_values"][0] if vlm["name"] == "llava_next" else theirs["pixel_values"]
    assert torch.equal(eye.pixels(image).views, pixels)
    assert torch.equal(eye.pixels(np.asarray(image)).views, pixels)  # as the daemon decodes images
    assert prompt.ids == theirs["input_ids"][0].tolist()
    # LLaVA: a 4x4 patch grid less the class token; LLaVA-NeXT: the base view's 16, then
    # the 2x2 tiles' 8x8 grid unpadded to 4 rows, each ended by its newline.
    assert prompt.image_tokens == {"llava": 16, "llava_next": 16 + 4 * (8 + 1)}[vlm["name"]]
    (splice,) = prompt.splices
    assert set(prompt.ids[splice.at : splice.end]) == {eye.config.image_token_id}
    assert 0 < prompt.prefix <= splice.at  # the system turn, never past the image


@pytest.mark.parametrize("size", [(45, 80), (80, 45), (64, 64), (33, 97), (97, 33), (20, 200), (301, 7)])
def test_an_images_rows_are_counted_from_its_size(vlm: dict[str, Any], size: tuple[int, int]) -> None:
    """What a job's prompt and KV count for its image before its pixels are decoded (the
    model's arithmetic on its header's size) is the number of rows the tower and the
    projector then make: wide, tall and square, LLaVA-NeXT's tiling and unpadding too."""
    eye = VisionLanguage.load(vlm["ckpt"])
    rows = eye.features(np.zeros((*size, 3), dtype=np.uint8))
    assert eye.image_tokens(size) == rows.shape[0]


def test_float_logits_equal_transformers_over_the_image_and_text_positions(vlm: dict[str, Any]) -> None:
    image = random_image(45, 80, seed=2)
    theirs = _theirs(vlm, image)
    with torch.no_grad():
        expected = vlm["hf"](**theirs).logits[0]
    ours, _, prompt = _ours(vlm["ckpt"], image)
    ids = torch.tensor([prompt.ids])
    whole = ours.model(ids, ours.model.new_cache(1, len(prompt.ids)), 0, last_only=False, splices=prompt.splices)[0]
    assert (whole - expected).abs().max().item() < 1e-4
    # In chunks, the cut inside the image: each chunk takes the rows of its own positions.
    cut = prompt.splices[0].at + 5
    cache = ours.model.new_cache(1, len(prompt.ids))
    first = ours.model(ids[:, :cut], cache, 0, last_only=False, splices=prompt.splices)[0]
    second = ours.model(ids[:, cut:], cache, cut, last_only=False, splices=prompt.splices)[0]
    assert (torch.cat([first, second]) - expected).abs().max().item() < 1e-4
    # The image is read: without its rows the image positions' logits are another thing.
    plain = ours.model(ids, ours.model.new_cache(1, len(prompt.ids)), 0, last_only=False)[0]
    assert (plain - expected).abs().max().item() > 0.1


def test_greedy_tokens_equal_transformers(vlm: dict[str, Any]) -> None:
    from bench.text_engines import load_engine

    image = random_image(60, 50, seed=3)
    theirs = _theirs(vlm, image)
    with torch.no_grad():
        out = vlm["hf"].generate(
            **theirs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
    expected = out[0, theirs["input_ids"].shape[1] :].tolist()
    engine = load_engine(vlm["ckpt"], "cpu", system_prompt=SYSTEM)
    eye = VisionLanguage.load(vlm["ckpt"], engine.device, engine.dtype)
    prompt = eye.prompt(engine.prompter, QUESTION, None, [image])
    assert prompt.ids == theirs["input_ids"][0].tolist()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    got = engine.generate(prompt.ids, params, prefix=prompt.prefix, splices=prompt.splices)
    assert got.tokens == expected


@pytest.mark.parametrize("vlm", ["llava"], indirect=True)
def test_an_int4_build_serves_the_image(vlm: dict[str, Any]) -> None:
    from bench.text_engines import load_engine

    built = build_text_engine(vlm["root"] / "engines", "none", "awq-int4", False, str(vlm["root"] / "source"))
    assert (built / "quant.json").is_file() and all((built / name).is_file() for name in IMAGE_PART)
    engine = load_engine(built, "cpu")
    assert engine.config()["kernel"] != "float"
    eye = VisionLanguage.load(built, engine.device, engine.dtype)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    answers = []
    for seed in (4, 5):
        prompt = eye.prompt(engine.prompter, QUESTION, None, [random_image(40, 40, seed)])
        got = engine.generate(prompt.ids, params, prefix=prompt.prefix, splices=prompt.splices)
        assert len(got.tokens) == NEW_TOKENS
        cache = engine.model.new_cache(1, len(prompt.ids))
        answers.append(engine.model(torch.tensor([prompt.ids]), cache, 0, splices=prompt.splices)[0, -1])
    assert (answers[0] - answers[1]).abs().max().item() > 1e-3  # two images, two readings


@pytest.mark.parametrize("vlm", ["llava"], indirect=True)
def test_edgectl_builds_a_profiles_llava_source(vlm: dict[str, Any], tmp_path: Path) -> None:
    from edge.builds import locate
    from edge.config.loader import load_profile

    qa = {"source": str(vlm["root"] / "source"), "adapter": "none"}
    models = {"ocr": {"enabled": False}, "inspect": {"enabled": False}, "qa": qa}
    profile = write_profile(tmp_path, free_port(), tmp_path / "engines", device_id="v1", models=models)
    built = edgectl("build", "--profile", str(profile), timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    engine = locate(load_profile(profile), "qa", None)
    assert json.loads((engine / "manifest.json").read_text())["recipe"]["method"] == "awq"
    assert all((engine / name).is_file() for name in IMAGE_PART)
    assert VisionLanguage.load(engine).config == VisionLanguage.load(vlm["ckpt"]).config


def _rewrite(source: Path, target: Path, rename: Any, config: Any = None) -> Path:
    """A copy of the directory `source` with its tensors renamed by `rename` and its
    config.json changed by `config`."""
    shutil.copytree(source, target)
    with safe_open(str(source / "model.safetensors"), framework="pt") as fh:
        tensors = {rename(name): fh.get_tensor(name) for name in fh.keys()}
    save_file(tensors, str(target / "model.safetensors"))
    if config is not None:
        doc = json.loads((source / "config.json").read_text())
        config(doc)
        (target / "config.json").write_text(json.dumps(doc))
    return target


def _hub_name(name: str) -> str:
    return name.replace("vision_tower.", "vision_tower.vision_model.")


def _v4_name(name: str) -> str:
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    return "model." + name.replace("language_model.model.", "language_model.")


def _sparse(doc: dict[str, Any]) -> None:
    """As older transformers saved a nested config: only what differs from its class's defaults."""
    dropped = 0
    for section, defaults in (
        ("text_config", TEXT_DEFAULTS["llama"]),
        ("vision_config", VISION_DEFAULTS["clip_vision_model"]),
    ):
        for key, value in defaults.items():
            if doc[section].get(key) == value:
                del doc[section][key]
                dropped += 1
    assert dropped >= 4  # the norms' epsilons, the activations, the head's tying at least


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


@pytest.mark.parametrize("vlm", ["llava"], indirect=True)
def test_the_hubs_layouts_and_sparse_configs_import_alike(vlm: dict[str, Any], tmp_path: Path) -> None:
    source = vlm["root"] / "source"
    hub = _rewrite(source, tmp_path / "hub", _hub_name, _sparse)
    # The Hub's LLaVA directories keep the image processor in preprocessor_config.json.
    processor = json.loads((hub / "processor_config.json").read_text())
    (hub / "preprocessor_config.json").write_text(json.dumps(processor.pop("image_processor")))
    (hub / "processor_config.json").write_text(json.dumps(processor))
    older = _rewrite(source, tmp_path / "v4", _v4_name)
    for directory in (hub, older):
        built = build_text_engine(tmp_path / "engines", "none", "float", False, str(directory))
        for name in ("model.safetensors", IMAGE_PART[1]):
            mine, want = _tensors(built / name), _tensors(vlm["ckpt"] / name)
            assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
        for name in ("config.json", IMAGE_PART[0]):
            assert (built / name).read_text() == (vlm["ckpt"] / name).read_text()


def test_the_defaults_are_transformers_own() -> None:
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "clip_vision_model": transformers.CLIPVisionConfig,
        "siglip_vision_model": transformers.SiglipVisionConfig,
    }
    for kind, defaults in {**TEXT_DEFAULTS, **VISION_DEFAULTS}.items():
        theirs = classes[kind]().to_dict()
        assert {k: theirs[k] for k in defaults} == defaults, kind
    processors = {
        "CLIPImageProcessor": transformers.CLIPImageProcessorPil,
        "LlavaImageProcessor": transformers.LlavaImageProcessorPil,
        "LlavaNextImageProcessor": transformers.LlavaNextImageProcessorPil,
        "SiglipImageProcessor": transformers.SiglipImageProcessorPil,
    }
    for kind, defaults in PROCESSOR_DEFAULTS.items():
        theirs = json.loads(json.dumps(processors[kind]().to_dict()))  # tuples as lists, as a saved file has them
        assert {k: theirs.get(k, False if k == "do_center_crop" else None) for k in defaults} == defaults, kind


def _edited(vlm: dict[str, Any], tmp_path: Path, change: Any) -> Path:
    """The model's directory with its config.json changed by `change` (the weights linked)."""
    source, target = vlm["root"] / "source", tmp_path / "edited"
    target.mkdir(parents=True)
    for path in source.iterdir():
        (target / path.name).symlink_to(path)
    doc = json.loads((source / "config.json").read_text())
    change(doc)
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps(doc))
    return target


@pytest.mark.parametrize("vlm", ["llava"], indirect=True)
@pytest.mark.parametrize(
    ("model_type", "named"),
    [("qwen2_5_vl", "Qwen2.5-VL: its language model turns positions by M-RoPE"), ("idefics3", "SmolVLM / Idefics3")],
)
def test_other_vision_language_models_are_refused_by_name(
    vlm: dict[str, Any], tmp_path: Path, model_type: str, named: str
) -> None:
    edited = _edited(vlm, tmp_path, lambda doc: doc.update(model_type=model_type))
    with pytest.raises(SourceModelError, match=f"model_type '{model_type}' is not supported: {named}"):
        read_source(edited)


REFUSED = {
    "llava": [
        ({"vision_feature_select_strategy": "cls_patch"}, "vision_feature_select_strategy 'cls_patch'"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu'"),
        ({"vision_feature_layer": 5}, "vision_feature_layer 5"),
        ({"text_config": {"model_type": "gemma"}}, "text_config.model_type 'gemma'"),
        ({"vision_config": {"model_type": "dinov2"}}, "vision_config.model_type 'dinov2'"),
    ],
    "llava_next": [
        # SigLIP has no class token: "default" would drop a patch and leave no grid.
        ({"vision_feature_select_strategy": "default"}, "vision_feature_select_strategy 'default' with a siglip"),
        ({"image_grid_pinpoints": [[32, 48]]}, "image_grid_pinpoints: processor_config.json tiles at"),
    ],
}


def test_what_llava_sets_that_we_do_not_serve_is_refused_naming_the_field(vlm: dict[str, Any], tmp_path: Path) -> None:
    for i, (fields, named) in enumerate(REFUSED[vlm["name"]]):
        edited = _edited(vlm, tmp_path / str(i), lambda doc, f=fields: doc.update(f))
        with pytest.raises(SourceModelError, match=named):
            read_source(edited)


def test_an_image_token_in_the_question_is_text(vlm: dict[str, Any]) -> None:
    ours, eye, _ = _ours(vlm["ckpt"], random_image(32, 32, 6))
    prompter = Prompter(ours.tokenizer, ours.chat, SYSTEM)
    prompt = eye.prompt(prompter, "Is <image> the label?", None, [random_image(32, 32, 6)])
    assert prompt.ids.count(eye.config.image_token_id) == prompt.image_tokens  # the question's is text
    with pytest.raises(ValueError, match=r"2 image tokens \(id \d+\) for 1 images"):
        eye.splice(prompter.ids(QUESTION, None, images=2), [random_image(32, 32, 6)])
    with pytest.raises(ValueError, match="needs the model's own chat template"):
        Prompter(ours.tokenizer, None, SYSTEM).ids(QUESTION, None, images=1)


@pytest.mark.parametrize("vlm", ["llava"], indirect=True)
def test_the_prefix_cache_keeps_no_prefix_past_an_image(vlm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ours = load_checkpoint(vlm["ckpt"])
    batcher = ContinuousBatcher(ours.model, ours.tokenizer, ours.eos_ids, slots=1, slot_len=64)
    batcher.prefix_cache = PrefixCache(1 << 20)
    monkeypatch.setattr(batcher.prefix_cache, "should_split", lambda prefix, rest: True)
    ids = list(range(40))
    rows = Splice(20, torch.zeros(4, ours.model.config.hidden_size))
    for prefix, splices, split in ((16, (rows,), 16), (20, (rows,), 20), (24, (rows,), None), (24, (), 24)):
        seq = Sequence(None, ids, SamplingParams())
        seq.prefix, seq.splices = prefix, splices
        assert batcher._split_at(seq, ids) == split

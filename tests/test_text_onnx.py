"""The text model's ONNX export (engines/text/text_onnx.py) against our own runtime, on
onnxruntime's CPU provider, with the real SmolLM2 weights as served (AWQ INT4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edge.artifacts import find
from edge.builds import selector
from edge.config.profile import Profile
from edge.text.model.checkpoint import load_checkpoint
from edge.text.prompt import chatml
from engines.text.quantize import QuantRecipe
from engines.text.text_build import SERVING_GROUP, quantize_checkpoint
from engines.text.text_onnx import ONNX_FILE, export_checkpoint, past_names, present_names

STEPS = 32


def served_checkpoint(engine_dir: Path) -> Path:
    found = find(
        engine_dir,
        **selector("qa", Profile.model_validate({"device_id": "t", "paths": {"engine_dir": str(engine_dir)}})),
    )
    assert found is not None
    return found.path


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    # The DequantizeLinear + MatMul fusion's default accuracy level rounds activations to
    # int8 (a 0.5% error on its own): float32 products, as our runtime computes.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def empty_past(config: dict[str, int], dtype: type = np.float32) -> dict[str, np.ndarray]:
    shape = (1, config["num_kv_heads"], 0, config["head_dim"])
    return {name: np.zeros(shape, dtype) for i in range(config["num_layers"]) for name in past_names(i)}


def test_the_exported_model_is_our_runtime_on_onnxruntime(engine_dir: Path) -> None:
    """Logits within float32 rounding of ours at every prompt position and every step,
    and the same 32 greedy tokens, feeding each step's presents back as pasts."""
    ckpt_dir = served_checkpoint(engine_dir)
    export = export_checkpoint(ckpt_dir, "float32")
    assert export_checkpoint(ckpt_dir, "float32") == export  # cached
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["opset"] == 21 and manifest["precisions"] == {"int4-asym": 211}  # 30 layers x 7 + lm_head
    graph = onnx.load(str(export / ONNX_FILE), load_external_data=False).graph
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 211
    assert all({a.name: a.i for a in n.attribute}["block_size"] == SERVING_GROUP for n in dq)
    inits = {t.name: t for t in graph.initializer}
    assert inits["layers.0.self_attn.q_proj.qweight"].data_type == onnx.TensorProto.UINT4

    ours = load_checkpoint(ckpt_dir)  # the CPU's float32 INT4 kernel: the quantized model exactly
    assert ours.int4_kernel == "cpu-f32"
    model = ours.model
    prompt = chatml("You are a careful assistant in a clinic.", "What is the normal resting heart rate for adults?")
    ids = ours.tokenizer.encode(prompt, add_special_tokens=False).ids
    sess = session(export / ONNX_FILE)
    names = [o.name for o in sess.get_outputs()]
    outs = sess.run(None, {"input_ids": np.array([ids], np.int64), **empty_past(manifest)})
    cache = model.new_cache(1, len(ids) + STEPS + 1)
    ref = model(torch.tensor([ids]), cache, 0, last_only=False)[0].numpy()
    assert outs[0].shape == (1, len(ids), manifest["vocab_size"])
    assert float(np.abs(outs[0][0] - ref).max()) < 2e-3  # logits of size ~30
    assert outs[names.index(present_names(29)[0])].shape == (1, 3, len(ids), 64)

    theirs_tokens, our_tokens, worst = [], [], 0.0
    theirs, mine = outs[0][0, -1], ref[-1]
    for step in range(STEPS):
        t_tok, o_tok = int(theirs.argmax()), int(mine.argmax())
        theirs_tokens.append(t_tok)
        our_tokens.append(o_tok)
        feed: dict[str, np.ndarray] = {"input_ids": np.array([[t_tok]], np.int64)}
        for i in range(manifest["num_layers"]):
            for past, present in zip(past_names(i), present_names(i), strict=True):
                feed[past] = outs[names.index(present)]
        outs = sess.run(None, feed)
        theirs = outs[0][0, -1]
        mine = model(torch.tensor([[o_tok]]), cache, len(ids) + step)[0, -1].numpy()
        worst = max(worst, float(np.abs(theirs - mine).max()))
    assert theirs_tokens == our_tokens
    assert worst < 2e-3
    assert len(set(our_tokens)) > 5  # a real answer, not one token repeated


def test_a_symmetric_checkpoint_exports_signed_codes_and_matches(engine_dir: Path) -> None:
    """Zero points fixed at 8 become signed INT4 codes without a zero point (the form
    TensorRT takes), the same weights exactly; float16 exports keep the interface."""
    from engines.text.import_gguf import import_smollm2

    base = import_smollm2(engine_dir, progress=False)
    sym = quantize_checkpoint(base, QuantRecipe(method="rtn", group_size=SERVING_GROUP, symmetric=True), progress=False)
    export = export_checkpoint(sym, "float32")
    graph = onnx.load(str(export / ONNX_FILE)).graph
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(len(n.input) == 2 for n in dq)  # no zero point
    inits = {t.name: t for t in graph.initializer}
    assert {inits[n.input[0]].data_type for n in dq} == {onnx.TensorProto.INT4}
    ours = load_checkpoint(sym)
    ids = ours.tokenizer.encode("Wash your hands before and after every patient contact.").ids
    ref = ours.model(torch.tensor([ids]), ours.model.new_cache(1, 64), 0, last_only=False)[0].numpy()
    config = json.loads((export / "manifest.json").read_text())
    got = session(export / ONNX_FILE).run(["logits"], {"input_ids": np.array([ids], np.int64), **empty_past(config)})
    assert float(np.abs(got[0][0] - ref).max()) < 2e-3
    assert (got[0][0].argmax(-1) == ref.argmax(-1)).all()

    half = export_checkpoint(sym, "float16")
    g16 = onnx.load(str(half / ONNX_FILE), load_external_data=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g16.input, *g16.output]}
    assert types["logits"] == onnx.TensorProto.FLOAT and types[past_names(0)[0]] == onnx.TensorProto.FLOAT16


def test_a_float_checkpoint_exports_float_products(engine_dir: Path) -> None:
    from engines.text.import_gguf import import_smollm2
    from engines.text.text_onnx import export_text_onnx

    base = import_smollm2(engine_dir, progress=False)
    out = engine_dir / ".float-export-test"
    out.mkdir(exist_ok=True)
    try:
        details = export_text_onnx(base, out, "float16")
        assert details["precisions"] == {"float16": 211} and details["symmetric"]
        with pytest.raises(ValueError, match="dtype 'int8'"):
            export_text_onnx(base, out, "int8")
    finally:
        shutil.rmtree(out)


def test_the_export_refuses_weights_in_two_halves_by_name(engine_dir: Path, tmp_path: Path) -> None:
    """A build whose linears include a GGUF Q8_0 weight kept as two INT4 halves (quant.json
    says which) is refused by the export, naming the first such linear."""
    from engines.text.import_gguf import import_smollm2
    from engines.text.text_onnx import ExportError

    base = import_smollm2(engine_dir, progress=False)
    built = quantize_checkpoint(base, QuantRecipe(method="rtn", group_size=SERVING_GROUP), progress=False)
    halves = tmp_path / "halves"
    halves.mkdir()
    for f in built.iterdir():
        if f.name != "quant.json":
            (halves / f.name).symlink_to(f)
    quant = json.loads((built / "quant.json").read_text())
    first = next(n for n in quant["linears"] if n.startswith("layers."))
    quant["linears"][first]["halves"] = True
    (halves / "quant.json").write_text(json.dumps(quant))
    with pytest.raises(ExportError, match=f"two INT4 halves.*{first}"):
        export_checkpoint(halves, "float32")

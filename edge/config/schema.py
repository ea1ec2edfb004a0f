"""The daemon's profile: one typed schema for everything `edgectl serve` needs.

Every model forbids unknown keys so that a typo in a profile fails at start with the
field's path instead of being silently ignored.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from edge.backends.configs import BACKEND_DEVICES, BackendConfig, OnnxRuntimeConfig, TensorRTConfig, backend_section
from edge.schema_base import StrictModel

# The prompt the clinic adapter was trained with; kept here as the default so they agree.
DEFAULT_SYSTEM_PROMPT = (
    "You are a careful assistant in a clinic. Answer briefly and factually. When context is given, answer from it."
)

_TOPIC_SEGMENT = re.compile(r"^[A-Za-z0-9_.-]+$")


Device = Literal["cpu", "cuda"]


def _fill_backend(data: Any) -> Any:
    """`backend: NAME` is short for `backend: {type: NAME}`; no backend at all means the
    default for the model's device."""
    if isinstance(data, dict):
        data = dict(data)
        data["backend"] = backend_section(data.get("backend"), str(data.get("device", "cpu")))
    return data


def _backend_on_device(backend: str, device: str) -> None:
    if device not in BACKEND_DEVICES.get(backend, (device,)):
        raise ValueError(f"backend {backend!r} does not run on device {device!r}")


class TLSConfig(StrictModel):
    ca_file: Path | None = Field(
        default=None,
        title="CA certificate",
        description="PEM file with the CA that signed the broker's certificate; the system store is used when unset.",
    )
    cert_file: Path | None = Field(
        default=None,
        title="Client certificate",
        description="PEM client certificate for brokers that require mutual TLS.",
    )
    key_file: Path | None = Field(
        default=None,
        title="Client key",
        description="PEM private key matching cert_file.",
    )
    insecure: bool = Field(
        default=False,
        title="Skip hostname check",
        description="Do not verify the broker's hostname against its certificate. "
        "Only for lab setups with IP-addressed brokers.",
    )

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        return self


class BrokerConfig(StrictModel):
    host: str = Field(default="127.0.0.1", title="Broker host", description="MQTT broker host name or address.")
    port: int = Field(default=1883, ge=1, le=65535, title="Broker port", description="MQTT broker TCP port.")
    client_id: str | None = Field(
        default=None,
        title="Client id",
        description="MQTT client identifier; defaults to 'edge-<device_id>'.",
    )
    keepalive_s: int = Field(
        default=30,
        ge=5,
        le=3600,
        title="Keepalive",
        description="Seconds between MQTT keepalive pings.",
    )
    username: str | None = Field(
        default=None, title="Username", description="MQTT username, if the broker asks for one."
    )
    password: str | None = Field(
        default=None,
        title="Password",
        description="MQTT password. Prefer password_file so the secret stays out of the profile; never logged.",
    )
    password_file: Path | None = Field(
        default=None,
        title="Password file",
        description="File whose first line is the MQTT password (e.g. a systemd credential).",
    )
    tls: TLSConfig | None = Field(
        default=None, title="TLS", description="Enable TLS to the broker with these settings."
    )
    session_expiry_s: int = Field(
        default=86400,
        ge=0,
        le=4294967295,
        title="Session expiry",
        description="How long the broker keeps this daemon's session (its subscriptions and the jobs that "
        "arrive for it) after a disconnect, in seconds. The broker must also persist sessions across its own "
        "restarts (Mosquitto: `persistence true`).",
    )
    reconnect_min_s: float = Field(
        default=0.5,
        gt=0,
        title="Reconnect backoff start",
        description="First delay before reconnecting after the broker goes away.",
    )
    reconnect_max_s: float = Field(
        default=30.0,
        gt=0,
        title="Reconnect backoff cap",
        description="Longest delay between reconnect attempts (exponential backoff).",
    )

    @model_validator(mode="after")
    def _one_password_source(self) -> BrokerConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("give either password or password_file, not both")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        return self


class TopicsConfig(StrictModel):
    prefix: str = Field(
        default="edge",
        title="Topic prefix",
        description="First topic level; jobs arrive on <prefix>/<device_id>/jobs/<task>.",
    )
    shared_group: str | None = Field(
        default=None,
        title="Shared subscription group",
        description="When set, also subscribe to $share/<group>/<prefix>/jobs/+ so that "
        "several boxes split one job stream through the broker.",
    )

    @field_validator("prefix", "shared_group")
    @classmethod
    def _plain_segment(cls, value: str | None) -> str | None:
        if value is not None and not _TOPIC_SEGMENT.match(value):
            raise ValueError("must be one topic level of letters, digits, '_', '.', '-'")
        return value


class OCRModelConfig(StrictModel):
    enabled: bool = Field(default=True, title="Enabled", description="Serve the `ocr` task.")
    keep_alive_s: float | None = Field(
        default=None,
        ge=0.0,
        title="Keep-alive",
        description="Seconds the OCR model stays loaded after its last use before it may be evicted to make "
        "room for another job; unset keeps it loaded for good. An evicted model is loaded again (and measured "
        "again) when a job needs it.",
    )
    device: Device = Field(
        default="cpu",
        title="Device",
        description="Where the OCR models run: 'cpu' (onnxruntime's CPU build), or 'cuda' with the tensorrt "
        "backend (FP16 plans built on the box).",
    )
    backend: Annotated[OnnxRuntimeConfig | TensorRTConfig, Field(discriminator="type")] = Field(
        default_factory=OnnxRuntimeConfig,
        title="Backend",
        description="Inference backend for the detection, angle and recognition models, with its own settings "
        "(`onnxruntime`, `tensorrt`, or `{type: NAME, ...}`); for device 'cuda' it is tensorrt.",
    )
    det_limit_side_len: int = Field(
        default=960,
        ge=32,
        le=4096,
        title="Detection size limit",
        description="Longest image side fed to the detector; larger images are scaled "
        "down (never up, which costs time for no gain on labels).",
    )
    use_angle_cls: bool = Field(
        default=True,
        title="Angle classifier",
        description="Run the 0/180 degree text-line classifier before recognition.",
    )
    text_score: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        title="Minimum line score",
        description="Recognised lines below this mean character confidence are dropped.",
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=64,
        title="Threads",
        description="Intra-op threads per model; 0 lets the backend choose.",
    )

    @model_validator(mode="before")
    @classmethod
    def _backend_form(cls, data: Any) -> Any:
        # The OCR models have no PyTorch weights: on CUDA they run as TensorRT plans.
        if isinstance(data, dict) and data.get("device") == "cuda" and data.get("backend") is None:
            data = {**data, "backend": "tensorrt"}
        return _fill_backend(data)

    @model_validator(mode="after")
    def _backend_runs_here(self) -> OCRModelConfig:
        _backend_on_device(self.backend.type, self.device)
        if self.backend.type == "tensorrt" and self.backend.precision != "fp16":
            raise ValueError("the OCR models are built as fp16 plans only (backend.precision)")
        return self


class InspectModelConfig(StrictModel):
    enabled: bool = Field(default=True, title="Enabled", description="Serve the `inspect` task.")
    keep_alive_s: float | None = Field(
        default=None,
        ge=0.0,
        title="Keep-alive",
        description="Seconds the inspection model stays loaded after its last use before it may be evicted to make "
        "room for another job; unset keeps it loaded for good. An evicted model is loaded again (and measured "
        "again) when a job needs it.",
    )
    device: Device = Field(
        default="cpu",
        title="Device",
        description="Where the student runs: 'cpu', or 'cuda' (its FP16 weights on the GPU, images resized "
        "and normalised there).",
    )
    backend: BackendConfig = Field(
        default_factory=OnnxRuntimeConfig,
        title="Backend",
        description="The backend and its own settings: onnxruntime runs the student's ONNX export (the CPU "
        "default); torch-cuda runs its weights on a CUDA GPU (the default for device 'cuda'), by default "
        "in FP16 with one CUDA graph per batch size; tensorrt runs its FP16 or INT8 plan built on the box. "
        "`backend: NAME` is short for `{type: NAME}`.",
    )
    engine: Path | None = Field(
        default=None,
        title="Engine directory",
        description="A student build to serve as it is (its manifest says what it is), instead of the one "
        "built for build_size in paths.engine_dir.",
    )
    dataset: str = Field(
        default="synthetic",
        title="Training images",
        description="What the student is distilled on when it is built: 'synthetic' (the built-in factory "
        "parts), or a path to a folder of labelled images, one sub-folder per class (one named 'clean'), PNG "
        "or JPEG, each defect image optionally with its mask beside it as <name>.mask.png; split by file "
        "name into train, validation and test.",
    )
    build_size: Literal["default", "quick", "stream", "stream-long"] = Field(
        default="stream",
        title="Build size",
        description="Training set the student is distilled on when it is built: 'stream' (256,000 "
        "freshly generated images with the teacher on the GPU: the accurate one; it ships trained, "
        "so a first start installs it in under a minute wherever it runs), 'default' (600 images, "
        "about ten minutes on two cores, much less accurate), 'stream-long' (768,000 generated "
        "images: a little more accurate again; built on a CUDA machine, on the CPU it would take "
        "hours; a build directory copied from another machine is found by its inputs) or 'quick' "
        "(a smoke-sized build for tests). With a dataset, 'default' or 'quick' give the training length.",
    )
    max_batch: int = Field(
        default=8,
        ge=1,
        le=64,
        title="Maximum batch",
        description="Most inspect jobs run through the model at once.",
    )
    preferred_batch_sizes: list[Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=list,
        max_length=8,
        title="Preferred batch sizes",
        description="Batch sizes worth dispatching at once when reached, without waiting out the queue delay.",
    )
    max_queue_delay_ms: float = Field(
        default=5.0,
        ge=0.0,
        le=1000.0,
        title="Maximum queue delay",
        description="How long the first job of a batch may wait for others to join it.",
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=64,
        title="Threads",
        description="Intra-op threads for the student on onnxruntime; 0 lets the backend choose.",
    )
    decode_threads: int = Field(
        default=4,
        ge=1,
        le=32,
        title="Decode threads",
        description="Threads that decode a batch's images at once (decoding runs outside the interpreter "
        "lock, so they work in parallel with each other and with the text branch).",
    )

    _backend_form = model_validator(mode="before")(_fill_backend)

    @model_validator(mode="before")
    @classmethod
    def _size_for_a_dataset(cls, data: Any) -> Any:
        # The shipped 'stream' student is the default for the built-in parts; a user's
        # own images are distilled at the 'default' length unless a size is given.
        if isinstance(data, dict) and data.get("dataset", "synthetic") != "synthetic" and "build_size" not in data:
            return {**data, "build_size": "default"}
        return data

    @field_validator("dataset")
    @classmethod
    def _dataset_exists(cls, value: str) -> str:
        if value == "synthetic":
            return value
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ValueError(f"{value!r} is neither 'synthetic' nor a folder of labelled images")
        if not (path / "clean").is_dir():
            raise ValueError(f"{value!r} has no 'clean' class folder")
        return str(path.resolve())

    @model_validator(mode="after")
    def _preferred_within_max(self) -> InspectModelConfig:
        too_big = [b for b in self.preferred_batch_sizes if b > self.max_batch]
        if too_big:
            raise ValueError(f"preferred_batch_sizes {too_big} exceed max_batch {self.max_batch}")
        _backend_on_device(self.backend.type, self.device)
        return self


BUILTIN_TEXT_SOURCE = "smollm2-135m-instruct"


class LayerRule(StrictModel):
    match: str = Field(
        min_length=1,
        title="Layers",
        description="Module-name pattern (fnmatch) of the layers this rule is for, e.g. '*.self_attn.*', "
        "'*.mlp.down_proj', 'lm_head'. The first matching rule wins.",
    )
    format: Literal["float", "int4"] = Field(
        title="Format",
        description="'float' keeps these layers in floating point (fp16 in the checkpoint); 'int4' quantizes "
        "them with their own group size.",
    )
    group_size: Literal[32, 64, 128, 256] | None = Field(
        default=None,
        title="Group size",
        description="INT4 group size for these layers (format 'int4'); the build's own otherwise.",
    )

    @model_validator(mode="after")
    def _group_for_int4(self) -> LayerRule:
        if self.format == "float" and self.group_size is not None:
            raise ValueError("group_size applies to format 'int4' only")
        return self

    def to_selector(self) -> dict[str, Any]:
        return {"match": self.match, "format": self.format, "group_size": self.group_size}


class QAModelConfig(StrictModel):
    enabled: bool = Field(default=True, title="Enabled", description="Serve the `qa` task.")
    source: str = Field(
        default=BUILTIN_TEXT_SOURCE,
        title="Source model",
        description="The base model, imported into the engine directory on first use: the built-in "
        f"'{BUILTIN_TEXT_SOURCE}', or a path to a Hugging Face model directory (config.json, *.safetensors, "
        "tokenizer.json, tokenizer_config.json with its chat template) of the Llama family (Llama 2/3.x, "
        "SmolLM, TinyLlama, Mistral without a sliding window) or the Qwen2 family.",
    )
    adapter: str = Field(
        default="clinic",
        title="Merged adapter",
        description="Merged into the base before quantization: 'clinic' (the built-in QLoRA adapter for the "
        "built-in model: cite the given documents, decline to diagnose), 'none', or a path to a PEFT LoRA "
        "adapter directory (adapter_config.json, adapter_model.safetensors) trained for the source model.",
    )
    quantization: Literal["awq-int4", "rtn-int4", "awq-int4-sym", "rtn-int4-sym", "float"] = Field(
        default="awq-int4",
        title="Weight format",
        description="How the served weights are stored: AWQ INT4, round-to-nearest INT4, or float. The '-sym' "
        "forms fix every zero point at 8 (signed 4-bit codes times a scale): the only INT4 form TensorRT "
        "takes, so a text model built into a TensorRT plan needs one of them.",
    )
    layers: list[LayerRule] = Field(
        default_factory=list,
        title="Mixed precision",
        description="Per-layer overrides of the INT4 recipe, e.g. attention projections in float and the "
        "FFN at INT4 g128: [{match: '*.self_attn.*', format: float}]. Empty: every projection INT4 at the "
        "build's group size.",
    )
    engine: Path | None = Field(
        default=None,
        title="Engine directory",
        description="A text checkpoint to serve as it is (its manifest says what it is), instead of the one "
        "built for source, adapter and quantization in paths.engine_dir.",
    )
    device: Device = Field(
        default="cpu",
        title="Device",
        description="Where the text model runs: 'cpu', or 'cuda' (our INT4 tensor-core GEMV, built with nvcc "
        "at first start, or the Triton one where nvcc is absent; the fused decode step, decode steps "
        "captured as CUDA graphs, tokens chosen on the GPU).",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto",
        title="Activation type",
        description="Activations and float weights: 'auto' is float32 on the CPU and float16 on CUDA.",
    )
    cpu_kernel: Literal["exact", "bf16"] = Field(
        default="exact",
        title="CPU INT4 kernel",
        description="On the CPU: 'exact' (ours, built on the box: the quantized model in float32, so answers "
        "are the model's own on every CPU and match the GPU's; slower, mostly in prefill) or "
        "'bf16' (torch's tiled kernel: faster prefill, every product rounded to bfloat16, so about one "
        "greedy answer in ten strays from the model's). 'exact' falls back to 'bf16' without a C compiler.",
    )
    embedding: Literal["auto", "float", "int8", "int4"] = Field(
        default="auto",
        title="Token table",
        description="How the token embedding table is held: 'int8' (8-bit codes, a scale per 64 values: half "
        "the memory of a 16-bit table, rounding below the activations' own), 'int4' (a scale per 32 values: "
        "0.28x, the size of llama.cpp's Q4_0 table, a small measured quality cost), or 'float'. 'auto' is "
        "int8 on CUDA and float on the CPU. A table that is also a float output projection stays float.",
    )
    cuda_graphs: bool = Field(
        default=True,
        title="CUDA graphs",
        description="On CUDA, capture the decode step at load for every batch-size and KV-length bucket.",
    )
    max_context_tokens: int = Field(
        default=2048,
        ge=64,
        le=8192,
        title="Context window",
        description="Prompt plus generated tokens allowed per job; sizes the KV cache.",
    )
    max_sequences: int = Field(
        default=2,
        ge=1,
        le=64,
        title="Concurrent sequences",
        description="Sequences decoded together (continuous batching). The KV cache holds this many "
        "sequences of max_context_tokens, allocated once at load: max_sequences x max_context_tokens is the "
        "KV budget in tokens.",
    )
    kv_dtype: Literal["float16", "int8", "int4"] = Field(
        default="float16",
        title="KV cache format",
        description="How the KV cache holds keys and values: 'float16' (unquantized, in the activations' "
        "type: float32 on the CPU), 'int8' (8-bit codes, key scales per channel per 64-token block, value "
        "scales per token: about half the bytes per token, quality measured unchanged) or 'int4' (4-bit "
        "codes, key scales and zero points per channel per 64-token block, one value scale per token and 64 "
        "channels, the newest 32 tokens kept float: under a third of the bytes; README, KV cache, for the "
        "measured quality). The attention kernels read the codes (our C kernel on the CPU, Triton on CUDA). "
        "The cache is still max_sequences x max_context_tokens, in fewer bytes, and the ledger counts what "
        "it takes.",
    )
    kv_offload: Literal["off", "memory", "disk"] = Field(
        default="memory",
        title="KV offload of paused sequences",
        description="Where the KV row of a sequence paused for a more urgent job goes: 'memory' (host "
        "memory; on a Jetson the same DRAM as the GPU's, so it frees the row, not the DRAM), 'disk' (a file "
        "under paths.state_dir/kv-offload, lz4-coded where that pays) or 'off' (dropped). On resume the row "
        "is restored, or the sequence prefilled again where the measured prefill rate says that is faster. "
        "Offloaded rows do not survive a restart of the daemon: the directory is emptied at start, and a "
        "job that was paused is prefilled again from its journal entry.",
    )
    prefix_cache_mib: int = Field(
        default=64,
        ge=0,
        le=65536,
        title="Prefix cache",
        description="Memory (MiB, on the model's device) for prefilled prompt prefixes: the system prompt "
        "and a job's context documents, prefilled once and reused by later jobs whose prompts start with "
        "the same tokens, so they prefill only their question. Least recently used entries go first; each "
        "entry's bytes are reserved in the memory ledger. 0: off.",
    )
    kv_offload_mib: int = Field(
        default=256,
        ge=0,
        le=65536,
        title="KV offload host memory",
        description="Most host memory (MiB) offloaded rows hold at once (with 'disk', until each is "
        "written); a row beyond it is dropped and prefilled again on resume.",
    )
    prefill_chunk: int = Field(
        default=256,
        ge=0,
        le=8192,
        title="Prefill chunk",
        description="A prompt longer than this that arrives while other sequences decode is prefilled this "
        "many tokens at a time, one chunk between two of their decode steps, so they wait one chunk's time "
        "between tokens rather than the whole prompt's. 0: every prompt at once. A sequence alone is "
        "prefilled at once.",
    )
    max_new_tokens: int = Field(
        default=128,
        ge=1,
        le=2048,
        title="Default new tokens",
        description="Tokens generated when a job does not say.",
    )
    max_new_tokens_limit: int = Field(
        default=512,
        ge=1,
        le=4096,
        title="New tokens cap",
        description="Largest max_new_tokens a job may ask for.",
    )
    system_prompt: str = Field(
        default=DEFAULT_SYSTEM_PROMPT,
        title="System prompt",
        description="System message put before every question.",
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=64,
        title="Threads",
        description="torch intra-op threads for the text branch; 0 keeps torch's default.",
    )
    collection: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        title="Default collection",
        description="The document collection (`edgectl docs add --collection NAME`) a job without its own "
        "`collection` retrieves from. None: such jobs retrieve nothing.",
    )
    top_k: int = Field(
        default=1,
        ge=1,
        le=16,
        title="Passages retrieved",
        description="Passages a retrieving job puts into its prompt when it does not say (`top_k`). 1 for the "
        "shipped model: SmolLM2-135M with the clinic adapter answers most accurately from one passage "
        "(bench/eval_rag.py measures each; a larger model of your own may do better with more).",
    )
    embed_backend: Literal["onnxruntime", "torch-cuda"] = Field(
        default="onnxruntime",
        title="Retrieval encoder backend",
        description="Where the retrieval encoder (all-MiniLM-L6-v2) runs: onnxruntime on the CPU (about 3 ms "
        "a question), or torch-cuda on a CUDA GPU (float16, each batch as it comes). The tensorrt backend "
        "takes one image input and does not serve the encoder's two token inputs. Its memory is counted in "
        "the ledger like every model's.",
    )
    embed_threads: int = Field(
        default=2,
        ge=0,
        le=64,
        title="Retrieval encoder threads",
        description="Threads for embedding questions and searching the index; 0: the runtime's default.",
    )

    @field_validator("source")
    @classmethod
    def _source_exists(cls, value: str) -> str:
        if value == BUILTIN_TEXT_SOURCE:
            return value
        path = Path(value).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return str(path.resolve())
        if not path.is_dir():
            raise ValueError(
                f"{value!r} is neither the built-in {BUILTIN_TEXT_SOURCE!r}, a model directory nor a .gguf file"
            )
        if not (path / "config.json").is_file():
            raise ValueError(f"{value!r} has no config.json: not a Hugging Face model directory")
        return str(path.resolve())

    @model_validator(mode="after")
    def _layers_need_int4(self) -> QAModelConfig:
        if self.layers and self.quantization == "float":
            raise ValueError("layers are per-layer overrides of INT4 quantization; quantization is 'float'")
        return self

    @field_validator("adapter")
    @classmethod
    def _adapter_exists(cls, value: str) -> str:
        if value in ("clinic", "none"):
            return value
        path = Path(value).expanduser()
        if not (path / "adapter_config.json").is_file():
            raise ValueError(
                f"{value!r} is neither 'clinic', 'none' nor a PEFT adapter directory (no adapter_config.json)"
            )
        return str(path.resolve())

    @model_validator(mode="after")
    def _clinic_needs_its_base(self) -> QAModelConfig:
        if self.adapter == "clinic" and self.source != BUILTIN_TEXT_SOURCE and self.engine is None:
            raise ValueError(
                f"adapter 'clinic' was trained for {BUILTIN_TEXT_SOURCE}; with another source use adapter 'none'"
            )
        return self


class ModelsConfig(StrictModel):
    ocr: OCRModelConfig = Field(
        default_factory=OCRModelConfig,
        title="OCR models",
        description="Vision branch: PP-OCR detection, angle and recognition models.",
    )
    inspect: InspectModelConfig = Field(
        default_factory=InspectModelConfig,
        title="Inspection model",
        description="Vision branch: the distilled ViT student that classifies defects.",
    )
    qa: QAModelConfig = Field(
        default_factory=QAModelConfig,
        title="Q&A model",
        description="Text branch: the instruction-tuned LLM that answers questions.",
    )

    def uses_cuda(self) -> bool:
        """Whether an enabled model holds GPU memory: the ViT or the LLM on CUDA, or the
        retrieval encoder on torch-cuda (which it may be where the LLM runs on the CPU)."""
        qa = self.qa
        return (self.inspect.enabled and self.inspect.device == "cuda") or (
            qa.enabled and (qa.device == "cuda" or qa.embed_backend == "torch-cuda")
        )


class LimitsConfig(StrictModel):
    max_payload_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        title="Maximum payload",
        description="Larger MQTT job payloads are answered with an error without parsing.",
    )
    max_image_bytes: int = Field(
        default=6 * 1024 * 1024,
        ge=1024,
        title="Maximum image bytes",
        description="Largest encoded image accepted (after base64 decoding or on disk).",
    )
    max_image_pixels: int = Field(
        default=25_000_000,
        ge=1024,
        title="Maximum image pixels",
        description="Largest width*height decoded; guards against decompression bombs.",
    )
    max_prompt_chars: int = Field(
        default=8000,
        ge=16,
        title="Maximum prompt characters",
        description="Question plus context longer than this is rejected before tokenizing.",
    )


class QueueConfig(StrictModel):
    max_size: int = Field(
        default=256,
        ge=1,
        title="Queue size per branch",
        description="Jobs waiting per branch beyond this are answered `busy`.",
    )
    default_deadline_ms: int | None = Field(
        default=None,
        ge=1,
        title="Default deadline",
        description="Deadline for jobs that carry none; unset means no deadline.",
    )
    memory_wait_ms: int = Field(
        default=100,
        ge=0,
        title="Memory wait",
        description="How long a text job that does not fit the KV budget waits before a running sequence of "
        "lower priority is paused for it. It answers `over_budget` if its deadline passes while it waits.",
    )
    drain_timeout_s: float = Field(
        default=10.0,
        ge=0.0,
        le=3600.0,
        title="Drain timeout",
        description="On SIGTERM, how long each branch may take to finish the job in hand before the daemon "
        "stops anyway (keep it below systemd's TimeoutStopSec).",
    )


class JournalConfig(StrictModel):
    dedup_window_s: float = Field(
        default=86400.0,
        gt=0.0,
        title="Dedup window",
        description="A job id seen again within this many seconds is answered from the journal instead of "
        "running again; answered jobs older than this are compacted away.",
    )
    max_mib: int = Field(
        default=256,
        ge=1,
        title="Journal size limit",
        description="Largest size of the journal file, in MiB. When it (or the disk) is full, new jobs are "
        "refused with `storage_full` instead of being accepted unkept.",
    )
    max_replays: int = Field(
        default=3,
        ge=1,
        title="Replays per job",
        description="Starts of the daemon that may take up one unfinished job again. A job still unfinished "
        "after this many (one that brings the daemon down, say) is answered `internal` instead.",
    )
    compact_interval_s: float = Field(
        default=60.0,
        gt=0.0,
        title="Compaction interval",
        description="How often answered jobs past the dedup window are removed from the journal.",
    )


class PathsConfig(StrictModel):
    state_dir: Path = Field(
        default=Path("/var/lib/edged"),
        title="State directory",
        description="Persistent state (journal). systemd's StateDirectory= in production.",
    )
    runtime_dir: Path = Field(
        default=Path("/run/edged"),
        title="Runtime directory",
        description="Holds the status socket. systemd's RuntimeDirectory= in production.",
    )
    engine_dir: Path = Field(
        default=Path("/var/lib/edged/engines"),
        title="Engine directory",
        description="Built engines and converted checkpoints, keyed by their inputs.",
    )
    media_dir: Path | None = Field(
        default=None,
        title="Media directory",
        description="Jobs may name images by path inside this directory; unset disables "
        "paths entirely. Paths that resolve outside it (.., symlinks) are refused.",
    )


class StatusConfig(StrictModel):
    socket_mode: int = Field(
        default=0o660,
        ge=0,
        le=0o777,
        title="Socket mode",
        description="Permission bits of the status socket.",
    )
    socket_group: str | None = Field(
        default=None,
        title="Socket group",
        description="Group that owns the status socket, so monitoring users can read it.",
    )


class MetricsConfig(StrictModel):
    listen: str | None = Field(
        default="127.0.0.1:9464",
        title="Metrics listener",
        description="host:port of the Prometheus metrics endpoint (GET /metrics), or null for none. Loopback by "
        "default: the figures name the box's models and jobs, so expose them wider only on purpose.",
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port, e.g. 127.0.0.1:9464")
        return value

    @property
    def address(self) -> tuple[str, int] | None:
        if self.listen is None:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


class TracingConfig(StrictModel):
    otlp_endpoint: str | None = Field(
        default=None,
        title="OTLP endpoint",
        description="Where job spans go over OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces (needs the "
        "opentelemetry-exporter-otlp-proto-http package); unset: no export, though a requester's traceparent is "
        "still continued and echoed on the result.",
    )


class WatchdogConfig(StrictModel):
    stall_s: float = Field(
        default=300.0,
        gt=0.0,
        le=86400.0,
        title="Stall limit",
        description="A branch worker busy with one job (or one batch) for longer than this, or a worker "
        "thread that died, counts as hung: the daemon stops sending WATCHDOG=1 so that systemd restarts it.",
    )


class Profile(StrictModel):
    device_id: str = Field(
        title="Device id",
        description="This box's name; the second topic level and the status identity.",
    )
    memory_budget_mib: int = Field(
        default=8192,
        ge=256,
        title="Memory budget",
        description="Memory the daemon may use for models and jobs, in MiB.",
    )
    memory_headroom_mib: int = Field(
        default=256,
        ge=0,
        title="Memory headroom",
        description="Part of the budget the ledger never hands out (allocator slack, the runtime itself), in MiB.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", title="Log level", description="Daemon log verbosity."
    )
    log_format: Literal["auto", "text", "json", "journal"] = Field(
        default="auto",
        title="Log format",
        description="auto: journald entries with job fields (JOB_ID, TASK, ERROR_CODE, MODEL) under systemd, "
        "plain lines elsewhere; text: plain lines; json: one JSON object per line on stderr; journal: journald.",
    )
    build_missing_engines: bool = Field(
        default=True,
        title="Build missing engines",
        description="Convert or build an engine at start when it is not in engine_dir yet.",
    )
    broker: BrokerConfig = Field(default_factory=BrokerConfig, title="Broker", description="MQTT v5 broker connection.")
    topics: TopicsConfig = Field(default_factory=TopicsConfig, title="Topics", description="Topic layout.")
    models: ModelsConfig = Field(default_factory=ModelsConfig, title="Models", description="Models per branch.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, title="Limits", description="Input size limits.")
    queue: QueueConfig = Field(default_factory=QueueConfig, title="Queues", description="Queue limits per branch.")
    journal: JournalConfig = Field(
        default_factory=JournalConfig,
        title="Journal",
        description="The on-disk job journal in state_dir: dedup window, size bound, replays.",
    )
    paths: PathsConfig = Field(default_factory=PathsConfig, title="Paths", description="Directories the daemon uses.")
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig,
        title="Watchdog",
        description="When the daemon stops vouching for itself to systemd's watchdog.",
    )
    status: StatusConfig = Field(
        default_factory=StatusConfig,
        title="Status socket",
        description="The Unix socket `edgectl status` talks to.",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        title="Tracing",
        description="OpenTelemetry spans per job and stage (README, Tracing).",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        title="Metrics",
        description="The Prometheus metrics endpoint (README, Metrics).",
    )

    @field_validator("device_id")
    @classmethod
    def _device_topic_level(cls, value: str) -> str:
        if not _TOPIC_SEGMENT.match(value):
            raise ValueError("must be one topic level of letters, digits, '_', '.', '-'")
        return value

    @property
    def client_id(self) -> str:
        return self.broker.client_id or f"edge-{self.device_id}"

    def topic(self, *levels: str) -> str:
        return "/".join((self.topics.prefix, self.device_id, *levels))

    @property
    def jobs_filter(self) -> str:
        return self.topic("jobs", "+")

    @property
    def shared_jobs_filter(self) -> str | None:
        group = self.topics.shared_group
        if group is None:
            return None
        return f"$share/{group}/{self.topics.prefix}/jobs/+"

    @property
    def results_topic(self) -> str:
        return self.topic("results")

    @property
    def available_topic(self) -> str:
        return self.topic("available")

    @property
    def status_socket(self) -> Path:
        return self.paths.runtime_dir / "status.sock"

    @model_validator(mode="after")
    def _headroom_below_budget(self) -> Profile:
        if self.memory_headroom_mib >= self.memory_budget_mib:
            raise ValueError(
                f"memory_headroom_mib ({self.memory_headroom_mib}) must be below memory_budget_mib "
                f"({self.memory_budget_mib}): nothing would be left for models and jobs"
            )
        return self

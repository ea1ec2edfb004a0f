"""The text branch's model section (`models.qa`) and its defaults.

The text runtime (edge/text) imports this module, so it imports nothing from edge but
edge.config.base: reading the text settings never pulls in the rest of the profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from edge.config.base import Device, StrictModel

# The prompt the clinic adapter was trained with; kept here as the default so they agree.
DEFAULT_SYSTEM_PROMPT = (
    "You are a careful assistant in a clinic. Answer briefly and factually. When context is given, answer from it."
)


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
    sparsity: Literal["dense", "2:4"] = Field(
        default="dense",
        title="Sparsity",
        description="'2:4' prunes these layers' weights to two of every four along the input, from the "
        "calibration activations, before INT4 quantization, and stores them in the packed 2:4 INT4 format "
        "(format 'int4' only; decoder-layer projections only, not lm_head). Such a build is served op by op "
        "on the CPU (a kernel tested against the dense one) and on CUDA (a kernel that has not yet run on a "
        "GPU: docs/models.md); the fused steps and the ONNX export refuse it.",
    )
    pruning: Literal["sparsegpt", "wanda", "magnitude"] | None = Field(
        default=None,
        title="Pruning method",
        description="How sparsity '2:4' chooses the weights to prune: 'sparsegpt' (the default: the "
        "calibration Hessian's saliency, the remaining weights updated to make up for the pruned), 'wanda' "
        "(|weight| times its input's activation norm), 'magnitude' (|weight|, the baseline).",
    )

    @model_validator(mode="after")
    def _group_for_int4(self) -> LayerRule:
        if self.format == "float" and self.group_size is not None:
            raise ValueError("group_size applies to format 'int4' only")
        if self.format == "float" and self.sparsity != "dense":
            raise ValueError("sparsity '2:4' applies to format 'int4' only")
        if self.pruning is not None and self.sparsity == "dense":
            raise ValueError("pruning applies to sparsity '2:4' only")
        return self

    def to_selector(self) -> dict[str, Any]:
        selector: dict[str, Any] = {"match": self.match, "format": self.format, "group_size": self.group_size}
        if self.sparsity != "dense":  # only then: builds from before sparsity are found as they were
            selector["sparsity"] = self.sparsity
            selector["pruning"] = self.pruning or "sparsegpt"
        return selector


class QATConfig(StrictModel):
    """Quantization-aware training between pruning and packing (engines/text/qat.py)."""

    enabled: bool = Field(
        default=False,
        title="Enabled",
        description="Fine-tune the model's decoder linears before AWQ packs them: each computes with its weight "
        "rounded to INT4 as the build rounds it (the rounding's gradient passed straight through), the layers "
        "a rule prunes to 2:4 with their mask fixed (pruned weights stay exactly zero), on the clinic adapter's "
        "training examples (where the adapter is 'clinic') mixed with general text (the calibration corpus). It "
        "recovers quality that pruning and rounding lose (bench/results/sparsity.json). INT4 only; the build "
        "holds the float model whole with its gradients and optimizer state (16 bytes a weight).",
    )
    steps: int = Field(default=40, ge=1, le=100_000, title="Steps", description="Optimizer steps.")
    batch: int = Field(default=4, ge=1, le=256, title="Batch", description="Sequences a step.")
    seq_len: int = Field(
        default=128,
        ge=16,
        le=8192,
        title="Sequence length",
        description="Tokens a general-text sequence; the adapter's examples are taken whole.",
    )
    lr: float = Field(
        default=1e-4, gt=0, le=1e-2, title="Learning rate", description="AdamW's peak rate, cosine-decayed to 0."
    )
    general_fraction: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        title="General text share",
        description="Of each batch's sequences, the share of general text; the rest the adapter's examples "
        "(all general text without the clinic adapter).",
    )
    seed: int = Field(default=0, ge=0, title="Seed", description="The data order's and the training's seed.")
    recompute: bool = Field(
        default=True,
        title="Gradient checkpointing",
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them: "
        "less memory for a second forward pass's time (bench/results/sparsity.json measures both). The same "
        "gradients either way, so the same build.",
    )

    def to_selector(self) -> dict[str, Any]:
        """What decides the trained weights (recompute does not)."""
        return self.model_dump(exclude={"enabled", "recompute"})


class SparseAttentionConfig(StrictModel):
    enabled: bool = Field(
        default=False,
        title="Enabled",
        description="Top-k block attention (Quest) in the CPU's decode: a token attends, in each layer that "
        "sees every position, to the first block of the context, its own block and the one before, and the "
        "top_k_blocks others whose keys can score highest against it (bounded by each block's per-channel key "
        "minimum and maximum, kept beside the cache), instead of every position. Sliding-window layers stay "
        "dense. CPU only: in the C decode step over a float16 cache, and in the quantized cache's attention "
        "kernel over an int8/int4 one (whose summaries are of the decoded keys; the newest, still float, tokens "
        "always read). A CUDA engine, or a model whose steps over a float cache run op by op, serves dense "
        "attention and says so in its configuration (sparse_attention.refused). Off by default: "
        "bench/results/sparse_attention.json measures speed, perplexity and passkey retrieval against dense "
        "by context length and k.",
    )
    top_k_blocks: int = Field(
        default=16,
        ge=1,
        le=512,
        title="Blocks selected",
        description="Blocks a token attends to besides the first and the two most recent: more cost speed, fewer "
        "perplexity (bench/results/sparse_attention.json: 16 kept the perplexity within a few percent of dense's "
        "at 2K and 4K tokens). Those three and these must be fewer blocks than a max_context_tokens row holds "
        "(else nothing is ever skipped: refused at start).",
    )
    block_tokens: int = Field(
        default=64,
        ge=8,
        le=1024,
        title="Block size",
        description="Positions a block holds: the unit selected, and of the key summaries (two floats a channel "
        "a block, per KV head and full-attention layer: 2 / block_tokens of the keys' own bytes).",
    )
    min_context: int = Field(
        default=2048,
        ge=0,
        le=8192,
        title="Selects from position",
        description="A token at this position or later selects; one before it attends to every position, "
        "where selection does not pay (bench/results/sparse_attention.json: at 1K tokens a step gained little "
        "for its perplexity, from 2K on it gained more the longer the context). Below max_context_tokens (else "
        "no token ever selects: refused at start), so a profile enabling it serves longer contexts.",
    )


class QAModelConfig(StrictModel):
    enabled: bool = Field(default=True, title="Enabled", description="Serve the `qa` task.")
    source: str = Field(
        default=BUILTIN_TEXT_SOURCE,
        title="Source model",
        description="The base model, imported into the engine directory on first use: the built-in "
        f"'{BUILTIN_TEXT_SOURCE}', or a path to a Hugging Face model directory (config.json, *.safetensors, "
        "tokenizer.json, tokenizer_config.json with its chat template) of the Llama family (Llama 2/3.x, "
        "SmolLM, TinyLlama, Mistral with its sliding window), the Qwen2 family, Qwen3, Phi-3 / Phi-4-mini or "
        "Gemma 3 text (gemma3_text; Gemma 3 4B, 12B and 27B, model_type gemma3, as their text model alone: the "
        "vision tower is not served and a job's image is refused naming it), or a path to a GGUF file of those "
        "families (llama, Mistral's as llama with its sliding window, qwen2, qwen3, gemma3, phi3); or a "
        "LLaVA-1.5 or LLaVA-NeXT directory (llava, llava_next), its language model built as those are, its "
        "vision tower and projector carried beside it.",
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
    qat: QATConfig = Field(
        default_factory=QATConfig,
        title="Quantization-aware training",
        description="Fine-tuning with the INT4 rounding in the loop after 2:4 pruning and before packing (off "
        "by default).",
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
    cpu_kernel: Literal["exact", "int8", "bf16"] = Field(
        default="exact",
        title="CPU INT4 kernel",
        description="On the CPU: 'exact' (ours, built on the box: the quantized model in float32, so answers "
        "are the model's own on every CPU and match the GPU's), 'int8' (ours, the same weights against "
        "activations rounded to int8 in blocks of 32, multiplied by the CPU's integer dot products: "
        "AVX-512 VNNI, AVX-VNNI, AVX2 or Arm's dot product; faster, and answers stray from the exact "
        "kernel's now and then: bench/results/text_cpu.json measures how often) or 'bf16' (torch's tiled "
        "kernel: every product rounded to bfloat16, so about one greedy answer in ten strays from the "
        "model's). 'exact' and 'int8' fall back to 'bf16' without a C compiler; 'int8' to 'exact' for a "
        "group size that is not a power of two.",
    )
    cuda_kernel: Literal["auto", "cuda-mma", "triton", "torch"] = Field(
        default="auto",
        title="CUDA INT4 kernel",
        description="On CUDA, the INT4 products' kernel: 'cuda-mma' (ours, on the tensor cores, built by nvcc "
        "on the box for its GPU), 'triton' (ours, in Triton) or 'torch' (torch's tiled INT4 kernel). 'auto' "
        "is cuda-mma where it builds, else triton where Triton is installed, else torch. A layer a kernel "
        "cannot take falls back to the next, and the log says which and why.",
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
        "channels, the newest 32 tokens kept float: under a third of the bytes; docs/design/kv-cache.md for the "
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
    speculative: Literal["off", "prompt-lookup"] = Field(
        default="off",
        title="Speculative decoding",
        description="'prompt-lookup': a greedy answer (temperature 0) proposes the tokens that followed the "
        "latest earlier occurrence of its last few tokens in its prompt and answer, and the model checks "
        "them all in one pass, taking those it would have chosen itself: the same answer, in fewer steps "
        "where it quotes its context. A sampled answer without a nucleus cut (top_p 1) takes drafts by the "
        "rejection rule, which keeps its distribution; one with a cut decodes as usual. Not with CUDA "
        "graphs yet (a CUDA engine that captures them decodes as with 'off'); over an int8 or int4 KV "
        "cache, drafts stop "
        "short of a key block's coding. 'off': one token per step.",
    )
    speculative_tokens: int = Field(
        default=3,
        ge=1,
        le=8,
        title="Draft tokens",
        description="With speculative decoding, the most draft tokens checked per sequence per step. 2 and 3 "
        "measured fastest on the CPU, more drafts slower (bench/results/speculative.json).",
    )
    sparse_attention: SparseAttentionConfig = Field(
        default_factory=SparseAttentionConfig,
        title="Sparse attention",
        description="Top-k block attention in the CPU's decode step (off by default).",
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
        description="torch intra-op threads for the text branch on the CPU; 0: the daemon's share of this "
        "box's cores (half of them where the vision branch runs on the CPU too, else all).",
    )
    collection: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        title="Default collection",
        description="The document collection (`edgectl docs add --collection NAME`) a job without its own "
        "`collection` retrieves from. None: such jobs retrieve nothing.",
    )
    top_k: int = Field(
        default=2,
        ge=1,
        le=16,
        title="Passages retrieved",
        description="Passages a retrieving job puts into its prompt when it does not say (`top_k`). 2 for the "
        "shipped model: with the citation check and the passage-sentence fallback, SmolLM2-135M with the "
        "clinic adapter is right most often from two (bench/eval_rag.py measures each; rag.json "
        "`answers_by_top_k`).",
    )
    grounding: Literal["off", "flag", "require"] = Field(
        default="require",
        title="Grounding policy",
        description="What happens to an answer from a collection whose citations do not all check out "
        "(edge/docs/citations.py: the cited passage states the answer's numbers, units, names and claims, "
        "about what the question names). 'require': it is not passed on as fact; the result says "
        "`grounded: false` and its answer says the documents do not answer the question, quoting the closest "
        "passage (`abstain_answer`); a question whose best passage scores under `abstain_below` abstains "
        "without generating. 'flag': the answer is passed on marked `grounded: false`. Under both, the "
        "passage's own sentence may answer instead (`extractive_fallback`) and a streamed job's pieces wait "
        "for the checked answer. 'off': marked, and nothing withheld or replaced. Answers without a "
        "collection are not checked (`grounded: null`) unless `require_collection` is set.",
    )
    abstain_below: float = Field(
        default=0.4,
        ge=0.0,
        le=1.0,
        title="Abstain below this retrieval score",
        description="Under 'require', a question whose best passage scores under this (cosine similarity of "
        "the question and the passage) is answered from no passage: it abstains without generating. "
        "bench/eval_rag.py measures the best passage's score of every question of its two sets and of "
        "questions about nothing clinical (rag.json `threshold`): 0.4 sits between the highest of the latter "
        "and the lowest of the former.",
    )
    abstain_answer: str = Field(
        default="The documents on this box do not answer this question.",
        min_length=1,
        max_length=500,
        title="Abstention text",
        description="What an answer withheld under 'require' says; the closest passage is quoted after it.",
    )
    extractive_fallback: bool = Field(
        default=True,
        title="Answer with the passage's own sentence",
        description="Where the model's answer from a collection is not grounded, answer with the sentence of a "
        "retrieved passage that names what the question names and addresses what it asks, verbatim with its "
        "citation (`answer_source: passage`), checked like any answer; abstain only where none does. Not "
        "under grounding 'off'.",
    )
    require_collection: bool = Field(
        default=False,
        title="Answer only from documents",
        description="Every question must be answered from a collection (the job's or `collection`): one "
        "without abstains, so the box never answers from the model's weights alone. For clinic boxes.",
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
    def _qat_needs_int4(self) -> QAModelConfig:
        if self.qat.enabled and self.quantization == "float":
            raise ValueError("qat applies to INT4 quantization only, not 'float'")
        return self

    @model_validator(mode="after")
    def _sparse_attention_selects(self) -> QAModelConfig:
        sparse = self.sparse_attention
        if not sparse.enabled:
            return self
        if sparse.min_context >= self.max_context_tokens:
            raise ValueError(
                f"sparse_attention.min_context ({sparse.min_context}) is not below max_context_tokens "
                f"({self.max_context_tokens}): no token would select"
            )
        kept = (sparse.top_k_blocks + 3) * sparse.block_tokens
        if kept >= self.max_context_tokens:
            raise ValueError(
                f"sparse_attention.top_k_blocks ({sparse.top_k_blocks}) blocks of block_tokens "
                f"({sparse.block_tokens}), with the first and the two recent ones, cover max_context_tokens "
                f"({self.max_context_tokens}): nothing would be skipped"
            )
        return self

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

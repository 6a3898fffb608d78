#!/bin/sh
# GPU check for the day a GPU is lent (a few minutes):
#   1. detect TensorRT (python package and trtexec) and the GPU (nvidia-smi); say what is missing, exit 4;
#   2. build the FP8 engine with the recipe's artifacts/<recipe>/build/trtexec.sh, and an FP16 one from
#      the FP32 export (same shapes, --fp16 instead of --stronglyTyped);
#   3. benchmarks/gpu_check.py: engine logits vs ONNX Runtime on the validate windows, the engines'
#      perplexity and prefill tokens/s at batch 1 and 8, FP8 against FP16;
#   the build stage's TensorRT-RTX engine (model.rtx-<sm>.engine) too, where this GPU is one of its
#   targets (an RTX / Ada / Ampere GPU; not Hopper): with only that, steps 1-2 are skipped.
# Needs the recipe's CPU stages already run (`python -m pipeline build recipes/<recipe>.yaml` anywhere,
# then copy artifacts/<recipe>/ here).
# Usage: benchmarks/gpu_check.sh [RECIPE]     (default fp8-llm; PYTHON=... picks the interpreter)
set -u
cd "$(dirname "$0")/.." || exit 3
RECIPE=${1:-fp8-llm}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
RUN=artifacts/$RECIPE
SCRIPT=$RUN/build/trtexec.sh

missing=""
if ! trt=$("$PY" -c "import tensorrt; tensorrt.Builder; print(tensorrt.__version__)" 2>/dev/null); then
  missing="$missing
  - the tensorrt Python package (with its runtime, not only tensorrt-stubs): pip install '.[tensorrt]' into $PY's environment"
fi
TRTEXEC=$(command -v trtexec 2>/dev/null || true)
[ -z "$TRTEXEC" ] && [ -x /usr/src/tensorrt/bin/trtexec ] && TRTEXEC=/usr/src/tensorrt/bin/trtexec
if [ -z "$TRTEXEC" ]; then
  missing="$missing
  - trtexec (not in the pip wheel: use a TensorRT tar/deb install or an NVIDIA TensorRT/Triton container)"
fi
if ! gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -n 1) || [ -z "$gpu" ]; then
  missing="$missing
  - a CUDA GPU (nvidia-smi not found or lists no GPU)"
fi
if [ ! -f "$SCRIPT" ]; then
  missing="$missing
  - $SCRIPT (run: $PY -m pipeline build recipes/$RECIPE.yaml; CPU is enough, the build stage writes it)"
fi
# TensorRT-RTX: the build stage's model.rtx-<sm>.engine runs in the tensorrt_rtx_bindings runtime (a core
# dependency) on a GPU of one of its targets; no datacenter TensorRT or trtexec needed for it.
rtx_engines=""
cap=$(printf '%s' "${gpu:-}" | sed -n 's/.*, *\([0-9]*\)\.\([0-9]*\)$/sm\1\2/p')
for e in "$RUN"/build/model.rtx-*.engine; do
  case "$e" in *"-$cap-"*|*"-$cap.engine") rtx_engines="--engine rtx=$e" ;; esac
done
[ -n "$cap" ] && [ -z "$rtx_engines" ] && ls "$RUN"/build/model.rtx-*.engine >/dev/null 2>&1 && \
  echo "gpu_check: the TensorRT-RTX engine in $RUN/build/ is not built for this GPU ($cap); not run" >&2
if [ -n "$rtx_engines" ] && ! "$PY" -c "import tensorrt_rtx_bindings" 2>/dev/null; then
  echo "gpu_check: tensorrt_rtx_bindings not importable by $PY; TensorRT-RTX engine not run" >&2
  rtx_engines=""
fi
if [ -n "$missing" ] && [ -n "$rtx_engines" ]; then
  echo "gpu_check: datacenter TensorRT check skipped; missing:$missing" >&2
  echo "gpu_check: TensorRT-RTX engine only, on GPU $gpu"
  # shellcheck disable=SC2086  # $rtx_engines is a list of arguments
  exec "$PY" benchmarks/gpu_check.py "recipes/$RECIPE.yaml" $rtx_engines
fi
if [ -n "$missing" ]; then
  echo "gpu_check: cannot run; missing:$missing" >&2
  exit 4
fi
echo "gpu_check: TensorRT $trt, trtexec $TRTEXEC, GPU $gpu"
case "$TRTEXEC" in */*) PATH="$(dirname "$TRTEXEC"):$PATH"; export PATH ;; esac

echo "gpu_check: FP8 engine: sh $SCRIPT"
timeout 900 sh "$SCRIPT" > "$RUN/build/trtexec_fp8.log" 2>&1 || { echo "gpu_check: FP8 build failed, see $RUN/build/trtexec_fp8.log" >&2; exit 1; }
engines="--engine fp8=$RUN/build/model.plan $rtx_engines"

# FP16: the same command on the FP32 export; TensorRT 11 has no --fp16 (weak typing removed): then skipped.
sed -e 's#--onnx=\.\./quantize/model\.onnx#--onnx=../export/model.onnx#' -e 's#--saveEngine=model\.plan#--saveEngine=model_fp16.plan#' \
    -e 's#--stronglyTyped#--fp16#' "$SCRIPT" > "$RUN/build/trtexec_fp16.sh"
if timeout 900 sh "$RUN/build/trtexec_fp16.sh" > "$RUN/build/trtexec_fp16.log" 2>&1; then
  engines="$engines --engine fp16=$RUN/build/model_fp16.plan"
else
  echo "gpu_check: FP16 engine not built (see $RUN/build/trtexec_fp16.log); reporting FP8 only" >&2
fi
# shellcheck disable=SC2086  # $engines is a list of arguments
exec "$PY" benchmarks/gpu_check.py "recipes/$RECIPE.yaml" $engines

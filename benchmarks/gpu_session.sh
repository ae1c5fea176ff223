#!/usr/bin/env bash
# One lent-GPU call: named steps, each under a time limit (its processes killed with it), every test
# failure's report written to $OUT/failures.log as it happens (tests/conftest.py LUISAML_FAILURE_LOG), so a
# step cut by its limit still says what failed and why. From the project's root on the device machine
# (run's carry: [".device"]; benchmarks/NOTES.md, "Running the GPU command on the lent machine"):
#
#     bash benchmarks/gpu_session.sh tests1 tests2 fvdb zoo-a        # the first call of a session (~8 min)
#     bash benchmarks/gpu_session.sh zoo-b zoo-c                     # the zoo's other 16 rows (~9 min)
#     bash benchmarks/gpu_session.sh detector topology counted       # issue 28's rows (counted: net.run against the span)
#     bash benchmarks/gpu_session.sh topk fp16 rnn                   # fp16 MLPs, the recurrent forms
#
# A step is NAME or NAME=SECONDS (its limit; the defaults below). Results and logs go to $OUT (they come
# back with the reply): a step's log is $OUT/NAME.log, the zoo's records $OUT/zoo.json (merged by name
# into the file as each network finishes: a cut step keeps what it measured). The zoo runs with tensor
# cores on and torch fp32 (TF32 as shipped) as its one baseline; the H200 record is
# benchmarks/results/zoo-h200-tc.json (merge rows by name: bench_zoo.merge).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
O=${OUT:-/tmp/gpu-session}
mkdir -p "$O"
export LUISAML_FAILURE_LOG="$O/failures.log"
PYTEST=(python3 -P -m pytest -v -p no:cacheprovider -rf --tb=short)  # (-v: a step cut by its limit still names what passed)
ZOO=(python3 -P benchmarks/bench_zoo.py --device cuda --skip torch_compile,torch_fp16,torch_fp32_notf32
     --option tensor_cores=auto --profile 3 --reps 15 --out "$O/zoo.json" --only)

# the zoo in three calls' worth: a, the rows the last sessions' work targets; b and c, the rest
ZOO_A="bilstm tagger 2x256,gru 64-128 seq 32,convnext-tiny,efficientnet-b0,resnet-50,wav2vec2 conv encoder,nerf mlp 8x256,cifar-cnn,lstm 64-128 seq 32,mixer-s/16"
ZOO_B="resnet-18,mobilenet-v3-small,regnet-y-400mf,densenet-121,squeezenet-1.1,shufflenet-v2,unet-small,vit-tiny/16"
ZOO_C="deit-small/16 distilled,bert-base,gpt-2 small,transformer d64 seq 16,pointnet,sdf 3-64x4-1 softplus,siren 2-256x3-3,lenet-5"

step() {  # step NAME SECONDS COMMAND...: the command under a limit (timeout signals its whole process group)
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout -k 10 "$limit" "$@" >"$O/$name.log" 2>&1
  local rc=$?
  pkill -9 -f "pytest|bench_" 2>/dev/null  # (anything the step left: an xdist worker keeps the host busy)
  echo "== $name rc=$rc $((SECONDS - t0)) s"
  grep -E "passed|failed|error|^FAILED|geometric mean|of [0-9]+ networks pass|^\| layer" "$O/$name.log" | grep -v " PASSED" | tail -12
}

run() {
  local name=${1%%=*} limit=${1#*=}
  [[ $limit == "$1" ]] && limit=""
  case $name in
    tests1) step "$name" "${limit:-400}" env LUISAML_BACKEND=cuda "${PYTEST[@]}" -n 16 tests/gpu/test_rows_cuda.py \
              tests/gpu/test_blocks_cuda.py tests/gpu/test_rnn_cuda.py tests/gpu/test_stages_cuda.py \
              tests/gpu/test_gemm_heads_cuda.py tests/gpu/test_across_cuda.py tests/gpu/test_topk_cuda.py \
              tests/gpu/test_sparse_conv_fp32_cuda.py tests/gpu/test_w2v_first_cuda.py ;;
    tests2) step "$name" "${limit:-120}" env LUISAML_BACKEND=cuda "${PYTEST[@]}" -n 12 tests/gpu/test_tensor_cores_cuda.py \
              tests/gpu/test_sparse_conv_mma_cuda.py tests/gpu/test_winograd_cuda.py ;;
    tests3) step "$name" "${limit:-260}" env LUISAML_BACKEND=cuda "${PYTEST[@]}" -n 8 tests/fvdb/test_radix_passes.py tests/fvdb/test_resident_blobs.py \
              tests/gpu/test_rows_kept_cuda.py tests/fvdb/test_topology_device.py tests/fvdb/test_build_layout.py tests/fvdb/test_grid_build_device.py \
              tests/fvdb/test_counted_runs.py tests/core/test_counted_bytes.py tests/core/test_same_uploads.py \
              tests/gpu/test_cuda.py tests/test_f64_lib.py ;;
    # (the device-written headers: the f64 library and the builds' bytes against the host builder's)
    headers) step "$name" "${limit:-150}" env LUISAML_BACKEND=cuda "${PYTEST[@]}" -n 8 tests/test_f64_lib.py \
               tests/fvdb/test_build_layout.py tests/fvdb/test_grid_build_device.py ;;
    fvdb) step "$name" "${limit:-135}" python3 -P benchmarks/bench_fvdb.py --tensor-cores --only-layers --reps 20 \
              --fp32-forms early rows ahead uniform --out-dir "$O" ;;
    fvdb-w32) mkdir -p "$O/w32"; step "$name" "${limit:-70}" env LUISAML_MMA_TILE=w32-first python3 -P benchmarks/bench_fvdb.py \
                --tensor-cores --only-layers --reps 20 --out-dir "$O/w32" ;;  # (the sparse mma tile with 4x the warps)
    zoo-a) step "$name" "${limit:-240}" "${ZOO[@]}" "$ZOO_A" ;;
    zoo-b) step "$name" "${limit:-300}" "${ZOO[@]}" "$ZOO_B" ;;
    zoo-c) step "$name" "${limit:-300}" "${ZOO[@]}" "$ZOO_C" ;;
    detector) step "$name" "${limit:-200}" python3 -P benchmarks/bench_detector.py --device cuda --reps 5 --out-dir "$O" ;;
    topology) step "$name" "${limit:-150}" python3 -P benchmarks/bench_topology.py --reps 20 --out-dir "$O" ;;
    # (issue 28's table: net.run's wall against the device span, each network over a new grid every call)
    counted) step "$name" "${limit:-200}" python3 -P benchmarks/bench_counted.py --out-dir "$O" ;;
    topk) step "$name" "${limit:-60}" python3 -P benchmarks/experiments/micro_topk.py ;;
    fp16) step "$name" "${limit:-150}" env LUISAML_BACKEND=cuda python3 -P benchmarks/experiments/fp16_mlp.py --tiles w64,w32 ;;
    # (unrolled: the k loop's loads where written, as rnngpu merged it; auto: an iteration ahead, NOTES.md
    # "Why the unrolled k loop bought nothing")
    rnn) step "$name" "${limit:-180}" python3 -P benchmarks/experiments/rnn_forms.py \
      --forms unrolled,auto,block,steps --reps 15 ;;
    # (the mma tile's A/B's: the conv gather's step order "step" against "reuse" (NOTES.md, "The mma tile's loads
    # are in flight"), each under w64 and w64r; one process a gather, so two sweeps; then the zoo's two rows)
    mma) step "$name" "${limit:-420}" bash -c 'for g in step reuse; do LUISAML_CONV_GATHER=$g python3 -P \
           benchmarks/experiments/sweep_mma.py --variants w64,w64r --shapes w2v-3,w2v-2,r50-3x3-s2,r50-3x3,gemm4k \
           --budget 200 --out "$0/sweep-mma-$g.json"; done' "$O" ;;
    zoo-reuse) step "$name" "${limit:-200}" env LUISAML_CONV_GATHER=reuse "${ZOO[@]}" \
                 "resnet-50,wav2vec2 conv encoder" --out "$O/zoo-reuse.json" ;;
    *) echo "unknown step $name (tests1 tests2 tests3 headers fvdb fvdb-w32 zoo-a zoo-b zoo-c detector topology counted topk fp16 rnn mma zoo-reuse)"; return 2 ;;
  esac
}

for s in "$@"; do run "$s"; done
[[ -s $O/failures.log ]] && { echo "== failures ($O/failures.log)"; grep "^====" "$O/failures.log"; }
exit 0

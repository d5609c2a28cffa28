#!/usr/bin/env bash
# The performance measurements of docs/performance.md on a CUDA machine, from the repository
# root, each under a time limit of its own, with its log (and JSON) in $OUT (the device tool
# brings that folder back) or /tmp/ouro-measure. Wheels in .whl/ are installed first, as in
# scripts/gpu_check.sh. Name the steps to run (all by default; the whole set needs about
# 12 minutes, so a 10-minute call takes part of it):
#   bash scripts/gpu_measure.sh                  # every step below
#   bash scripts/gpu_measure.sh e2e exact        # the steady update at each K, then exact mode's
# Steps:
#   e2e           bench/e2e.py case a (256 x 512), two updates at each K = 2, 3, 4
#   exact         the same case at K = 2 with --exact: its cost against the default's
#   agree         the GPU table's fp32 agreement row (fp32 prefills each prompt alone)
#   agree_grouped the same with prompts prefilled 32 together, as bf16 does: what grouping does to it
#   fixed_tile    exact mode's projections against cuBLAS, every tile config timed and its bits checked
#   profile       the K = 2 case with its third update's train step profiled (not in the default set)
#   exact_profile the same in exact mode (not in the default set)
#   shapes        bench/shapes.py's cells named in $CELLS (K = 4, 2 updates; $MODEL 1.4b or 2.6b),
#                 each within $CELL_S seconds (default 300; a 2.6B cell needs about 420) after the random
#                 checkpoint is built (up to 2 minutes, outside the cells' limits; kept for the next call
#                 while the machine stays warm), the run
#                 folders on /dev/shm where it has room (the final checkpoint save is then not
#                 bound by the disk), with a held-out evaluation of $EVAL samples a prompt at the
#                 start and the end when EVAL is set, $PROMPTS prompts an update when set (shapes.py's
#                 default otherwise) and $UPDATES updates (default 2) (not in the default set), e.g.
#                 CELLS="p16-r512-default p16-r512-exact" bash scripts/gpu_measure.sh shapes
#   fp8           the fp8 kernels' GPU tests, then bench/cascade.py --fp8, which times the fp8 decode
#                 kernel with the cascade off and on (not in the default set; about 2 minutes)
#   options       bench/kernel_options.py with fp8 and with bf16 K/V: the decode kernel under launch options
#                 that keep its bits (num_stages, maxnreg) against the engine's launch (not in the default
#                 set; about 1 minute)
#   fma           bench/decode_fma.py: a decode attention without tensor cores (one query head per KV
#                 head) beside the engine's kernel, bf16 and fp8, attend only (not in the default set;
#                 about 1 minute)
#   vt            bench/decode_vt.py: the fp8 decode attention with V stored position-major within each
#                 block beside V stored as rows, attend only (not in the default set; about 1 minute)
#   tiles         bench/decode_attention.py at the real rollout's rows (256, 356 positions): the decode
#                 kernel's tile (16-128 positions) and warps (2, 4, 8), fp8 and bf16 K/V (both set the
#                 summation order; not in the default set; about 3 minutes)
#   kernels       bench/decode_profile.py at the real rollout's decode step (batch 256, K = 4, groups of
#                 8 sharing a 100-token prompt, --bandwidth $BW, default the H200's 4.26e12), bf16 and fp8
#                 KV, each with its kernel timeline, over $STEPS decode steps (default 160); STEPS=512 with
#                 TIMELINE=0 times the real rollout's whole response, positions 100-612, without the
#                 profiler (not in the default set; about 2 minutes)
#   ab            bench/e2e.py at the real shape (--prompts $AB_PROMPTS, default p100; case a, K = 4,
#                 2 updates) for each variant named in $VARIANTS (default "copied shared fp8"; also
#                 fp8exact), one after another on this machine: shared prompts and fp8 KV against
#                 copied prompts (about 3 minutes a variant), e.g. VARIANTS="shared fp8" bash
#                 scripts/gpu_measure.sh ab; AB_PROMPTS=p1024 VARIANTS="copied shared" for 1,024-token
#                 prompts
set -uo pipefail
source scripts/wheels_env.sh || exit 2
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/ouro-measure}
mkdir -p "$out"
status=0

step() {  # NAME LIMIT_S COMMAND...: run it, keep its log, print its exit status and its last lines
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc"
  [ $rc -eq 0 ] || status=$rc
  tail -n "${TAIL:-8}" "$out/$name.log"
}

scratch() {  # NAME GIB: a scratch folder for run folders, on /dev/shm where it has GIB free (the saves
  # are then not bound by the disk), else under /tmp
  if [ "$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -ge "$2" ] 2>/dev/null; then
    echo "/dev/shm/$1"
  else
    echo "/tmp/$1"
  fi
}

tidy() {  # FOLDER: delete the runs and data in a scratch folder, keeping its random checkpoints
  # (model-*): the next variant or cell, and the next call while this machine stays warm, reuse
  # them instead of building them again (about 40 s at 1.4B)
  find "$1" -mindepth 1 -maxdepth 1 ! -name 'model-*' -exec rm -rf {} + 2>/dev/null
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(e2e exact agree agree_grouped fixed_tile)
for s in "${steps[@]}"; do
  case $s in
    e2e) step e2e 330 python3 bench/e2e.py --prompts arith --cases a --updates 6 --timeout 300 --out "$out/e2e.json" ;;
    exact) step exact 210 python3 bench/e2e.py --prompts arith --cases a --depths 2 --updates 2 --train-args=--exact --timeout 170 \
             --out "$out/exact.json" ;;
    agree) step agree 90 python3 bench/gpu_table.py --device cuda --sections agree --agree-dtypes fp32 ;;
    agree_grouped) step agree_grouped 90 python3 bench/gpu_table.py --device cuda --sections agree --agree-dtypes fp32 \
                     --prefill-group 32 ;;
    fixed_tile) step fixed_tile 180 python3 bench/fixed_tile.py --sweep --rows 64 128 256 512 4096 16384 --repeats 5 ;;
    profile|exact_profile)
      extra=(); [ "$s" = exact_profile ] && extra=(--train-args=--exact)
      step "$s" 330 python3 bench/e2e.py --prompts arith --cases a --depths 2 --updates 3 --train-profile 2 "${extra[@]}" \
        --timeout 300 --out "$out/$s.json" ;;
    shapes)
      work=$(scratch ouro-shapes 60)
      read -ra cells <<< "${CELLS:?name the cells in CELLS (python bench/shapes.py --list)}"
      limit=${CELL_S:-300}
      extra=(); [ -n "${PROMPTS:-}" ] && extra=(--prompts "$PROMPTS")
      step shapes $((limit * ${#cells[@]} + 120)) python3 bench/shapes.py --model "${MODEL:-1.4b}" --depths 4 \
        --updates "${UPDATES:-2}" --timeout "$limit" --work "$work" --out "$out/shapes.json" --eval-samples "${EVAL:-0}" \
        "${extra[@]}" --cells "${cells[@]}"
      tidy "$work" ;;
    fp8)
      step fp8_tests 240 python3 -m pytest -q -m gpu tests/gpu/test_decode_kernels_gpu.py -k "fp8 or e4m3" \
        -p no:cacheprovider -rfE
      step fp8_cascade 200 python3 bench/cascade.py --fp8 ;;
    options)
      step options_fp8 200 python3 bench/kernel_options.py --fp8
      step options_bf16 200 python3 bench/kernel_options.py ;;
    fma) step fma 200 python3 bench/decode_fma.py ;;
    vt) step vt 200 python3 bench/decode_vt.py ;;
    tiles)
      for dt in fp8 bf16; do
        flag=(); [ "$dt" = fp8 ] && flag=(--fp8)
        step "tiles_$dt" 200 python3 bench/decode_attention.py "${flag[@]}" --rows 256 --positions 356 \
          --blocks 16 32 64 128 --warps 2 4 8
      done ;;
    kernels)
      for dt in bf16 fp8; do
        timeline=(--timeline); [ "${TIMELINE:-1}" = 0 ] && timeline=()
        step "kernels_$dt" 240 python3 \
          bench/decode_profile.py --batch 256 -K 4 --prompt 100 --steps "${STEPS:-160}" --group-size 8 \
          --kv-cache-dtype "$dt" --bandwidth "${BW:-4.26e12}" "${timeline[@]}" --no-eager --top 16
      done ;;
    ab)
      work=$(scratch ouro-ab 40)
      for v in ${VARIANTS:-copied shared fp8}; do
        case $v in
          copied) extra=(--train-args=--no-share-prompts) ;;
          shared) extra=() ;;
          fp8) extra=("--train-args=--kv-cache-dtype fp8") ;;
          fp8exact) extra=("--train-args=--kv-cache-dtype fp8 --exact") ;;
          *) echo "unknown variant $v (copied shared fp8 fp8exact)"; exit 2 ;;
        esac
        step "ab_$v" 300 python3 bench/e2e.py --prompts "${AB_PROMPTS:-p100}" --cases a --depths 4 --updates 2 \
          --timeout 280 --work "$work" --out "$out/ab_$v.json" "${extra[@]}"
        tidy "$work"
      done ;;
    *) echo "unknown step $s (e2e exact agree agree_grouped fixed_tile profile exact_profile shapes fp8 options fma vt tiles kernels ab)"; exit 2 ;;
  esac
done
exit $status

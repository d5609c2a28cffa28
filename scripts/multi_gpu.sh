#!/usr/bin/env bash
# The 1.4B shape on several GPUs of one host (issue 25), in one call of about 10 minutes:
#   a. data parallelism: bench/e2e.py case a (256 samples x 512 tokens, --depths 2 3 4) on one
#      GPU and under torchrun on N, plus N with the distributed optimizer: update time, rollout
#      and train tokens/s per GPU, the scaling efficiency (goal >= 0.9 at N = 2), replicas
#      bit-identical after every update, rank 0's peak memory per phase;
#   b. prefill/decode at the real shape: case a with prefill on GPU 0 and decode on GPU 1,
#      its rollout against the local engine's and the KV bytes moved per update;
#   c. `ouro verify-resume --compare` of a PD run against a local one at --max-num-seqs 1
#      (bit-identical), on the 1.4B shape at a small batch;
#   d. `ouro probe-ucx --devices 0 1`: which UCX transports deliver between the two GPUs.
#
#   bash scripts/multi_gpu.sh            # on the GPU machine, repo root as cwd; N = the GPUs it sees
#   CASES="a b" bash scripts/multi_gpu.sh
#
# Carried wheels (.whl/, scripts/wheels_env.sh) are installed first. NVLink multicast stays
# off (NCCL_NVLS_ENABLE=0): a program that uses it can take a shared host's GPUs out of
# service. Output: $OUT (default /tmp/multi_gpu_out): e2e.json, e2e.log, pd_verify.log,
# probe.log.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/multi_gpu_out}
WORK=${WORK:-/tmp/multi_gpu_runs}
CASES=${CASES:-a}
mkdir -p "$OUT" "$WORK"
source scripts/wheels_env.sh || exit 2
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $N"
[ "$N" -ge 2 ] || { echo "needs two GPUs or more"; exit 2; }

echo "== a. data parallel on $N GPUs, b. prefill/decode"
python3 bench/e2e.py --cases $CASES --work "$WORK" --nproc "$N" --dist-optimizer --pd --out "$OUT/e2e.json" \
  2>&1 | tee "$OUT/e2e.log" | grep -E "^==|scaling|rollout .* local|error"

echo "== c. verify-resume --compare: PD against local at --max-num-seqs 1"
SMALL=(--model "$WORK/model-1.4b" --data "$WORK/train.jsonl" --eval-data "" --depths 2 4 --updates 2
       --prompts-per-update 2 --group-size 2 --max-response-len 64 --max-num-seqs 1 --state-digest --keep-last 1)
rm -rf "$WORK/local" "$WORK/pd"
{ python3 -m ouro_cli.cli.app train "${SMALL[@]}" --run-dir "$WORK/local" \
  && python3 -m ouro_cli.cli.app train "${SMALL[@]}" --run-dir "$WORK/pd" --prefill-devices 0 --decode-devices 1 \
  && python3 -m ouro_cli.cli.app verify-resume --compare "$WORK/local" "$WORK/pd"; } > "$OUT/pd_verify.log" 2>&1
echo "exit $? (0: bit-identical)"; tail -12 "$OUT/pd_verify.log"

echo "== d. probe-ucx --devices 0 1"
python3 -m ouro_cli.cli.app probe-ucx --devices 0 1 > "$OUT/probe.log" 2>&1; echo "exit $?"; tail -20 "$OUT/probe.log"

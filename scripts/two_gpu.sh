#!/usr/bin/env bash
# The two-GPU checks on a machine with two CUDA devices, on the bundled tiny Ouro
# (ouro_cli/bundled/tiny), bf16 on CUDA: data parallelism and prefill/decode disaggregation
# against one GPU, and the UCX transports between the two devices.
#   a. data parallel: `ouro train` on 1 GPU (run A) and under torchrun on 2 GPUs (run B),
#      same seed and global batch; `ouro compare A B`; both ranks in B's metrics.
#      The control: run A2 is A on 1 GPU with two micro-batches (another gradient summation
#      order, nothing else changed); `ouro compare A A2` is the floor that A B is read against
#   b. prefill/decode: local `ouro train --max-num-seqs 1` on GPU 0 (run D) and
#      `--prefill-devices 0 --decode-devices 1` (run C); `ouro verify-resume --compare D C`
#      (bit for bit) and `ouro compare D C` (tolerance)
#   c. `ouro probe-ucx --devices 0 1` over UCX settings (before C, whose UCX_TLS is the
#      recommendation when one delivered); a missing NIXL is recorded, never fatal
#   d. $OUT/summary.txt: every step's exit code and time, the key numbers, throughput
#
#   bash scripts/two_gpu.sh                                # on the GPU machine, repo root as cwd
#   DEVICE=cpu bash scripts/two_gpu.sh                     # dry run on any machine: gloo ranks, CPU PD workers
#   DEVICE=cpu DTYPE=bf16 bash scripts/two_gpu.sh          # dry run with the bf16 tolerances
#
# Environment: OUT (default /tmp/two_gpu_out; at most 6 files land there: summary.txt,
# dp.log, pd.log, probe.log, metrics.jsonl, reports.tar.gz with compare_{ab,aa2,dc}.json and
# verify_dc.json),
# WORK (run directories, wiped first, default /tmp/two_gpu_runs), PYTHON, DTYPE, UPDATES,
# PROMPTS, GROUP, PD_PROMPTS, PD_GROUP, RESP, BUDGET (seconds for the whole script, default
# 470: each step gets at most what is left, so later steps are skipped, never overrun).
#
# Tolerance: `ouro compare --tolerance bf16` (--atol 1e-3 --rtol 2^-7 --min-identical 0.9
# --max-update-diff 0.1; fp32: --tolerance fp32).
# Weights: rtol 2^-7 is one bf16 rounding step (two fp32 main weights less than lr apart
# can round to neighbouring bf16 values); atol 1e-3 covers weights near zero, where the
# difference is bounded by Adam's steps (≤ ~lr = 1e-4 per update each). That elementwise
# check alone cannot tell a run that trained alike from one that did not train (3 updates
# move a weight ~3e-4), hence --max-update-diff 0.1 on ‖w_B − w_A‖ / ‖w_A − w_0‖ over the
# fp32 main weights (1 = B learned nothing of what A learned). Logprob, loss and mismatch
# tolerances calibrate themselves to each run's own engine-vs-trainer mismatch
# (ouro_cli/checks/compare.py). --min-identical 0.9: a one-ulp weight difference flips a token
# now and then and the sample parts from there. A CPU bf16 dry run measured 381/384
# identical samples, weights max |Δ| 4.9e-4 (one ulp), update difference 0.028, max
# |Δlogp| 0.07 against a tolerance of 0.16.
# On two H200s these elementwise bf16 tolerances fail for the control A vs A2 as much as for
# A vs B (update difference 0.18 and 0.20, max |Δlogp| 0.30 and 0.22): a GPU's bf16 kernels
# amplify a different summation order more than the CPU does. So the verdict on data
# parallelism is B against that floor (the summary's last part of a.), not these tolerances.
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/two_gpu_out}
WORK=${WORK:-/tmp/two_gpu_runs}
BUDGET=${BUDGET:-470}
RESERVE=25  # kept for the comparisons' tail and the summary
if [ "$DEVICE" = cuda ]; then DTYPE=${DTYPE:-bf16}; PYTHON=${PYTHON:-python3}
else DTYPE=${DTYPE:-fp32}; PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
UPDATES=${UPDATES:-3} PROMPTS=${PROMPTS:-16} GROUP=${GROUP:-8} RESP=${RESP:-48}
PD_PROMPTS=${PD_PROMPTS:-4} PD_GROUP=${PD_GROUP:-4}  # one sequence at a time: a smaller global batch
TOL=(--tolerance "$DTYPE")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK"
rm -f "$OUT"/{summary.txt,dp.log,pd.log,probe.log,metrics.jsonl,reports.tar.gz}
ENV_LOG="$WORK/env.txt" STEPS="$WORK/steps.tsv" REPORTS="$WORK/reports"
mkdir -p "$REPORTS"
: > "$STEPS"

if [ "$DEVICE" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then  # as scripts/gpu_check.sh
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$WORK/pip.txt" 2>&1
  echo -e "install-wheels\t$?\t$SECONDS" >> "$STEPS"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  echo "device $DEVICE, dtype $DTYPE, updates $UPDATES, response $RESP tokens; prompts × group: A/B $PROMPTS × $GROUP," \
       "C/D $PD_PROMPTS × $PD_GROUP at max-num-seqs 1"
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" - <<'EOF'
import importlib, sys, warnings
import torch
warnings.filterwarnings("ignore")
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "gpus", torch.cuda.device_count())
for name in ("megatron.core", "nixl._api", "matplotlib", "transformers", "tokenizers", "psutil"):
    try:
        module = importlib.import_module(name)
        print(f"  {name}: {getattr(module, '__version__', 'ok')}")
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        print(f"  {name}: MISSING ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
EOF
} > "$ENV_LOG" 2>&1
cat "$ENV_LOG"

# step NAME LOG MAX_SECONDS STDOUT_FILE|- COMMAND...: run under what is left of the budget, record exit and time
step() {
  local name=$1 log=$2 max=$3 stdout=$4; shift 4
  local left=$((BUDGET - SECONDS - RESERVE)) limit rc t0=$SECONDS
  limit=$((left < max ? left : max))
  if ((limit < 15)); then
    echo "== $name: skipped, the time budget is spent" | tee -a "$log"; echo -e "$name\tskipped\t0" >> "$STEPS"; return
  fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$log"
  if [ "$stdout" = - ]; then timeout -k 10 "$limit" "$@" >> "$log" 2>&1; else timeout -k 10 "$limit" "$@" > "$stdout" 2>> "$log"; fi
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  echo -e "$name\t$rc\t$((SECONDS - t0))" >> "$STEPS"
}

OURO=("$PYTHON" -m ouro_cli.cli.app)
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2)
TINY=$PWD/ouro_cli/bundled/tiny
COMMON=(--model "$TINY/model" --data "$TINY/train.jsonl" --eval-data "$TINY/eval.jsonl" --device "$DEVICE"
        --dtype "$DTYPE" --depths 2 3 4 --updates "$UPDATES" --max-response-len "$RESP" --eval-prompts 16
        --eval-depths 4 --save-interval 0 --seed 1234 --overwrite)
DP=(--prompts-per-update "$PROMPTS" --group-size "$GROUP")
COMPARE=("${OURO[@]}" compare "${TOL[@]}")

# ---- a. one GPU vs two data-parallel ranks ------------------------------------------------
step A-1rank "$OUT/dp.log" 120 - env CUDA_VISIBLE_DEVICES=0 "${OURO[@]}" train "${COMMON[@]}" "${DP[@]}" \
  --run-dir "$WORK/A"
step B-2ranks "$OUT/dp.log" 150 - env CUDA_VISIBLE_DEVICES=0,1 "${TORCHRUN[@]}" -m ouro_cli.cli.app train \
  "${COMMON[@]}" "${DP[@]}" --run-dir "$WORK/B"
step A2-1rank-2mb "$OUT/dp.log" 120 - env CUDA_VISIBLE_DEVICES=0 "${OURO[@]}" train "${COMMON[@]}" "${DP[@]}" \
  --micro-batch-size $((PROMPTS * GROUP / 2)) --run-dir "$WORK/A2"
RESERVE=0 step compare-A-B "$WORK/compare_ab.txt" 60 "$REPORTS/compare_ab.json" "${COMPARE[@]}" "$WORK/A" "$WORK/B" --json
RESERVE=0 step compare-A-A2 "$WORK/compare_aa2.txt" 60 "$REPORTS/compare_aa2.json" "${COMPARE[@]}" "$WORK/A" "$WORK/A2" \
  --json
cat "$WORK/compare_ab.txt" "$WORK/compare_aa2.txt" >> "$OUT/dp.log"

# ---- b + c. prefill/decode on two GPUs vs the local engine, UCX probe first -----------------
PD=(--prompts-per-update "$PD_PROMPTS" --group-size "$PD_GROUP" --max-num-seqs 1 --state-digest)
step D-local "$OUT/pd.log" 120 - env CUDA_VISIBLE_DEVICES=0 "${OURO[@]}" train "${COMMON[@]}" "${PD[@]}" \
  --run-dir "$WORK/D"
step probe-ucx "$OUT/probe.log" 90 "$WORK/probe.json.out" env CUDA_VISIBLE_DEVICES=0,1 "${OURO[@]}" probe-ucx \
  --devices 0 1 --tls tcp,cuda_copy cuda_ipc,cuda_copy sm,cuda_ipc,cuda_copy tcp,cuda_ipc,cuda_copy \
  --size-mb 16 --repeats 3 --timeout 15 --out "$WORK/probe" --json
cat "$WORK/probe.json.out" >> "$OUT/probe.log" 2>/dev/null
UCX_CHOICE=$("$PYTHON" -c 'import json,sys; print((json.load(open(sys.argv[1])).get("recommended") or {}).get("tls") or "")' \
  "$WORK/probe.json.out" 2>/dev/null)
echo "UCX_TLS for the PD run: ${UCX_CHOICE:-(unset)}" | tee -a "$OUT/pd.log"
if [ -n "$UCX_CHOICE" ]; then UCX_ENV=(UCX_TLS="$UCX_CHOICE"); else UCX_ENV=(); fi
step C-pd "$OUT/pd.log" 150 - env CUDA_VISIBLE_DEVICES=0,1 ${UCX_ENV[@]+"${UCX_ENV[@]}"} "${OURO[@]}" train "${COMMON[@]}" "${PD[@]}" \
  --prefill-devices 0 --decode-devices 1 --run-dir "$WORK/C"
RESERVE=0 step verify-D-C "$OUT/pd.log" 60 "$REPORTS/verify_dc.json" "${OURO[@]}" verify-resume --compare "$WORK/D" "$WORK/C" --json
RESERVE=0 step compare-D-C "$WORK/compare_dc.txt" 60 "$REPORTS/compare_dc.json" "${COMPARE[@]}" "$WORK/D" "$WORK/C" --json
cat "$WORK/compare_dc.txt" >> "$OUT/pd.log"
tar -czf "$OUT/reports.tar.gz" -C "$REPORTS" .

# ---- d. summary -------------------------------------------------------------------------------
"$PYTHON" - "$WORK" "$OUT" "$ENV_LOG" "$STEPS" "${UCX_CHOICE:-}" "${TOL[*]}" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

work, reports, env_log, steps, ucx, tol = Path(sys.argv[1]), Path(sys.argv[1]) / "reports", Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5], sys.argv[6]
from ouro_cli.checks.compare import Run, throughput  # noqa: E402


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def g(value, spec=".3g"):
    return "-" if value is None else format(value, spec)


def metrics(run):
    p = work / run / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []


print("== environment")
print(env_log.read_text().rstrip())
print("\n== steps (exit code, seconds)")
for line in steps.read_text().splitlines():
    name, rc, secs = line.split("\t")
    status = {"0": "ok", "skipped": "skipped", "124": "TIMED OUT", "137": "TIMED OUT"}.get(rc, f"FAILED {rc}")
    if name.startswith("compare-") and rc == "1":
        status = "BEYOND TOL"  # ouro compare ran; its verdict is read below
    print(f"  {name:16s} {status:>10s}  {secs:>4s} s")

with open(Path(sys.argv[2]) / "metrics.jsonl", "w") as f:
    for run in ("A", "A2", "B", "C", "D"):
        for m in metrics(run):
            f.write(json.dumps({"run": run, **m}, sort_keys=True) + "\n")

print("\n== a. data parallel: run B (2 ranks) per update")
for m in metrics("B"):
    print(f"  update {m['update']}: ranks {m['ranks']}, plan agreed by {m.get('plan_agreed_ranks')}, params identical "
          f"{m.get('params_identical_across_ranks')}, rank sha256 {[h[:12] for h in m.get('rank_param_sha256', [])]}, "
          f"devices {m.get('rank_device')}, samples {m.get('rank_samples')}, rank check {m.get('rank_check_s', 0):.3f} s")
COMPARISONS = (("A vs B (1 vs 2 ranks)", "compare_ab.json"),
               ("A vs A2 (1 rank, 1 vs 2 micro-batches: the summation-order floor)", "compare_aa2.json"),
               ("D vs C (local vs PD)", "compare_dc.json"))
for label, name in COMPARISONS:
    doc = load(reports / name)
    print(f"\n== ouro compare {label}, {tol}")
    if doc is None:
        print("  no report (the step failed or was skipped)")
        continue
    print(f"  verdict: {'WITHIN TOLERANCE' if doc['ok'] else 'BEYOND TOLERANCE'} {doc['checks']}")
    print(f"  identical rollouts {doc['identical_samples']}/{doc['samples']}; weights max|Δ| "
          f"{g(doc['weights_max_abs_diff'])} (bitwise equal: {doc['weights_bitwise_equal']}); training update "
          f"‖w_B − w_A‖/‖w_A − w_0‖ = {g(doc['training_update']['rel_diff'])}")
    for u in doc["updates"]:
        if "problem" in u:
            print(f"  update {u['update']}: {u['problem']}")
            continue
        print(f"  update {u['update']} K={u['k']}: identical {u['identical']}/{u['samples']}, max|Δlogp| "
              f"{g(u['logprob_max_diff'])} (tol {g(u['logprob_tol'])}), |Δloss| {g(u['train_loss_diff'])}, "
              f"|Δgrad_norm| {g(u['train_grad_norm_diff'])}, reward {u['reward_mean_a']:.4f}/{u['reward_mean_b']:.4f}"
              f"{'' if u['ok'] else '  BEYOND TOLERANCE'}")

ab, aa2 = load(reports / "compare_ab.json"), load(reports / "compare_aa2.json")
if ab and aa2:
    def worst(doc):
        return max((u.get("logprob_max_diff") or 0.0) for u in doc["updates"])
    print("\n== A vs B read against the floor A vs A2 (what another summation order alone does on one GPU)")
    for what, x, y in (("identical rollouts", ab["identical_fraction"], aa2["identical_fraction"]),
                       ("weights max|Δ|", ab["weights_max_abs_diff"], aa2["weights_max_abs_diff"]),
                       ("training-update diff", ab["training_update"]["rel_diff"], aa2["training_update"]["rel_diff"]),
                       ("max|Δlogp| (identical samples)", worst(ab), worst(aa2))):
        ratio = f"{x / y:.2f}x the floor" if y else ("equal" if x == y else "floor is 0")
        print(f"  {what:32s} A-B {g(x, '.4g'):>10s}   A-A2 {g(y, '.4g'):>10s}   {ratio}")
    # Two ranks sum each gradient in another order than one rank does; so does one rank with
    # two micro-batches. Data parallelism is right when B is no farther from A than A2 is
    # (2x: the floor is a single sample of that noise). The elementwise bf16 tolerances above
    # are stricter than this noise on a GPU, where bf16 kernels round more than on CPU.
    within = (ab["identical_fraction"] >= aa2["identical_fraction"] - 0.02
              and all((x or 0.0) <= 2 * (y or 0.0) for x, y in (
                  (ab["weights_max_abs_diff"], aa2["weights_max_abs_diff"]),
                  (ab["training_update"]["rel_diff"], aa2["training_update"]["rel_diff"]),
                  (worst(ab), worst(aa2)))))
    print(f"  verdict: {'WITHIN' if within else 'BEYOND'} the summation-order floor (identical rollouts >= floor - 0.02, "
          "the rest <= 2x the floor)")

print("\n== b. prefill/decode")
for m in metrics("C"):
    print(f"  update {m['update']}: kv_transport {m.get('kv_transport')}, transfers {m.get('engine_kv_transfers')}, "
          f"bytes {m.get('engine_kv_transfer_bytes')}, logprob mismatch max {g(m.get('logprob_mismatch_max'))}")
print(f"  UCX_TLS used: {ucx or '(unset)'}")
verify = load(reports / "verify_dc.json")
if verify is None:
    print("  verify-resume --compare D C: no report")
else:
    print(f"  verify-resume --compare D C: {'BIT-IDENTICAL' if verify.get('identical') else 'DIFFERS'}"
          f"{'' if verify.get('identical') else ', first divergence ' + json.dumps(verify.get('first_divergence') or verify.get('error'))}")
    for c in verify.get("categories", []):
        print(f"    {c['name']}: {c['compared'] - c['differing']}/{c['compared']} identical")

print("\n== c. probe-ucx --devices 0 1")
probe = load(work / "probe.json.out")
if probe is None:
    print("  no probe document")
elif not probe.get("results"):
    print(f"  {probe.get('error', 'no results')}")
else:
    print(f"  memory {probe['memory']}, {probe['bytes'] >> 20} MiB × {probe['repeats']}")
    for r in probe["results"]:
        gbps = f"{r['gbps']:.2f} GB/s" if r.get("gbps") else ""
        print(f"  {r['label']:24s} {r['status']:24s} {gbps} {r.get('error') or ''}".rstrip())
    print(f"  recommended: {(probe.get('recommended') or {}).get('apply', 'none delivered')}")

print("\n== throughput (updates after the first; step without the final save; rollout tokens/s = all ranks' "
      "response tokens / rank 0's rollout time; C and D sample a smaller batch one sequence at a time)")
rows = {}
for run, what in (("A", "1 rank"), ("B", "2 ranks, data parallel"), ("D", "local, max-num-seqs 1"),
                  ("C", "PD 0→1, max-num-seqs 1")):
    if metrics(run):
        rows[run] = (what, throughput(Run(work / run)))
print(f"  {'run':3s} {'':24s} {'step_s':>8s} {'rollout tok/s':>14s} {'train tok/s':>12s}   vs A (rollout, train)")
for run, (what, t) in rows.items():
    ref = rows.get("A", (None, None))[1]
    ratios = ""
    if ref and ref["rollout_tok_s"] and t["rollout_tok_s"]:
        ratios = f"{t['rollout_tok_s'] / ref['rollout_tok_s']:.2f}x, {t['train_tok_s'] / ref['train_tok_s']:.2f}x"
    print(f"  {run:3s} {what:24s} {g(t['step_s'], '8.3f')} {g(t['rollout_tok_s'], '14.1f')} "
          f"{g(t['train_tok_s'], '12.1f')}   {ratios}")
if "C" in rows and "D" in rows and rows["D"][1]["rollout_tok_s"]:
    print(f"  C vs D rollout tokens/s: {rows['C'][1]['rollout_tok_s'] / rows['D'][1]['rollout_tok_s']:.2f}x")
# The averages above include each K's first compile (torch.compile, graph capture), which
# dominates on the tiny model; the last update is the closest to a steady state.
print("\n  last update alone (slowest rank): rollout s, train s")
for run in ("A", "A2", "B", "D", "C"):
    m = metrics(run)
    if m:
        last = m[-1]
        rollout = max(last.get("rank_rollout_s") or [last["rollout_s"]])
        train = max(last.get("rank_train_s") or [last["train_s"]])
        print(f"  {run:3s} update {last['update']}: rollout {rollout:.3f} s, train {train:.3f} s")
EOF
ls -la "$OUT"
echo "total $SECONDS s"

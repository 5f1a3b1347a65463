# Shared by the GPU lane's steps (sourced by tools/gpu/lane.sh): peak memory, the 4-GPU checkpoints,
# the nvidia-smi sampler, the peers steps' workload.

gpu_memory_log() {  # peak used memory per GPU while "$@" runs
  local log=$1; shift
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$log.smi" &
  local smi=$!
  "$@"; local rc=$?
  kill $smi 2>/dev/null
  python3 - "$log.smi" <<'PY' | tee -a "$log"
import sys, collections
peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    try:
        idx, used = (int(x) for x in line.split(","))
    except ValueError:
        continue
    peak[idx] = max(peak[idx], used)
print("peak GPU memory (MiB):", dict(peak))
PY
  return $rc
}

make_x4_models() {  # the 8B student's and 14B teacher's checkpoints at once on GPUs 0 and 1 (16 + 30 GB),
                   # if missing; the tokenizer is written last, so a directory a stopped call left
                   # half-written is made again
  local gpu shape
  for gpu in 0 1; do
    shape=qwen3-8b; [ $gpu = 1 ] && shape=qwen3-14b
    [ -f /tmp/models/$shape/tokenizer_config.json ] && continue
    CUDA_VISIBLE_DEVICES=$gpu python3 tools/make_model.py --force --shape $shape --out /tmp/models/$shape \
        --seed $((gpu + 1)) --device cuda > "$OUT/make_$shape.log" 2>&1 &
  done
  wait
}

start_smi_sampler() {  # every GPU's utilization and memory twice a second into $1, stamped with the epoch
                       # (step_table.py --smi); the sampler's pid in $sampler
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 \
      | while IFS= read -r line; do e=${EPOCHREALTIME:-$(date +%s.%N)}; echo "${e/,/.}, $line"; done > "$1" &
  sampler=$!
}

peers_workload() {  # the peers steps' pair and teacher (PAIR, TEACHER, as `opkd bench peers` takes them) in
                    # $pair and $teacher, and $v naming their logs and scratch folders apart
  pair=${PAIR:-0.6b:1.7b}; teacher=${TEACHER:-topk:64}; v=${pair/:/_from_}_${teacher/:/}
}

moe_fusions_opt() {  # MOE_FUSIONS value $1 -> $fopt, bench_models.py's flag for Megatron's fused permutation
                     # and router, and $fsuf, the runs' file-name suffix: auto (as opkd train: on where TE
                     # builds the model), 0 (off), 1 (on); exits on anything else
  case $1 in auto) fopt="--moe-fusions auto"; fsuf=;;
             0) fopt="--moe-fusions off"; fsuf=_unfused;;
             1) fopt="--moe-fusions on"; fsuf=_fused;;
             *) echo "MOE_FUSIONS: expected auto, 0 or 1, got $1"; exit 2;; esac
}

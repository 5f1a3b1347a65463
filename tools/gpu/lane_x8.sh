# The eight-GPU steps of tools/gpu/lane.sh (sourced by it): the 8B and 32B checkpoints, the train8 runs,
# the TP=4 sync.

make_x8_models() {  # the 8B student's and the 32B teacher's checkpoints (16 + 66 GB) at once on GPUs 0 and 1,
                    # if missing (the tokenizer is written last: a directory a stopped call left half-written
                    # is made again), under a lock: a step that needs them waits for the ones `models8` is
                    # making in the background. Fails, with the log's tail, if one is still missing after
  command -v flock > /dev/null || { echo "make_x8_models: flock (util-linux) is missing here"; return 1; }
  mkdir -p /tmp/models
  (
    flock 9
    gpu=0
    for shape in qwen3-8b qwen3-32b; do
      [ -f /tmp/models/$shape/tokenizer_config.json ] || CUDA_VISIBLE_DEVICES=$gpu \
          python3 tools/make_model.py --force --shape $shape --out /tmp/models/$shape --seed $((gpu + 1)) \
          --device cuda > /tmp/models/make_$shape.log 2>&1 &
      gpu=$((gpu + 1))
    done
    wait
  ) 9> /tmp/models/.x8.lock
  local shape missing=0
  for shape in qwen3-8b qwen3-32b; do
    [ -f /tmp/models/$shape/tokenizer_config.json ] && continue
    missing=1; echo "make_x8_models: /tmp/models/$shape was not made"; tail -n 20 /tmp/models/make_$shape.log
  done
  return $missing
}

smi_peak() {  # each GPU's peak used memory in a start_smi_sampler file: the whole run, start-up included
  python3 - "$1" <<'PY'
import collections, sys
peak = collections.defaultdict(float)
for line in open(sys.argv[1]):
    try:
        _, idx, _, used = (float(x) for x in line.split(","))
    except ValueError:
        continue
    peak[int(idx)] = max(peak[int(idx)], used / 1024)
print("peak GPU memory over the run (GiB, GPU 0 first):", " / ".join(f"{peak[i]:.1f}" for i in sorted(peak)))
PY
}

train8_torchrun() {  # NAME CONFIG RUN_DIR IN_STEP_TEACHER_DIR|"" [OVERRIDES...]: `opkd train` on 8 ranks,
                     # stopped TRAIN8_BUDGET s (540) after the lane step began ($SECONDS), then the step
                     # table (shares, tokens/s per GPU, MFU, each GPU's utilization and peak memory);
                     # logs $OUT/NAME.*
  local name=$1 config=$2 run=$3 teacher=$4 rc; shift 4
  local log="$OUT/$name" budget=$(( ${TRAIN8_BUDGET:-540} - SECONDS ))
  [ $budget -gt 60 ] || { echo "$name: $budget s left of TRAIN8_BUDGET, too few to start"; return 1; }
  start_smi_sampler "$log.smi"
  # --overwrite: a second call on a warm machine replaces the first one's run
  timeout -s INT -k 30 $budget python3 -m torch.distributed.run --nproc_per_node 8 -m opkd_mcore.cli train \
      --config "$config" --overwrite run.output_dir="$run" "$@" > "$log.log" 2>&1
  rc=$?
  kill $sampler 2>/dev/null
  echo "$name ended after $SECONDS s, exit $rc (124: stopped at TRAIN8_BUDGET)"
  smi_peak "$log.smi"
  # -p keeps the file's mtime: the end of the last step, where the table's utilization window ends
  cp -p "$run/metrics.jsonl" "${log}_metrics.jsonl" || { tail -n 40 "$log.log"; return 1; }
  [ $rc = 0 ] || tail -n 20 "$log.log"
  python3 tools/gpu/step_table.py "${log}_metrics.jsonl" --shares --gpus 8 --student /tmp/models/qwen3-8b \
      ${teacher:+--teacher "$teacher"} --smi "$log.smi" | tee "$log.table"
}

lane_x8() {  # lane.sh models8* / train8_* / e2e8 STEP [ARGS]
  case "$1" in
    models8)  # make_x8_models in the background, in a session of its own so that it outlives this call: the
              # next calls (the vLLM and Ray parts) are carried while the 8B and 32B checkpoints are written
              # (~3 minutes); the train8 steps wait for them (its lock). Log: /tmp/models/models8.log
      mkdir -p /tmp/models
      setsid bash "$0" models8_fg > /tmp/models/models8.log 2>&1 < /dev/null &
      sleep 3  # the call must not return before setsid has left this call's session
      if kill -0 $! 2>/dev/null; then
        echo "making /tmp/models/qwen3-8b and qwen3-32b in the background (pid $!)"
      else  # done already (both there) or failed
        cat /tmp/models/models8.log
        [ -f /tmp/models/qwen3-8b/tokenizer_config.json ] && [ -f /tmp/models/qwen3-32b/tokenizer_config.json ]
      fi ;;
    models8_fg)
      make_x8_models && ls -la /tmp/models ;;
    train8_served)  # 8 GPUs: configs/gpu_qwen3_8b_from_32b_x8.yaml: the Qwen3-32B-shaped teacher as an
                    # `opkd teacher-serve` server (device top-64, TP=4 on GPUs 4-7, 0.35 of each: started
                    # first on empty GPUs, stopped at the end), the Qwen3-8B-shaped student at TP=4 x DP=2 on
                    # all eight GPUs with its engine beside rank 0; checkpoints made first if missing; the
                    # server must answer within SERVE8_DEADLINE s (300) and the run stops TRAIN8_BUDGET s
                    # (540) after the step began
      SECONDS=0; t=${TAG:-}
      make_x8_models || exit 1
      echo "models ready after $SECONDS s"
      set -m  # the server in a process group of its own (still this call's session): one kill stops its workers
      CUDA_VISIBLE_DEVICES=4,5,6,7 python3 -m opkd_mcore.cli teacher-serve --model /tmp/models/qwen3-32b \
          --k 64 --tp 4 --port 8000 --max-model-len 512 --gpu-memory-utilization 0.35 \
          > "$OUT/train8_served${t}_server.log" 2>&1 < /dev/null &
      server=$!
      set +m
      until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/v1/models', timeout=2)" \
          2>/dev/null; do
        if ! kill -0 $server 2>/dev/null || [ $SECONDS -ge "${SERVE8_DEADLINE:-300}" ]; then
          echo "train8_served: the teacher server did not answer within $SECONDS s"
          tail -n 40 "$OUT/train8_served${t}_server.log"; kill -- -$server 2>/dev/null; exit 1
        fi
        sleep 5
      done
      echo "teacher server up after $SECONDS s"
      train8_torchrun "train8_served$t" configs/gpu_qwen3_8b_from_32b_x8.yaml /tmp/runs/t8s$t "" "${@:2}"
      rc=$?
      kill -- -$server 2>/dev/null  # GPUs 4-7 free for the next step
      exit $rc ;;
    train8_megatron)  # 8 GPUs: configs/gpu_qwen3_8b_from_32b_megatron_x8.yaml: the same student at TP=4 x PP=2
                      # with the dense Qwen3-32B-shaped Megatron teacher in its step (built on the same groups),
                      # the engine beside rank 0; budget and table as train8_served (MFU counts the teacher too)
      SECONDS=0; t=${TAG:-}
      make_x8_models || exit 1
      echo "models ready after $SECONDS s"
      train8_torchrun "train8_megatron$t" configs/gpu_qwen3_8b_from_32b_megatron_x8.yaml /tmp/runs/t8m$t \
          /tmp/models/qwen3-32b "${@:2}" ;;
    train8_ray)  # 8 GPUs under the Ray controller (Ray carried): configs/gpu_qwen3_8b_from_32b_ray_x8.yaml (the
                 # student at TP=4 on GPUs 0-3, two vLLM engines on GPUs 4-5, two Qwen3-32B-shaped vLLM teachers
                 # on GPUs 6-7; weights over one NCCL group), the schedules of SCHEDULES ("sync one_step_off
                 # async") one after the other on one set of actors (`opkd bench step --config`, RAY8_STEPS
                 # steps each, 4), stopped RAY8_BUDGET s (540) after the step began. Then the bench's table
                 # (overlap, waits) and the step table, a row per schedule (tokens/s per GPU over all eight)
      python3 -c "import ray" 2>/dev/null || { echo "train8_ray: Ray is not importable here: carry" \
          ".whl-ray/a and .whl-ray/b (bash tools/gpu/wheels.sh ray), one call each running" \
          "'bash tools/gpu/env.sh stash DIR', before the call that runs env.sh (tools/gpu/README.md)"; exit 1; }
      SECONDS=0; t=${TAG:-}; log="$OUT/train8_ray$t"
      make_x8_models || exit 1
      echo "models ready after $SECONDS s"
      read -r -a scheds <<< "${SCHEDULES:-sync one_step_off async}"
      mkdir -p /tmp/runs && runs=$(mktemp -d /tmp/runs/t8r$t.XXXX)  # fresh: a run refuses an earlier one's
      start_smi_sampler "$log.smi"
      timeout -s INT -k 30 $(( ${RAY8_BUDGET:-540} - SECONDS )) python3 tools/bench_step.py \
          --config configs/gpu_qwen3_8b_from_32b_ray_x8.yaml --out "$runs" --steps "${RAY8_STEPS:-4}" \
          --schedules "$(IFS=,; echo "${scheds[*]}")" --results "$OUT/results.jsonl" "${@:2}" > "$log.log" 2>&1
      rc=$?
      kill $sampler 2>/dev/null
      echo "bench ended after $SECONDS s, exit $rc (124: stopped at RAY8_BUDGET)"
      smi_peak "$log.smi"
      grep -E "^ *(schedule|sync|one_step_off|two_step_off|async) +\|" "$log.log"  # the bench's own table
      if [ $rc != 0 ]; then
        tail -n 30 "$log.log"
        # the actors' output stays in Ray's logs: a failed start's root cause is there
        (cd /tmp/ray/session_latest/logs 2>/dev/null && tail -n 60 worker-*.err > "${log}_ray_workers.err")
        # a bench stopped at its budget can leave actors and engine processes holding the GPUs
        pkill -9 -f '[r]aylet|[g]cs_server|[E]ngineCore|[r]ay::'
      fi
      metrics=()
      for s in "${scheds[@]}"; do  # -p keeps the mtime: the end of the schedule's last step
        cp -p "$runs/$s/metrics.jsonl" "${log}_${s}_metrics.jsonl" 2>/dev/null \
            && metrics+=("${log}_${s}_metrics.jsonl")
      done
      [ ${#metrics[@]} -gt 0 ] || exit 1
      python3 tools/gpu/step_table.py "${metrics[@]}" --shares --gpus 8 --student /tmp/models/qwen3-8b \
          --smi "$log.smi" | tee "$log.table" ;;
    e2e8)  # the 8-GPU runs' weight sync alone against a raw transfer of the same bytes (`e2e`, in the runs'
           # 512 MiB buckets): the TP=4 student on GPUs 0-3 into the engine on GPU 0 by device IPC (the path
           # of train8_served and train8_megatron) beside the raw IPC copy and the raw NCCL broadcast GPU 1 ->
           # GPU 0 (the Ray run's yardstick); E2E8_LAYOUTS="tp4-coloc tp4-disagg" adds the NCCL sync from
           # GPUs 4-7 (the Ray run's path, to one engine); ~5 minutes each
      make_x8_models || exit 1
      for layout in ${E2E8_LAYOUTS:-tp4-coloc}; do
        BUCKET_MB=${BUCKET_MB:-512} timeout 290 bash "$0" e2e qwen3-8b "$layout" "${@:2}"
      done ;;
    *) usage ;;
  esac
}

#!/usr/bin/env bash
# The GPU lane on a lent machine (after `eval "$(bash tools/gpu/env.sh)"`), one step per argument;
# logs and JSON go to $OUT (the device tool brings them back), figures into docs/benchmarks.md.
# tools/gpu/README.md is the runbook: which steps need which machine, carrying the wheels.
# The test suite's steps are in lane_tests.sh, the eight-GPU runs' in lane_x8.sh, shared helpers in
# lane_common.sh; this file dispatches to them and holds the rest.
#
#   bash tools/gpu/lane.sh tests          # pytest -m "gpu or vllm": every vLLM test CI runs on CPU, on CUDA
#                                         # (not the Ray-cluster tests: CPU bundles; `steps` is Ray on GPUs)
#   bash tools/gpu/lane.sh tests1         # the same in one-GPU parts, tests1 .. tests10, each for one
#                                         # 10-minute device call (the whole took ~15 min on an H100)
#   TESTS_DEADLINE=540 bash tools/gpu/lane.sh tests_pair   # what one GPU skips (2 GPUs; >9 minutes),
#                                         # or tests_pair1 .. tests_pair4, tests_aborts
#   bash tools/gpu/lane.sh tests_quad     # what two GPUs skip (4 ranks; nvidia-h100-x4)
#   bash tools/gpu/lane.sh tests_x4 a     # the GPU suite on 4 GPUs in five calls (a to e), parts side by
#                                         # side; tests_x2 a to k on 2 GPUs (tools/gpu/README.md lists them)
#   bash tools/gpu/lane.sh tests_on 0:tests6 1:tests5 2,3:tests_pair3+tests_pair4   # any parts, each job
#                                         # on its GPUs, a job's parts one after the other
#   bash tools/gpu/lane.sh models         # random-weight Qwen3-0.6B / 1.7B checkpoints in /tmp/models
#   bash tools/gpu/lane.sh train1         # opkd train on 1 GPU: vLLM teacher, then dense Megatron teacher
#   TAG=_off bash tools/gpu/lane.sh train1 loss.fused_lm_head=off   # the same with overrides, own log names
#   bash tools/gpu/lane.sh train1_hidden  # the same, the vLLM teacher sending hidden states (exact dense KD)
#   bash tools/gpu/lane.sh train1_self    # a self teacher against a Megatron teacher of the same checkpoint
#   bash tools/gpu/lane.sh train2         # the same with student TP=2 over 2 GPUs
#   bash tools/gpu/lane.sh demo           # opkd demo --device cuda
#   bash tools/gpu/lane.sh e2e qwen3-8b tp1-disagg   # weight sync Megatron -> vLLM vs raw (2 GPUs);
#                                         # BUCKET_MB=256 for other buckets (default 1024); more
#                                         # arguments go to the tool (TAG=_x names the logs apart)
#   bash tools/gpu/lane.sh e2e_all        # 1.7B and 8B tp1-disagg, 8B tp2-coloc, one after the other
#   bash tools/gpu/lane.sh e2e qwen3-8b tp2-disagg   # TP=2 student on GPUs 2, 3 (4 GPUs), engine on GPU 0
#   bash tools/gpu/lane.sh loss           # the loss inside a training step: time, share, memory
#   bash tools/gpu/lane.sh lm_head        # fused LM head + KD: GPU tests, then the benchmark
#   bash tools/gpu/lane.sh lm_head2       # the LM-head benchmark at TP=2 (2 GPUs)
#   bash tools/gpu/lane.sh moe            # MoE student at EP=2 (2 GPUs): SequentialMLP, torch and TE grouped
#                                         # experts side by side (MOE_EXPERTS=a,b to choose; te_grouped
#                                         # needs TE: ../shared/device/te-bundle.sh)
#   NPROC=4 bash tools/gpu/lane.sh moe    # the same at EP=4 (4 GPUs)
#   NPROC=4 MOE_ETP=2 MOE_EXPERTS=torch_grouped bash tools/gpu/lane.sh moe  # EP=2 x expert-TP=2 (4 GPUs)
#   MOE_EXPERTS=torch_grouped MOE_TOKENS=16384 MOE_BALANCED=1 bash tools/gpu/lane.sh moe  # balanced routing
#   MOE_EXPERTS=torch_grouped MOE_TOKENS=4096,16384 MOE_OVERLAP=0,distopt,1 bash tools/gpu/lane.sh moe
#                                         # tokens per rank x optimizer (replicated Adam state, distributed
#                                         # optimizer, + overlapped grad reduce / param gather), a row each
#   MOE_EXPERTS=torch_grouped MOE_TOKENS=16384 MOE_SEQ=16384 bash tools/gpu/lane.sh moe  # one micro-batch per rank
#   bash tools/gpu/lane.sh cp_long        # 32K tokens at CP=2 (GPUs 0-1), then 64K at CP=4 (4 GPUs); TE
#   bash tools/gpu/lane.sh memory_levers  # recompute none/selective/full (1 GPU), TP=2 with/without SP (2); TE
#   bash tools/gpu/lane.sh fusions        # the engine step with Megatron's fused SwiGLU / RoPE off and on (1 GPU)
#   bash tools/gpu/lane.sh steps          # the four Ray schedules (2 GPUs: student | rollout + teacher; Ray carried)
#   bash tools/gpu/lane.sh controller2    # the Ray controller's GPU test (2 GPUs, Ray carried)
#   bash tools/gpu/lane.sh steps1         # sync under Ray on 1 GPU, all colocated (controller.placement=colocated)
#   bash tools/gpu/lane.sh moe1           # the MoE student at EP=1 on 1 GPU (fewer layers)
#   bash tools/gpu/lane.sh rollout        # one rollout engine: in-process vs in a Ray actor, sleep on/off
#   bash tools/gpu/lane.sh rollout_graphs # the same engine in-process with CUDA graphs (enforce_eager=false)
#   bash tools/gpu/lane.sh rollout_ab     # the rollout engine's modes against vLLM built as TRL builds it
#                                         # (CUDA graphs, 32 x 4 x 256 tokens; 1 GPU, ~4 min; makes models)
#   bash tools/gpu/lane.sh teacher_device # in-process teacher: prompt_logprobs vs device top-k vs hidden
#   bash tools/gpu/lane.sh teacher_hidden # a served teacher: top-64 rows vs hidden states, bytes and tokens/s
#   bash tools/gpu/lane.sh train4         # 4 GPUs: Qwen3-8B-shaped student at TP=2 x PP=2, dense 14B Megatron
#                                         # teacher in the step; tokens/s per GPU, MFU, utilization, memory
#   bash tools/gpu/lane.sh train4_ray     # 4 GPUs, Ray carried: the same student disaggregated under the Ray
#                                         # controller (trainer GPUs 0-1, engine GPU 2, 14B vLLM teacher GPU 3),
#                                         # one_step_off; SCHEDULES="sync one_step_off" runs both, a row each;
#                                         # RAY4_LAYOUT=3+1 (auto on GPUs < 100 GiB): trainer PP=3, engine and
#                                         # teacher sharing GPU 3
#   bash tools/gpu/lane.sh e2e_moe        # expert weight sync of a Qwen3-30B-A3B-shaped student (8 layers)
#                                         # into vLLM vs raw, EP=1 then EP=2 (2 GPUs; MOE_LAYERS, MOE_LAYOUTS)
#   bash tools/gpu/lane.sh e2e_moe_sync   # e2e_moe's ep2-coloc alone, then the most layers vLLM held at
#                                         # once and the slowest bucket loads (wait vs load, per source)
#   bash tools/gpu/lane.sh train_moe      # opkd train, the same MoE student at EP=2 (2 GPUs; 8 layers on
#                                         # H200s, 4 on H100s unless MOE_LAYERS), rollout + teacher on GPU 0
#   bash tools/gpu/lane.sh train_moe_teacher  # opkd train, 0.6B student, the 8-layer 30B-A3B MoE teacher in
#                                         # its step (1 GPU, EP=1), then the dense 1.7B teacher in the step
#   bash tools/gpu/lane.sh peers_trl      # TRL's row beside opkd train's (0.6B <- 1.7B, top-64, 1 GPU, ~6 min;
#                                         # the peers' wheels installed first: tools/gpu/README.md): per step
#                                         # TRL's generate calls, sequences and response tokens (its notes)
#   bash tools/gpu/lane.sh peers_overlap1 # opkd train on one GPU, 0.6B <- 1.7B top-64: sync (torchrun) then
#                                         # one_step_off (Ray, colocated, the engine generating beside the
#                                         # trainer), a row each (Ray installed first; ~5 min)
#   bash tools/gpu/lane.sh peers_verl     # verl's row alone (0.6B <- 1.7B, top-64, 2 GPUs: trainer | teacher
#                                         # server; verl, Ray and the peers' wheels installed first; ~9 min:
#                                         # verl starts in ~7, so give it a call of its own)
#   bash tools/gpu/lane.sh train_stage    # the product's train stage alone against the engine's packed step
#                                         # on the same tokens (0.6B, 128 x <=256 + prompts, top-64, 16K per
#                                         # micro-batch; 1 GPU, makes the model), then profiler tables of both,
#                                         # then the rows again with expandable segments
#   bash tools/gpu/lane.sh models8        # 8 GPUs: the Qwen3-8B and Qwen3-32B shapes into /tmp/models in the
#                                         # background (outlives the call; the train8 steps wait for it)
#   bash tools/gpu/lane.sh train8_served  # 8 GPUs: student TP=4 x DP=2 on all eight, engine beside rank 0,
#                                         # the 32B teacher as a teacher-serve server (TP=4, GPUs 4-7, shared)
#   bash tools/gpu/lane.sh train8_megatron  # 8 GPUs: student and dense 32B Megatron teacher at TP=4 x PP=2
#   bash tools/gpu/lane.sh train8_ray     # 8 GPUs, Ray carried: trainer TP=4 (GPUs 0-3), two engines (4-5),
#                                         # two 32B vLLM teachers (6-7); sync, one_step_off, async side by
#                                         # side (opkd bench step --config; SCHEDULES picks); each train8 step
#                                         # prints the step table: stage shares, tokens/s and memory per GPU
#   bash tools/gpu/lane.sh e2e8           # the TP=4 student's sync alone against a raw IPC copy and NCCL
#                                         # broadcast of the same bytes (E2E8_LAYOUTS="tp4-coloc tp4-disagg")
#   bash tools/gpu/lane.sh pack           # last in a call: $OUT's logs and JSON as one out.tgz
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CFG=configs/gpu_qwen3_0.6b_from_1.7b.yaml

here=$(dirname "${BASH_SOURCE[0]}")
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
source "$here/lane_common.sh"
source "$here/lane_tests.sh"
source "$here/lane_x8.sh"

case "${1:-}" in
  tests|tests[0-9]|tests[0-9][0-9]|tests_*|controller2) lane_tests "$@" ;;
  models8|models8_fg|train8_*|e2e8) lane_x8 "$@" ;;
  e2e)  # e2e SHAPE LAYOUT: Megatron -> vLLM weight sync against the raw transfer (bench_weight_sync --e2e)
        # (an 8B run takes several minutes: engine start, loading 16 GB, raw transfer; give it >= 280 s)
    [ -d "/tmp/models/$2" ] || python3 tools/make_model.py --force --shape "$2" --out "/tmp/models/$2" --device cuda
    b=${BUCKET_MB:-1024}; log="$OUT/e2e_$2_$3_$b${TAG:-}"
    python3 tools/bench_weight_sync.py --e2e --shape "$2" --layout "$3" --model-dir "/tmp/models/$2" \
        --bucket-mb "$b" --iters 5 --json "$log.json" --results "$OUT/results.jsonl" "${@:4}" > "$log.log" 2>&1
    grep -A3 "^| layout" "$log.log" || grep "^e2e syncs done" "$log.log" || tail -20 "$log.log" ;;
  e2e_buckets)  # e2e SHAPE LAYOUT at several bucket sizes (BUCKETS, MiB; weight_sync.bucket_mb: 512):
        # the first bucket's pack (the head) and the last one's load (the tail) grow with the bucket;
        # a size listed twice runs twice, each run with its own logs (_r1, _r2, ...); more arguments go
        # to the tool (`--stream-priority normal` for the A/B of weight_sync.high_priority_stream)
    n=0
    for b in ${BUCKETS:-64 256 1024}; do
      n=$((n + 1))
      TAG="${TAG:-}_r$n" BUCKET_MB=$b timeout 200 bash "$0" e2e "${2:-qwen3-1.7b}" "${3:-tp1-disagg}" "${@:4}"
    done ;;
  e2e_all)  # the three end-to-end sync figures in one call (~6 minutes on two H200s, models made first)
    for run in "qwen3-1.7b tp1-disagg" "qwen3-8b tp1-disagg" "qwen3-8b tp2-coloc"; do
      timeout 280 bash "$0" e2e $run
    done ;;
  models)
    python3 tools/make_model.py --force --shape qwen3-0.6b --out /tmp/models/qwen3-0.6b --seed 1 --device cuda
    python3 tools/make_model.py --force --shape qwen3-1.7b --out /tmp/models/qwen3-1.7b --seed 2 --device cuda ;;
  train1)
    t=${TAG:-}
    gpu_memory_log "$OUT/train1_vllm$t.log" python3 -m opkd_mcore.cli train --config $CFG \
        run.output_dir=/tmp/runs/t1v$t "${@:2}" > "$OUT/train1_vllm$t.log" 2>&1
    cp /tmp/runs/t1v$t/metrics.jsonl "$OUT/train1_vllm${t}_metrics.jsonl"
    gpu_memory_log "$OUT/train1_megatron$t.log" python3 -m opkd_mcore.cli train --config $CFG \
        run.output_dir=/tmp/runs/t1m$t teacher.teachers.0.backend=megatron loss.support=null "${@:2}" \
        > "$OUT/train1_megatron$t.log" 2>&1
    cp /tmp/runs/t1m$t/metrics.jsonl "$OUT/train1_megatron${t}_metrics.jsonl" ;;
  train1_hidden)  # the in-process vLLM teacher sending final-norm hidden states: exact dense KD
    t=${TAG:-}
    gpu_memory_log "$OUT/train1_hidden$t.log" python3 -m opkd_mcore.cli train --config $CFG \
        run.output_dir=/tmp/runs/t1h$t teacher.teachers.0.output=hidden loss.support=null "${@:2}" \
        > "$OUT/train1_hidden$t.log" 2>&1
    cp /tmp/runs/t1h$t/metrics.jsonl "$OUT/train1_hidden${t}_metrics.jsonl" ;;
  train1_self)  # a self teacher (the student's current weights, one no-grad forward in the step) against
                # a separate Megatron teacher of the same checkpoint (a second copy of the weights)
    t=${TAG:-}
    for run in self megatron; do
      model=/tmp/models/qwen3-0.6b; [ $run = self ] && model=  # a self teacher is model.student
      gpu_memory_log "$OUT/train1_$run$t.log" python3 -m opkd_mcore.cli train --config $CFG \
          run.output_dir=/tmp/runs/t1s$run$t teacher.teachers.0.backend=$run \
          teacher.teachers.0.model=$model loss.support=null "${@:2}" > "$OUT/train1_$run$t.log" 2>&1
      cp /tmp/runs/t1s$run$t/metrics.jsonl "$OUT/train1_${run}${t}_metrics.jsonl"
    done ;;
  train2)  # the same two runs with student TP=2 over 2 GPUs (rollout engine and vLLM teacher on GPU 0)
    t=${TAG:-}
    run2=(python3 -m torch.distributed.run --nproc_per_node 2 -m opkd_mcore.cli train --config $CFG parallel.tp=2)
    gpu_memory_log "$OUT/train2_vllm$t.log" "${run2[@]}" run.output_dir=/tmp/runs/t2v$t "${@:2}" \
        > "$OUT/train2_vllm$t.log" 2>&1
    cp /tmp/runs/t2v$t/metrics.jsonl "$OUT/train2_vllm${t}_metrics.jsonl"
    gpu_memory_log "$OUT/train2_megatron$t.log" "${run2[@]}" run.output_dir=/tmp/runs/t2m$t \
        teacher.teachers.0.backend=megatron loss.support=null "${@:2}" > "$OUT/train2_megatron$t.log" 2>&1
    cp /tmp/runs/t2m$t/metrics.jsonl "$OUT/train2_megatron${t}_metrics.jsonl" ;;
  demo)
    start=$(date +%s)
    python3 -m opkd_mcore.cli demo --device cuda --out /tmp/runs/demo "${@:2}" > "$OUT/demo.log" 2>&1
    echo "demo wall time $(( $(date +%s) - start )) s" | tee -a "$OUT/demo.log"
    cp /tmp/runs/demo/summary.json "$OUT/demo_summary.json" ;;
  loss)  # the loss inside a real training step: fused vs reference, top-64 and dense teachers
    python3 tools/bench_train_step.py --shape qwen3-0.6b --tokens 8192 --k 64 --out "$OUT/step_loss_topk.json" \
        --results "$OUT/results.jsonl" 2>&1 | tee "$OUT/step_loss_topk.log" | grep "^|"
    python3 tools/bench_train_step.py --shape qwen3-0.6b --tokens 8192 --k 0 --out "$OUT/step_loss_dense.json" \
        --results "$OUT/results.jsonl" 2>&1 | tee "$OUT/step_loss_dense.log" | grep "^|" ;;
  lm_head)  # the fused LM head + KD kernels: correctness on the GPU first, then the benchmark
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_linear_kd_gpu.py 2>&1 \
        | tee "$OUT/lm_head_tests.log" | tail -5
    python3 tools/bench_kernels.py --mode lm_head --out "$OUT/lm_head_tp1.json" --results "$OUT/results.jsonl" "${@:2}" \
        > "$OUT/lm_head_tp1.log" 2>&1
    tail -45 "$OUT/lm_head_tp1.log" ;;
  lm_head2)
    python3 -m torch.distributed.run --nproc_per_node 2 tools/bench_kernels.py --mode lm_head \
        --out "$OUT/lm_head_tp2.json" --results "$OUT/results.jsonl" > "$OUT/lm_head_tp2.log" 2>&1
    tail -45 "$OUT/lm_head_tp2.log" ;;
  moe)  # a Qwen3-30B-A3B-shaped MoE student with fewer layers at EP=2 (2 GPUs; EP=4 with NPROC=4), one
        # process per experts implementation (a process's allocator keeps its cache: a peak measured after
        # another model would include it); PROFILE=1 traces one more step into $OUT/moe<N>_profile_<impl>.txt
        # MOE_TOKENS (tokens per rank, 4096) and MOE_OVERLAP (0: Adam state replicated over DP; distopt: the
        # distributed optimizer; 1: it with its DP collectives overlapped) take lists: a process per value;
        # MOE_BALANCED=1: Megatron's forced load balancing (a trained router's loads, not a random one's);
        # MOE_ETP=N splits each expert over N expert-TP ranks (EP = NPROC / N); MOE_SEQ: tokens per
        # micro-batch (4096; MOE_TOKENS a multiple of it): the dispatcher's per-layer host syncs come per
        # micro-batch; MOE_FUSIONS (auto; "0,1" side by side): Megatron's fused permutation and router (TE)
    n=${NPROC:-2}; bal=${MOE_BALANCED:+--balanced-routing}; etp=${MOE_ETP:+--etp $MOE_ETP}
    for impl in $(echo "${MOE_EXPERTS:-sequential,torch_grouped,te_grouped}" | tr , ' '); do
     for tok in $(echo "${MOE_TOKENS:-4096}" | tr , ' '); do
      for ov in $(echo "${MOE_OVERLAP:-0}" | tr , ' '); do
       for fus in $(echo "${MOE_FUSIONS:-auto}" | tr , ' '); do
        case $ov in 0) opt=;; distopt) opt=--distributed-optimizer;; 1) opt=--overlap;;
                    *) echo "MOE_OVERLAP: expected 0, distopt or 1, got $ov"; exit 2;; esac
        moe_fusions_opt "$fus"
        v=; [ "$tok" = 4096 ] && [ "$ov" = 0 ] || v="_t${tok}_o$ov"  # the default run keeps its file names
        v=$v${bal:+_balanced}${MOE_ETP:+_etp$MOE_ETP}${MOE_SEQ:+_s$MOE_SEQ}$fsuf
        python3 -m torch.distributed.run --standalone --nproc_per_node "$n" tools/bench_models.py --moe \
            --layers 8 --seq "${MOE_SEQ:-4096}" --tokens-per-rank "$tok" $opt $bal $etp $fopt --moe-experts "$impl" \
            ${PROFILE:+--profile "$OUT/moe${n}${v}_profile"} --out "$OUT/moe${n}${v}_$impl.json" \
            --results "$OUT/results.jsonl" > "$OUT/moe${n}${v}_$impl.log" 2>&1
        grep "^| [a-zA-Z]" "$OUT/moe${n}${v}_$impl.log" | tail -1 || tail -20 "$OUT/moe${n}${v}_$impl.log"
       done
      done
     done
    done ;;
  moe1)  # the same MoE student at EP=1 on one GPU: half the layers, to fit its optimizer state;
         # MOE_FUSIONS, MOE_TOKENS (micro-batches of 4096 per step) and PROFILE as for moe, a process per value
    for tok in $(echo "${MOE_TOKENS:-4096}" | tr , ' '); do
     for fus in $(echo "${MOE_FUSIONS:-auto}" | tr , ' '); do
      moe_fusions_opt "$fus"; f=$OUT/moe1$fsuf; [ "$tok" = 4096 ] || f=${f}_t$tok
      python3 -m torch.distributed.run --nproc_per_node 1 tools/bench_models.py --moe --layers 4 --seq 4096 \
          --tokens-per-rank "$tok" --moe-experts "${MOE_EXPERTS:-sequential,torch_grouped,te_grouped}" $fopt \
          ${PROFILE:+--profile "${f}_profile"} --out "$f.json" --results "$OUT/results.jsonl" > "$f.log" 2>&1
      grep "^|" "$f.log" || tail -20 "$f.log"
     done
    done ;;
  steps1)  # bench_step on one GPU: trainer rank, rollout engine and teacher share it (colocated: sync only)
    python3 tools/bench_step.py --student /tmp/models/qwen3-0.6b --teacher /tmp/models/qwen3-1.7b \
        --teacher-backend vllm --prompts 32 --n 4 --max-new-tokens 256 --micro-batch 16 --params-dtype bfloat16 --steps 6 --gpu-memory-utilization 0.2 \
        --schedules sync \
        --json "$OUT/bench_step1.json" --results "$OUT/results.jsonl" controller.placement=colocated "${@:2}" > "$OUT/bench_step1.log" 2>&1
    tail -6 "$OUT/bench_step1.log" ;;
  rollout)  # one rollout engine in-process vs inside a Ray actor, sleep mode off/on (needs `models`, Ray)
    python3 tools/bench_rollout.py --model /tmp/models/qwen3-0.6b --json "$OUT/bench_rollout.json" \
        --results "$OUT/results.jsonl" "${@:2}" \
        > "$OUT/bench_rollout.log" 2>&1; grep "^|" "$OUT/bench_rollout.log" || tail -20 "$OUT/bench_rollout.log"
    pkill -9 -f '[r]aylet|[g]cs_server|[E]ngineCore' ;;
  rollout_graphs)  # the same engine with CUDA graphs captured (rollout.enforce_eager=false), in-process
    python3 tools/bench_rollout.py --model /tmp/models/qwen3-0.6b --modes inprocess,inprocess_sleep --cuda-graphs \
        --json "$OUT/bench_rollout_graphs.json" --results "$OUT/results.jsonl" "${@:2}" > "$OUT/bench_rollout_graphs.log" 2>&1
    grep -E "^\||per call" "$OUT/bench_rollout_graphs.log" || tail -20 "$OUT/bench_rollout_graphs.log" ;;
  teacher_device)  # the in-process teacher's stage on the GPU step's tokens (128 x 268, 1.7B, top-64):
                   # prompt_logprobs vs top-k on the device vs hidden states, one engine at a time
    python3 tools/bench_teacher.py --model /tmp/models/qwen3-1.7b --dtype bfloat16 --ks 64 --num-seqs 128 \
        --seq-len 268 --skip-remote --gpu-memory-utilization 0.3 --out "$OUT/bench_teacher_device.json" \
        --results "$OUT/results.jsonl" > "$OUT/bench_teacher_device.log" 2>&1
    tail -8 "$OUT/bench_teacher_device.log" ;;
  teacher_hidden)  # a served teacher: top-64 rows vs final-norm hidden states (exact dense KD), needs `models`
    python3 tools/bench_teacher.py --model /tmp/models/qwen3-1.7b --ks 64 --hidden --skip-inprocess \
        --out "$OUT/bench_teacher_hidden.json" --results "$OUT/results.jsonl" > "$OUT/bench_teacher_hidden.log" 2>&1
    grep "^|" "$OUT/bench_teacher_hidden.log" || tail -20 "$OUT/bench_teacher_hidden.log" ;;
  steps)  # bench_step on the models of `models`: needs Ray (tools/gpu/wheels.sh ray)
    python3 tools/bench_step.py --student /tmp/models/qwen3-0.6b --teacher /tmp/models/qwen3-1.7b \
        --teacher-backend vllm --teachers-with-rollout --prompts 32 --n 4 --max-new-tokens 256 --micro-batch 16 --params-dtype bfloat16 --steps 5 \
        --json "$OUT/bench_step.json" --results "$OUT/results.jsonl" rollout.enforce_eager=false "${@:2}" > "$OUT/bench_step.log" 2>&1
    tail -6 "$OUT/bench_step.log"
    # the tool keeps actors' output off the driver: a failed start's root cause is in their logs
    [ -s "$OUT/bench_step.json" ] || (cd /tmp/ray/session_latest/logs && tail -n 60 worker-*.err > "$OUT/ray_workers.err")
    pkill -9 -f '[r]aylet|[g]cs_server|[E]ngineCore|[r]ay::' ;;  # a timed-out run leaves Ray holding GPUs
  cp_long)  # long responses under context parallelism (TE): one 32K-token sequence at CP=2 on GPUs 0-1,
            # then 64K at CP=4 on 4 GPUs (qwen3-1.7b student, top-64 teacher, fused loss, Adam);
            # CP_RUNS="CP:TOKENS ..." picks the runs
    for run in ${CP_RUNS:-2:32768 4:65536}; do
      set -- ${run%%:*} ${run#*:}
      python3 -m torch.distributed.run --standalone --nproc_per_node "$1" tools/bench_train_step.py \
          --shape "${SHAPE:-qwen3-1.7b}" --cp "$1" --seq-len "$2" --impls fused --iters 3 \
          --out "$OUT/cp$1_$2.json" --results "$OUT/results.jsonl" > "$OUT/cp$1_$2.log" 2>&1
      grep -B1 -A3 "^| loss impl" "$OUT/cp$1_$2.log" || tail -20 "$OUT/cp$1_$2.log"
    done ;;
  memory_levers)  # peak memory against step time: recompute none / selective / full on one GPU, then TP=2
                  # without and with sequence parallelism (TE) on two (qwen3-1.7b, 16K tokens, fused loss);
                  # LEVER_RUNS="GPUS:RECOMPUTE[:sp] ..." picks the runs
    for run in ${LEVER_RUNS:-1:none 1:selective 1:full 2:none 2:none:sp}; do
      IFS=: read -r n recompute sp <<< "$run"
      tag="tp${n}_$recompute${sp:+_sp}"
      python3 -m torch.distributed.run --standalone --nproc_per_node "$n" tools/bench_train_step.py \
          --shape "${SHAPE:-qwen3-1.7b}" --tokens 16384 --seq 256 --recompute "$recompute" \
          ${sp:+--sequence-parallel} --impls fused --iters 3 --out "$OUT/levers_$tag.json" \
          --results "$OUT/results.jsonl" > "$OUT/levers_$tag.log" 2>&1
      grep -A2 "^| loss impl" "$OUT/levers_$tag.log" | tail -1 | sed "s/^/$tag /" || tail -5 "$OUT/levers_$tag.log"
    done ;;
  fusions)  # the engine's packed step with Megatron's fused SwiGLU and fused RoPE off and on (on: opkd's
            # build where TE is installed)
    for f in off on; do
      python3 tools/bench_train_step.py --shape "${SHAPE:-qwen3-0.6b}" --tokens 16384 --seq 256 --k 64 --impls fused \
          --iters 5 --fusions $f --out "$OUT/fusions_$f.json" --results "$OUT/results.jsonl" > "$OUT/fusions_$f.log" 2>&1
      grep -A2 "^| loss impl" "$OUT/fusions_$f.log" | tail -1 | sed "s/^/fusions $f /" || tail -5 "$OUT/fusions_$f.log"
    done ;;
  train4)  # 4 GPUs: configs/gpu_qwen3_8b_from_14b_x4.yaml (the student at TP=2 x PP=2, the dense
           # Qwen3-14B-shaped Megatron teacher in its step, the engine beside rank 0), its checkpoints
           # made first if missing; the run stops at TRAIN4_BUDGET s (540) from the step's start, so its
           # figures come back within one call. Then the step table, per GPU: tokens/s, MFU,
           # utilization and peak memory
    SECONDS=0; t=${TAG:-}; log="$OUT/train4$t"
    make_x4_models
    echo "models ready after $SECONDS s"
    start_smi_sampler "$log.smi"
    gpu_memory_log "$log.log" timeout -s INT -k 30 $(( ${TRAIN4_BUDGET:-540} - SECONDS )) \
        python3 -m torch.distributed.run --nproc_per_node 4 -m opkd_mcore.cli train \
        --config configs/gpu_qwen3_8b_from_14b_x4.yaml --overwrite run.output_dir=/tmp/runs/t4$t "${@:2}" \
        > "$log.log" 2>&1  # --overwrite: a second call on a warm machine replaces the first one's run
    kill $sampler 2>/dev/null
    echo "run ended after $SECONDS s"
    grep "peak GPU memory" "$log.log" | tail -n 1
    # -p keeps the file's mtime: the end of the last step, where the table's utilization window ends
    cp -p /tmp/runs/t4$t/metrics.jsonl "${log}_metrics.jsonl" || { tail -n 40 "$log.log"; exit 1; }
    python3 tools/gpu/step_table.py "${log}_metrics.jsonl" --gpus 4 --student /tmp/models/qwen3-8b \
        --teacher /tmp/models/qwen3-14b --smi "$log.smi" | tee "$log.table" ;;
  rollout_ab)  # one engine at a time, each in a process of its own: TRL's vLLM settings, then ours and
               # each difference alone (seeding, engine core in-process, detokenizing, V2 model runner)
    [ -f /tmp/models/qwen3-0.6b/config.json ] || bash "$0" models > "$OUT/models.log" 2>&1
    python3 tools/bench_rollout.py --model /tmp/models/qwen3-0.6b --modes ab --cuda-graphs \
        --json "$OUT/bench_rollout_ab.json" --results "$OUT/results.jsonl" "${@:2}" \
        > "$OUT/bench_rollout_ab.log" 2>&1
    grep -E "^\||per call" "$OUT/bench_rollout_ab.log" || tail -20 "$OUT/bench_rollout_ab.log" ;;
  e2e_moe)  # expert weight sync into vLLM's fused-MoE tensors against a raw broadcast of the same bytes
            # (2 GPUs): a Qwen3-30B-A3B-shaped checkpoint with MOE_LAYERS (8) of its 48 layers (made in
            # /tmp/models if missing), tp1-disagg (EP=1 trainer on GPU 1, engine on GPU 0) then ep2-coloc
            # (experts split over GPUs 0 and 1, engine on GPU 0); MOE_LAYOUTS to choose, extra arguments
            # go to the tool; ~5 minutes on two H100s with the model made
    l=${MOE_LAYERS:-8}; m=/tmp/models/qwen3-30b-a3b-${l}l
    [ -d "$m" ] || python3 tools/make_model.py --force --shape qwen3-30b-a3b --layers "$l" --out "$m" --device cuda
    for layout in ${MOE_LAYOUTS:-tp1-disagg ep2-coloc}; do
      log="$OUT/e2e_moe${l}l_$layout${TAG:-}"
      timeout 270 python3 tools/bench_weight_sync.py --e2e --shape qwen3-30b-a3b --layout "$layout" \
          --model-dir "$m" --bucket-mb "${BUCKET_MB:-1024}" --iters 5 --json "$log.json" \
          --results "$OUT/results.jsonl" "${@:2}" > "$log.log" 2>&1
      grep -A2 "^| layout" "$log.log" || grep "^e2e syncs done" "$log.log" || tail -20 "$log.log"
    done ;;
  train_moe)  # opkd train with the MoE student at EP=2 (2 GPUs; configs/gpu_qwen3_30b_a3b_from_1.7b.yaml):
              # Qwen3-30B-A3B-shaped with MOE_LAYERS of its 48 layers (default 8 where GPU 0 has >= 100 GiB,
              # else 4: the 8-layer student's state plus both engines on rank 0 exceed an 80 GB H100), the
              # rollout engine and the 1.7B vLLM teacher (top-64) on GPU 0; models made if missing
    t=${TAG:-}; big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
    l=${MOE_LAYERS:-$([ "${big:-0}" -ge 102400 ] && echo 8 || echo 4)}; m=/tmp/models/qwen3-30b-a3b-${l}l
    [ -d "$m" ] || python3 tools/make_model.py --force --shape qwen3-30b-a3b --layers "$l" --out "$m" --device cuda
    [ -d /tmp/models/qwen3-1.7b ] || \
        python3 tools/make_model.py --force --shape qwen3-1.7b --out /tmp/models/qwen3-1.7b --seed 2 --device cuda
    echo "MoE student: $m ($l layers; GPU 0 has $big MiB)" | tee "$OUT/train_moe$t.info"
    gpu_memory_log "$OUT/train_moe$t.log" python3 -m torch.distributed.run --nproc_per_node 2 \
        -m opkd_mcore.cli train --config configs/gpu_qwen3_30b_a3b_from_1.7b.yaml model.student="$m" \
        run.output_dir=/tmp/runs/tmoe$t "${@:2}" > "$OUT/train_moe$t.log" 2>&1
    cp /tmp/runs/tmoe$t/metrics.jsonl "$OUT/train_moe${t}_metrics.jsonl" && \
        python3 tools/gpu/step_table.py "$OUT/train_moe${t}_metrics.jsonl" || tail -30 "$OUT/train_moe$t.log"
    grep "peak GPU memory" "$OUT/train_moe$t.log" ;;
  peers_trl)  # opkd bench peers, TRL then opkd train on one GPU; the table's notes say how many generate
              # calls and sequences each TRL step made, and its response tokens beside opkd's where they differ
              # (PAIR, 0.6b:1.7b, and TEACHER, topk:64, as `opkd bench peers` takes them)
    PYTHONPATH=/tmp/site-trl:$PYTHONPATH python3 -c "import trl" 2>/dev/null || { echo "trl is not" \
        "importable from /tmp/site-trl: install the peers' wheels (tools/gpu/README.md, Against other" \
        "trainers)"; exit 1; }
    peers_workload
    python3 -m opkd_mcore.cli bench peers --runners trl,opkd --pairs "$pair" --teacher "$teacher" --gpus 1 \
        --make-models --trl-path /tmp/site-trl --timeout 280 --out "/tmp/peers_trl_$v" \
        --results "$OUT/results.jsonl" "${@:2}" > "$OUT/bench_peers_trl_$v.log" 2>&1
    cp /tmp/peers_trl_"$v"/*_1gpu/trl/steps.jsonl "$OUT/peers_trl_${v}_steps.jsonl" 2>/dev/null
    grep -E "^\|" "$OUT/bench_peers_trl_$v.log" || tail -30 "$OUT/bench_peers_trl_$v.log" ;;
  peers_overlap1)  # one GPU: opkd train on-policy, then generating step t+1 beside step t's training
                   # (SCHEDULES picks them: "sync one_step_off", each ~3-4 minutes for the 0.6B pair;
                   # PAIR, 0.6b:1.7b, and TEACHER, topk:64, as `opkd bench peers` takes them)
    peers_workload
    for schedule in ${SCHEDULES:-sync one_step_off}; do
        python3 -m opkd_mcore.cli bench peers --runners opkd --pairs "$pair" --teacher "$teacher" --gpus 1 \
            --make-models --set "schedule=$schedule" --timeout 240 --out "/tmp/peers_overlap1_${v}_$schedule" \
            --results "$OUT/results.jsonl" "${@:2}" > "$OUT/peers_overlap1_${v}_$schedule.log" 2>&1
        grep -E "^\|" "$OUT/peers_overlap1_${v}_$schedule.log" || tail -30 "$OUT/peers_overlap1_${v}_$schedule.log"
    done ;;
  e2e_moe_sync)  # the EP=2 expert sync alone (e2e_moe's ep2-coloc, 2 GPUs, MOE_LAYERS), then from its log
                 # the phases (layers_in_flight_max, held_copy_s, load_s, recv_wait_s) and the buckets
                 # that took longest to load (source, bucket, wait s, load s): the per-expert loaders' cost
    MOE_LAYOUTS=ep2-coloc bash "$0" e2e_moe "${@:2}"
    grep -hE "^host seconds by phase|^slowest bucket loads" \
        "$OUT/e2e_moe${MOE_LAYERS:-8}l_ep2-coloc${TAG:-}.log" ;;
  train_moe_teacher)  # one GPU: the 0.6B student with an MoE teacher in its step (the Qwen3-30B-A3B shape with
                      # MOE_LAYERS of its layers, default 8; EP=1, the experts `auto` picks: grouped GEMMs),
                      # then the same run with the dense 1.7B Megatron teacher in the step; models made if missing
    t=${TAG:-}; l=${MOE_LAYERS:-8}; m=/tmp/models/qwen3-30b-a3b-${l}l
    [ -d "$m" ] || python3 tools/make_model.py --force --shape qwen3-30b-a3b --layers "$l" --out "$m" --device cuda
    for shape in qwen3-0.6b qwen3-1.7b; do
      [ -d /tmp/models/$shape ] || python3 tools/make_model.py --force --shape $shape --out /tmp/models/$shape --device cuda
    done
    for teacher in "$m" /tmp/models/qwen3-1.7b; do
      tag=$(basename "$teacher")
      gpu_memory_log "$OUT/train_teacher_$tag$t.log" python3 -m opkd_mcore.cli train --config $CFG \
          run.output_dir=/tmp/runs/tt_$tag$t teacher.teachers.0.backend=megatron teacher.teachers.0.model="$teacher" \
          loss.support=null "${@:2}" > "$OUT/train_teacher_$tag$t.log" 2>&1
      cp /tmp/runs/tt_$tag$t/metrics.jsonl "$OUT/train_teacher_$tag${t}_metrics.jsonl" || \
          tail -30 "$OUT/train_teacher_$tag$t.log"
    done
    python3 tools/gpu/step_table.py "$OUT"/train_teacher_*"${t}"_metrics.jsonl ;;
  train4_ray)  # 4 GPUs under the Ray controller: configs/gpu_qwen3_8b_from_14b_ray_x4.yaml (the train4
               # student at TP=2 on GPUs 0-1, its vLLM engine on GPU 2, the Qwen3-14B-shaped vLLM teacher,
               # top-64, on GPU 3; weights over an NCCL group), one `opkd train` per schedule of SCHEDULES
               # (one_step_off; "sync one_step_off" for both), each stopped at its share of RAY4_BUDGET s
               # (540) from the step's start. RAY4_LAYOUT: 2+1+1 (the config) where GPU 0 has >= 100 GiB,
               # else 3+1 (trainer at PP=3 on GPUs 0-2, engine and teacher sharing GPU 3: the config's
               # header has the arithmetic). Then one step table, a row per schedule: tokens/s per GPU over
               # the 4 GPUs, each GPU's utilization and peak memory (MFU: the student's FLOPs only, over 4)
    python3 -c "import ray" 2>/dev/null || { echo "train4_ray: Ray is not importable here: carry" \
        ".whl-ray/a and .whl-ray/b (bash tools/gpu/wheels.sh ray), one call each running" \
        "'bash tools/gpu/env.sh stash DIR', before the call that runs env.sh (tools/gpu/README.md)"; exit 1; }
    big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
    layout=${RAY4_LAYOUT:-$([ "${big:-0}" -ge 102400 ] && echo 2+1+1 || echo 3+1)}
    case $layout in
      2+1+1) lay=() ;;
      3+1) lay=(parallel.tp=1 parallel.pp=3 parallel.world_size=3 controller.teachers_with_rollout=true
                rollout.gpu_memory_utilization=0.45) ;;
      *) echo "RAY4_LAYOUT: expected 2+1+1 or 3+1, got $layout"; exit 2 ;;
    esac
    SECONDS=0; t=${TAG:-}
    make_x4_models
    echo "models ready after $SECONDS s; layout $layout (GPU 0 has $big MiB)" | tee "$OUT/train4_ray$t.info"
    start_smi_sampler "$OUT/train4_ray$t.smi"
    read -r -a scheds <<< "${SCHEDULES:-one_step_off}"
    metrics=()
    for i in "${!scheds[@]}"; do
      s=${scheds[$i]}; log="$OUT/train4_ray_$s$t"
      budget=$(( (${RAY4_BUDGET:-540} - SECONDS) / (${#scheds[@]} - i) ))
      gpu_memory_log "$log.log" timeout -s INT -k 30 "$budget" python3 -m opkd_mcore.cli train \
          --config configs/gpu_qwen3_8b_from_14b_ray_x4.yaml --overwrite run.output_dir=/tmp/runs/t4r_$s$t \
          run.schedule="$s" "${lay[@]}" "${@:2}" > "$log.log" 2>&1
      rc=$?
      echo "$s ($layout) ended (exit $rc) after $SECONDS s: $(grep "peak GPU memory" "$log.log" | tail -n 1)"
      if [ $rc != 0 ]; then  # 124: stopped at its budget; the steps it finished still make a row
        tail -n 30 "$log.log"
        # the actors' output stays in Ray's logs: a failed start's root cause is there
        (cd /tmp/ray/session_latest/logs 2>/dev/null && tail -n 60 worker-*.err > "${log}_ray_workers.err")
      fi
      # a run stopped at its budget can leave actors and engine processes holding the GPUs
      pkill -9 -f '[r]aylet|[g]cs_server|[E]ngineCore|[r]ay::'; sleep 3
      # -p keeps the mtime: the end of the last step, where the table's utilization window ends
      cp -p "/tmp/runs/t4r_$s$t/metrics.jsonl" "${log}_metrics.jsonl" 2>/dev/null \
          && metrics+=("${log}_metrics.jsonl")
    done
    kill $sampler 2>/dev/null
    [ ${#metrics[@]} -gt 0 ] || exit 1
    python3 tools/gpu/step_table.py "${metrics[@]}" --gpus 4 --student /tmp/models/qwen3-8b \
        --smi "$OUT/train4_ray$t.smi" | tee "$OUT/train4_ray$t.table" ;;
  peers_verl)  # opkd bench peers, verl alone on 2 GPUs (sdpa attention: the machine has no flash-attn);
               # its log's tail, verl's own metrics and the step rows come back
    python3 -c "import verl, ray" 2>/dev/null || { echo "verl or ray is not importable: install the" \
        "peers' and Ray's wheels (tools/gpu/README.md, Against other trainers)"; exit 1; }
    d=/tmp/peers_verl/0.6b_from_1.7b_top-64_2gpu/verl
    python3 -m opkd_mcore.cli bench peers --runners verl --pairs 0.6b:1.7b --teacher topk:64 --gpus 2 \
        --make-models --timeout 570 --out /tmp/peers_verl --results "$OUT/results.jsonl" "${@:2}" \
        > "$OUT/bench_peers_verl.log" 2>&1
    cp "$d/verl.log" "$OUT/peers_verl_run.log" 2>/dev/null
    cp "$d/verl_metrics.jsonl" "$OUT/peers_verl_metrics.jsonl" 2>/dev/null
    cp "$d/steps.jsonl" "$OUT/peers_verl_steps.jsonl" 2>/dev/null
    grep -E "^\|" "$OUT/bench_peers_verl.log" || tail -40 "$OUT/bench_peers_verl.log" ;;
  train_stage)  # train_stage on fresh / the same samples vs engine.train_step on the same micro-batches
    [ -f /tmp/models/qwen3-0.6b/config.json ] || python3 tools/make_model.py --force --shape qwen3-0.6b \
        --out /tmp/models/qwen3-0.6b --seed 1 --device cuda > "$OUT/train_stage_model.log" 2>&1
    python3 tools/bench_train_stage.py --model /tmp/models/qwen3-0.6b --profile \
        --results "$OUT/results.jsonl" > "$OUT/train_stage.log" 2>&1 \
        || { tail -n 40 "$OUT/train_stage.log"; exit 1; }
    grep -B1 -A5 "^| row " "$OUT/train_stage.log"
    # the same rows with expandable segments (no vLLM sleep mode shares this process): what new shapes
    # cost the caching allocator
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 tools/bench_train_stage.py \
        --model /tmp/models/qwen3-0.6b --results "$OUT/results.jsonl" > "$OUT/train_stage_expandable.log" 2>&1 \
        || { tail -n 40 "$OUT/train_stage_expandable.log"; exit 1; }
    grep -B1 -A5 "^| row " "$OUT/train_stage_expandable.log" ;;
  pack)  # a call's last step: $OUT's logs and JSON moved into one $OUT/out.tgz (the device tool brings back
         # at most 8 files, 2 folders down); checkpoints and weights are left where they are, not archived
    # a second pack in the same call writes out1.tgz beside the first, never over it
    name=out$(find "$OUT" -maxdepth 1 -name 'out*.tgz' | wc -l | sed 's/^0$//').tgz
    (cd "$OUT" && find . -type f ! -name '*.safetensors' ! -name '*.pt' ! -name '*.distcp' ! -name 'out*.tgz' \
        -print0 | tar czf "/tmp/$name" --null -T - --remove-files) \
        && find "$OUT" -mindepth 1 -type d -empty -delete && mv "/tmp/$name" "$OUT/" && ls -lR "$OUT" ;;
  *) usage ;;
esac

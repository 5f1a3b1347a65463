# The GPU test suite's steps of tools/gpu/lane.sh (sourced by it): `tests`, its parts, their layouts.

lane_tests() {  # lane.sh tests* / controller2 STEP [ARGS]
  case "$1" in
    tests)
      targets=("${@:2}"); [ ${#targets[@]} -eq 0 ] && targets=(tests/)
      # SIGINT at the deadline: pytest then still prints its summary of the failures so far; each test's
      # outcome on a line of its own (-v) keeps what ran in the log of a call killed before the summary;
      # COLLECT_ONLY=1 lists what a step would run (`pytest -m runbook`: the parts cover the whole suite)
      verbosity=-v; [ -n "${COLLECT_ONLY:-}" ] && verbosity=-q
      timeout -s INT -k 20 "${TESTS_DEADLINE:-3000}" \
      python3 -m pytest "$verbosity" -p no:cacheprovider -m "gpu or vllm" --timeout 900 \
          -rfEs --tb=short "${targets[@]}" ${COLLECT_ONLY:+--collect-only} \
          --ignore-glob 'tests/test_controller_*' 2>&1 | tee "$OUT/tests.log" ;;
    tests1)  # one GPU: demo, fused LM head, kernels, models (~450 s on an H200 with TE)
      bash "$0" tests tests/test_demo.py tests/test_fused_linear_kd_gpu.py tests/test_fused_linear_kd_served.py \
          tests/test_kernels_gpu.py tests/test_models_gpu.py tests/test_models_grouped_experts_gpu.py \
          tests/test_models_moe_e2e.py ;;
    tests6)  # one GPU: the rollout engine (sampling, seeds, engine modes)
      bash "$0" tests tests/test_rollout_vllm.py tests/test_rollout_engine_modes.py ;;
    tests2)
      bash "$0" tests tests/test_teacher_vllm.py tests/test_teacher_remote.py ;;
    tests5)  # one GPU: the device top-k teacher and its server, the self teacher (2-GPU cases: tests_pair6)
      bash "$0" tests tests/test_teacher_device_topk.py tests/test_teacher_score_server.py tests/test_self_teacher.py ;;
    tests7)  # one GPU: the self- and cross-tokenizer demos (225 s on an H200 with TE)
      bash "$0" tests tests/test_demo_self_distill.py tests/test_demo_cross_tokenizer.py ;;
    tests8)  # one GPU: the served cross-tokenizer teacher, `opkd teacher-serve`'s route (292 s on an H200
             # with TE): a server and three engines start one at a time (vLLM's start-up measures the
             # device's free memory)
      bash "$0" tests tests/test_cross_tokenizer_served.py -k device ;;
    tests9)  # one GPU: the same through the stock `vllm serve` (prompt_logprobs route)
      bash "$0" tests tests/test_cross_tokenizer_served.py -k prompt_logprobs ;;
    tests10)  # one GPU: the peers harness's `opkd train` runner, sync and one_step_off (Ray, colocated)
      bash "$0" tests tests/test_bench_peers.py ;;
    tests_pair)  # the tests that one GPU skips (2 ranks: Megatron-student weight-sync layouts, EP=2, TP/PP=2 train)
      bash "$0" tests tests/test_weight_sync_vllm.py tests/test_weight_sync_moe.py tests/test_models_moe_e2e.py \
          tests/test_train_resume.py tests/test_train_integration.py tests/test_models_moe_train.py \
          tests/test_weight_sync_abort_gpu.py tests/test_weight_sync_receiver_abort_gpu.py \
          -k "megatron_student or moe or resume or tp2 or pp2 or nccl or aborts or hung or surviving" ;;
    tests_pair1)  # tests_pair in three calls: the weight-sync layouts and EP=2 (~330 s on two H200s) ...
      bash "$0" tests tests/test_weight_sync_vllm.py tests/test_weight_sync_moe.py tests/test_models_moe_shapes.py \
          tests/test_weight_sync_moe_etp.py -k "megatron_student or ep2 or etp2" ;;
    tests_aborts)  # ... the sync's aborts: a dead receiver, a hung engine, a surviving receiver (~2 minutes) ...
      bash "$0" tests tests/test_weight_sync_abort_gpu.py tests/test_weight_sync_receiver_abort_gpu.py ;;
    tests_pair2)  # ... training: the MoE student at EP=2 and the resume (~330 s on two H100s) ...
      bash "$0" tests tests/test_models_moe_e2e.py tests/test_train_resume.py -k "moe or resume" ;;
    tests_pair3)  # ... and the Megatron teacher at TP=2 / PP=2, the EP=2 steps over NCCL
      bash "$0" tests tests/test_train_integration.py tests/test_models_moe_train.py -k "tp2 or pp2 or nccl" ;;
    tests_pair4)  # ... and the 2-rank kernel and model checks (their files' other tests run in tests1)
      bash "$0" tests tests/test_kernels_gpu.py tests/test_models_gpu.py -k "tp2" ;;
    tests_pair5)  # Transformer Engine on 2 GPUs: context parallelism, TP=2 with sequence parallelism and
                  # recompute against one GPU (skipped without TE)
      bash "$0" tests tests/test_context_parallel_gpu.py ;;
    tests_pair6)  # tests5's 2-GPU cases: a TP=2 device top-k teacher, the self teacher in a PP=2 step
      bash "$0" tests tests/test_teacher_device_topk.py tests/test_self_teacher.py -k "tp2_engine or pp2" ;;
    tests_quad)  # what two GPUs skip (4 ranks: the TP=2 x PP=2 student's sync and training); nvidia-h100-x4
      bash "$0" tests tests/test_weight_sync_vllm.py tests/test_train_integration.py -k "tp2pp2" ;;
    tests_x4|tests_x2)  # the GPU suite in few calls on a 4-GPU (2-GPU) machine; own logs per step
      case "$1:${2:-a}" in
        tests_x4:a) jobs=("0:tests1" "1:tests2" "2,3:tests_pair1") ;;
        tests_x4:b) jobs=("0:tests3" "1:tests4" "2,3:tests_pair2") ;;
        tests_x4:c) jobs=("0,1:tests_aborts+tests_pair4+tests_pair6" "2,3:tests_pair3") ;;
        tests_x4:d) jobs=("0:tests5" "1:tests6" "2,3:tests_pair5") ;;
        tests_x4:e) jobs=("0:tests7" "1:tests8" "2:tests9" "3:tests10") ;;
        tests_x2:a) jobs=("0:tests3" "1:tests1") ;;
        tests_x2:b) jobs=("0,1:tests_pair1") ;;
        tests_x2:c) jobs=("0:tests2" "1:tests4") ;;
        tests_x2:d) jobs=("0,1:tests_pair2") ;;
        tests_x2:e) jobs=("0,1:tests_aborts+tests_pair4") ;;
        tests_x2:f) jobs=("0,1:tests_pair3") ;;
        tests_x2:g) jobs=("0:tests5" "1:tests6") ;;
        tests_x2:h) jobs=("0,1:tests_pair5") ;;
        tests_x2:i) jobs=("0:tests7" "1:tests8") ;;
        tests_x2:j) jobs=("0:tests9" "1:tests10") ;;
        tests_x2:k) jobs=("0,1:tests_pair6") ;;
        *) echo "$1: no part ${2}" >&2; exit 2 ;;
      esac
      bash "$0" tests_on "${jobs[@]}" ;;
    tests_on)  # tests_on GPUS:PART[+PART...] ...: parts side by side, each job on its GPUs, a job's parts one
               # after the other within one deadline for the job (TESTS_DEADLINE, 540 s: what a 10-minute call
               # leaves): a part gets what its job's earlier parts left, e.g. tests_on 0:tests6 2,3:tests_pair3
      [ $# -ge 2 ] || { echo "tests_on: expected GPUS:PART[+PART...] arguments" >&2; exit 2; }
      pids=()
      for job in "${@:2}"; do
        ( IFS=+; end=$(( $(date +%s) + ${TESTS_DEADLINE:-540} ))
          for part in ${job#*:}; do
            mkdir -p "$OUT/$part"; left=$(( end - $(date +%s) ))
            if [ "$left" -lt 60 ]; then  # a part needs a minute to start its first test at all
              echo "not started: its job's TESTS_DEADLINE had ${left} s left" > "$OUT/$part/tests.log"; continue
            fi
            OUT="$OUT/$part" CUDA_VISIBLE_DEVICES=${job%%:*} TESTS_DEADLINE=$left bash "$0" "$part" > /dev/null 2>&1
          done ) &
        pids+=($!)
      done
      wait "${pids[@]}"
      for job in "${@:2}"; do
        (IFS=+; for part in ${job#*:}; do echo "$part: $(tail -n 1 "$OUT/$part/tests.log")"; done)
      done ;;
    controller2)  # the Ray controller on two GPUs: peer export and device IPC with one visible GPU per actor,
                  # an engine killed mid-sync (Ray carried: tools/gpu/env.sh stash .whl-ray/a, then b)
      timeout -s INT -k 20 "${TESTS_DEADLINE:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu \
          --timeout 900 -rfEs --tb=short tests/test_controller_gpu.py "${@:2}" 2>&1 | tee "$OUT/controller2.log"
      grep -q " passed" "$OUT/controller2.log" && ! grep -q "failed\|error" "$OUT/controller2.log" || \
          (cd /tmp/ray/session_latest/logs && tail -n 80 worker-*.err > "$OUT/ray_workers.err" 2>/dev/null)
      pkill -9 -f '[r]aylet|[g]cs_server|[E]ngineCore|[r]ay::' ;;
    tests3)  # one GPU: the sync into a running engine, the Megatron teacher against HF, the NCCL groups'
            # stream priority (~320 s on an H100)
      bash "$0" tests tests/test_weight_sync_vllm.py tests/test_train_integration.py \
          tests/test_weight_sync_transport.py -k "not hidden and not policy" ;;
    tests4)  # one GPU: the hidden-state teacher, the policy-gradient form, the resume, the MoE sync
      bash "$0" tests tests/test_train_integration.py tests/test_train_resume.py tests/test_weight_sync_moe.py \
          tests/test_weight_sync_moe_direct.py -k "hidden or policy or resume or ep2 or moe_direct" ;;
    *) usage ;;
  esac
}

import os

# Transformer Engine asks cuBLAS for TF32 in every float32 GEMM (whatever torch's flags say), which
# would bound a float32 Megatron model against its float32/float64 reference by TF32's roundoff, not
# float32's: the tests check the project's arithmetic at the precision they declare, so NVIDIA's
# libraries keep float32 GEMMs in float32 here and in the processes the tests start (before torch
# loads cuBLAS). Users keep TE's default.
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# vLLM engines in tests take a small share of a GPU, so several (and the trainer) fit at once; on
# CPU the share is ignored (VLLM_CPU_KVCACHE_SPACE sizes the cache)
ENGINE_MEMORY = 0.12

# A float32 vLLM engine's logprobs vs a float64 `transformers` forward. On CPU: float32 rounding of
# logits of size ~5 over a 256-entry softmax, well inside 2e-3. On a GPU, vLLM's Triton attention
# multiplies float32 inputs in TF32 (10-bit mantissa, unit roundoff 2^-11 ~ 4.9e-4, relative), which
# moves logprobs of this size by a few 1e-3 (2.6e-3 seen on an H200 for rollout logprobs, 2.4e-3 for
# a served teacher's prompt logprobs): the bound follows the arithmetic of the device.
VLLM_FP32_LOGPROB_ATOL = 6e-3 if torch.cuda.is_available() else 2e-3

TF32_UNIT_ROUNDOFF = 2.0 ** -11   # TF32 keeps 10 mantissa bits


def vllm_fp32_rel(otherwise: float) -> float:
    """The relative bound between results computed from two float32 vLLM engines' scores of the same
    rows: on a GPU, vLLM's Triton attention rounds float32 inputs to TF32 (`VLLM_FP32_LOGPROB_ATOL`),
    so last-bit differences between the engines (differently shaped batches) can come out as TF32's
    unit roundoff; on CPU `otherwise`, the test's own float32 bound."""
    return TF32_UNIT_ROUNDOFF if torch.cuda.is_available() else otherwise


def vllm_fp32_logprob_atol(ref_logprobs: torch.Tensor) -> float:
    """A float32 vLLM engine's logprobs against `ref_logprobs`, a float64 reference's whole rows of
    log-probabilities (after the temperature). On a GPU TF32's relative roundoff in the attention reaches
    the logits as an error of up to u times their scale, and an error e in every logit moves a
    log-probability by at most 2e; a row's spread (largest minus smallest log-probability) is the logits'
    scale, so the bound is 2 u times the largest spread: it grows with a low temperature and long
    contexts, where `VLLM_FP32_LOGPROB_ATOL`, set at temperature 1 on short rows, is too tight. Never
    under `VLLM_FP32_LOGPROB_ATOL`; on CPU that constant."""
    if not torch.cuda.is_available():
        return VLLM_FP32_LOGPROB_ATOL
    spread = (ref_logprobs.max(dim=-1).values - ref_logprobs.min(dim=-1).values).max().item()
    return max(VLLM_FP32_LOGPROB_ATOL, 2 * TF32_UNIT_ROUNDOFF * spread)


def engine_kwargs(**extra) -> dict:
    """Keyword arguments for a `vllm.LLM` (or RolloutConfig / VllmTeacherConfig) built by a test."""
    return {"gpu_memory_utilization": ENGINE_MEMORY, **extra}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Tests left out of the default run (`pytest -m extended` runs them; the GPU lane runs them all): each
# repeats, at a cost of 30 s or more on two CPU cores, what a test kept in the default run shows.
EXTENDED = {
    # the same sync at TP=2 x PP=2 x VPP=2 (kept) covers each axis alone
    "tests/test_weight_sync_vllm.py::test_megatron_student_synced_matches_its_hf_export[tp2]",
    "tests/test_weight_sync_vllm.py::test_megatron_student_synced_matches_its_hf_export[pp2]",
    "tests/test_weight_sync_vllm.py::test_megatron_student_synced_matches_its_hf_export[pp2vpp2]",
    # the Megatron teacher at TP=2 x PP=2 (kept) covers TP=2 and PP=2 alone, and at one rank its
    # recompute and rows-engine cases (kept) run the same single-rank path
    "tests/test_train_integration.py::test_megatron_teacher_matches_hf_teacher[tp1-1-overrides0]",
    "tests/test_train_integration.py::test_megatron_teacher_matches_hf_teacher[tp2-2-overrides1]",
    "tests/test_train_integration.py::test_megatron_teacher_matches_hf_teacher[pp2-2-overrides2]",
    # device scoring is the default, and its rows equal prompt_logprobs' in
    # test_device_rows_equal_prompt_logprobs_rows (kept): a whole run again adds no case
    "tests/test_teacher_device_topk.py::test_opkd_train_with_device_scoring_equals_prompt_logprobs",
    # the served cross-tokenizer teacher through opkd's device route (kept); the stock route's client
    # is the one test_teacher_remote.py checks
    "tests/test_cross_tokenizer_served.py::test_served_teacher_across_tokenizers_matches_the_in_process_teacher[prompt_logprobs]",
    # the benchmark tools' smoke tests that start engines: their table logic is tested without them
    "tests/test_bench_peers.py::test_opkd_runner_reads_its_stages_from_metrics[sync]",
    "tests/test_bench_peers.py::test_opkd_runner_reads_its_stages_from_metrics[one_step_off]",
    "tests/test_bench_tools.py::test_bench_step_reuses_its_actors_across_schedules",
    "tests/test_config_x8.py::test_bench_step_runs_a_config_files_workload_and_keeps_each_schedules_metrics",
    # SequentialMLP (model.moe_experts: sequential) keeps Qwen3-MoE at EP=2 (logits, export, training
    # and resume); the other families' SequentialMLP layout is the same module
    "tests/test_models_moe.py::test_logits_match_hf[mixtral-ep2seq]",
    "tests/test_models_moe.py::test_logits_match_hf[qwen2_moe-ep2seq]",
    "tests/test_models_moe.py::test_export_reproduces_checkpoint_bit_for_bit[mixtral-ep2seq]",
    "tests/test_models_moe.py::test_export_reproduces_checkpoint_bit_for_bit[qwen2_moe-ep2seq]",
    "tests/test_models_moe.py::test_each_ep_rank_streams_only_its_experts[mixtral-ep2seq]",
    "tests/test_models_moe.py::test_each_ep_rank_streams_only_its_experts[qwen2_moe-ep2seq]",
    "tests/test_models_moe_train.py::test_router_metrics_match_hf_routing[qwen3_moe-ep2-sequential]",
    # the e2e sync bench of the 30B-A3B-shaped MoE at EP=1 (kept); EP=2 sync into a running engine is
    # test_weight_sync_moe.py::test_ep2_student_synced_matches_its_hf_export
    "tests/test_models_moe_shapes.py::test_e2e_sync_bench_of_a_megatron_student_tiny_qwen3_moe_from_the_30b_shape[ep2-coloc]",
    # ... and at EP=1: the tool's row logic is test_bench_tools.py's (kept, a dense model), the MoE sync
    # into a running engine test_weight_sync_moe.py's (kept)
    "tests/test_models_moe_shapes.py::test_e2e_sync_bench_of_a_megatron_student_tiny_qwen3_moe_from_the_30b_shape[tp1-disagg]",
    # the self teacher at PP=2 equals a separate teacher and the paired reference in-process
    # (test_self_teacher_equals_a_separate_megatron_teacher_and_the_paired_reference[1-2-...], kept), and
    # `opkd demo --variant self_distill` (kept) runs a self teacher through the product
    "tests/test_self_teacher.py::test_opkd_train_with_a_self_teacher_under_pp2_gives_the_losses_of_the_paired_reference",
    # the rows engine's step equals the chunked one in train_stage (test_fused_linear_kd_train.py, kept), and
    # recompute's loss and gradients equal none's (test_recompute.py, kept): the entry point passes both
    # keys as it passes any other
    "tests/test_train_integration.py::test_megatron_teacher_matches_hf_teacher[tp1-rows-1-overrides4]",
    "tests/test_train_integration.py::test_megatron_teacher_matches_hf_teacher[tp1-recompute-1-overrides5]",
    # expert TP's training and export are test_models_moe_etp.py's (kept); its engine round trip (~45 s)
    "tests/test_weight_sync_moe_etp.py::test_etp2_student_synced_matches_its_hf_export",
    # the in-process engine's final-norm hidden states: test_vllm_teacher_sending_hidden_states_matches_hf_teacher
    # (test_train_integration.py, kept) trains on them to the losses of the HF teacher's full logits
    "tests/test_fused_linear_kd_served.py::test_in_process_vllm_returns_the_final_norm_hidden_states",
    # the plain runner's step rows with a dense teacher: its top-k case (kept) runs the same row logic
    "tests/test_bench_peers.py::test_plain_runner_reports_every_step_with_the_workloads_tokens[dense]",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
    # the files holding a slow or vLLM test first, each file's tests together and in their order: under
    # `-n 2 --dist loadfile` the two workers start on the long files and the short ones fill in at the end
    long_files = {item.path for item in items if "slow" in item.keywords or "vllm" in item.keywords}
    items.sort(key=lambda item: item.path not in long_files)  # stable: collection order otherwise
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        # xdist's file scheduling would otherwise queue the files by their number of tests, the long
        # files (a few tests each) last
        config.option.loadscopereorder = False

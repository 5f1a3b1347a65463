"""GPU lane, Transformer Engine: context parallelism, sequence parallelism and activation recompute in a
real student step (bf16, a small Qwen3-shaped model, packed sequences whose lengths are not multiples of
2*cp), each against the same step at CP=1 / TP=1 / no recompute on one GPU: the same loss and gradients
within bf16 tolerance, with a top-k teacher and with the dense Megatron teacher inside the step.

CP=2 and TP=2 need 2 CUDA devices; every case needs the transformer_engine package (the local layer
spec has neither CP nor sequence parallelism).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="needs Transformer Engine (CP and sequence parallelism are TE features)"),
]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LENGTHS = [37, 22, 61]   # none a multiple of 4
PROMPTS = [5, 3, 9]
VOCAB, TOP_K = 512, 8

# name -> (GPUs, parallel layout, memory options); the reference is "ref" on one GPU
CASES = {
    "ref": (1, {}, {}),
    "cp2": (2, {"cp": 2}, {}),
    "tp2_sp": (2, {"tp": 2}, {"sequence_parallel": True}),
    "recompute_selective": (1, {}, {"recompute": "selective"}),
    "recompute_full": (1, {}, {"recompute": "full"}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    root = tmp_path_factory.mktemp("cp_models")
    student = TinyModelShape(hidden_size=256, num_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, intermediate_size=512, vocab_size=VOCAB)
    teacher = TinyModelShape(hidden_size=384, num_layers=6, num_attention_heads=6, num_key_value_heads=2,
                             head_dim=64, intermediate_size=768, vocab_size=VOCAB)
    return (save_tiny_hf_model(str(root / "student"), "qwen3", student, seed=1),
            save_tiny_hf_model(str(root / "teacher"), "qwen3", teacher, seed=2))


def _batches(dense: bool):
    from opkd_mcore.engine.packing import pack_sequences
    from opkd_mcore.losses import TopKTeacher

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    teacher = None
    if not dense:
        t = sum(LENGTHS)
        ids = torch.stack([torch.randperm(VOCAB, generator=g)[:TOP_K] for _ in range(t)])
        teacher = TopKTeacher(ids=ids, logprobs=torch.randn(t, TOP_K, generator=g).log_softmax(-1))
    return [pack_sequences(seqs, PROMPTS, teacher=teacher)]


def _step(rank, world, name, dense, student_dir, teacher_dir):
    """(loss, grad norm, {param: full gradient} when TP=1) of one train step of `name`'s layout."""
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.engine.teacher_in_step import InStepTeacher
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights
    from opkd_mcore.models.builder import memory_overrides
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.teacher.megatron_teacher import MegatronTeacher, MegatronTeacherConfig
    from opkd_mcore.train.objective import StepCounts, make_loss_fn

    _, layout, memory = CASES[name]
    init_parallel(ParallelConfig(seed=7, **layout))
    try:
        chunks = build_model(load_hf_config(student_dir), **memory_overrides(**memory))
        load_hf_weights(chunks, student_dir)
        teacher = None
        if dense:
            padded = chunks[0].opkd_layout.padded_vocab_size
            teacher = InStepTeacher(MegatronTeacher(teacher_dir, MegatronTeacherConfig(padded_vocab=padded)),
                                    vocab_size=VOCAB)
        engine = MegatronEngine(chunks, OptimSection(lr=1e-4, clip_grad=0.0), teacher=teacher)
        batches = _batches(dense)
        counts = StepCounts(num_tokens=sum(b.num_loss_tokens for b in batches), num_seqs=len(LENGTHS))
        loss = LossSection(support=None) if dense else LossSection(support="teacher")
        plan = resolve_loss_plan(loss, device="cuda", dtype=torch.bfloat16,
                                 teacher_kind="dense" if dense else "topk")
        tp_group = ps.get_tensor_model_parallel_group()
        # the run's own loss path: on a GPU the fused LM head (an in-step teacher's hidden states)
        loss_fn = make_loss_fn(plan, counts, tp_group)
        metrics = engine.train_step(batches, loss_fn, fused_lm_head=plan.fused_lm_head)
        grads = None
        if layout.get("tp", 1) == 1:
            grads = {n: p.main_grad.float().cpu().numpy() for n, p in engine.model[0].named_parameters()}
        return metrics["train/loss"], metrics["train/grad_norm"], grads
    finally:
        destroy_parallel()


def _run(name, dense, models):
    gpus = CASES[name][0]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices")
    return run_distributed(_step, gpus, name, dense, *models, backend=None, env=NCCL_ENV)[0]


@pytest.fixture(scope="module")
def reference(models):
    return {dense: _run("ref", dense, models) for dense in (False, True)}


@pytest.mark.parametrize("dense", [False, True], ids=["topk_teacher", "dense_megatron_teacher"])
@pytest.mark.parametrize("name", ["cp2", "tp2_sp", "recompute_selective", "recompute_full"])
def test_layout_gives_the_loss_and_gradients_of_one_gpu(models, reference, name, dense):
    loss, grad_norm, grads = _run(name, dense, models)
    ref_loss, ref_norm, ref_grads = reference[dense]
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert grad_norm == pytest.approx(ref_norm, rel=3e-2)
    if grads is None:  # TP shards the weights: the global norm above is the check
        return
    assert grads.keys() == ref_grads.keys()
    for key, ref in ref_grads.items():
        got, ref = torch.from_numpy(grads[key]), torch.from_numpy(ref)
        err = (got - ref).norm() / ref.norm().clamp(min=1e-12)
        assert err < 5e-2, f"{name}: {key} relative error {err:.3g}"

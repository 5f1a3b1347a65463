"""The student as its own teacher, with a privileged prompt (`teacher.teachers.N.backend: self`).

In real Megatron processes over gloo (tests/_dist.py), one optimizer step through `train_stage` on
samples whose teacher prompt differs from the student's (longer for one sample, shorter for
another), with the teacher:

* `hf`: a `transformers` forward of the student's checkpoint on teacher prompt + response, its rows
  paired with the student's by `teacher_stage` (the reference);
* `megatron`: a separate in-step Megatron teacher loaded from the same checkpoint, on its own packing;
* `self_current`: the student's own chunks, no-grad, on the teacher packing (no second copy);
* `self_initial`: `weights: initial`, a frozen copy (what `backend: megatron` with the student's
  directory builds).

All four give the same loss, metrics and updated weights (the update is ~ lr * gradient), at TP=1,
TP=2 and PP=2, with the loss on materialised logits and through the fused LM head.
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import require_devices, run_distributed

V = 32


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    shape = TinyModelShape(vocab_size=V, hidden_size=64, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("self") / "student"), "qwen3", shape, seed=5,
                              alphabet=ALPHABET, init_std=0.2)


def _samples():
    """Four samples of two prompts; the teacher prompt of each is longer or shorter than the student's."""
    from opkd_mcore.rollout import Sample

    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(4):
        prompt = [1] + torch.randint(3, 15, (3 + i % 2,), generator=g).tolist()
        teacher_prompt = [1] + torch.randint(3, 15, ((6, 2, 5, 1)[i],), generator=g).tolist()
        response = torch.randint(3, 15, (2 + i,), generator=g).tolist()
        out.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-1.0] * len(response),
                          finish_reason="stop", weight_version=0, group_id=i // 2,
                          teacher_prompt_ids=teacher_prompt))
    return out


def _in_step_teacher(kind: str, cfg, padded: int, vocab: int):
    from opkd_mcore.train.teacher_setup import build_in_step_teacher

    if kind == "megatron":
        cfg.teacher.teachers[0].backend, cfg.teacher.teachers[0].model = "megatron", cfg.model.student
    return build_in_step_teacher(cfg, padded, vocab)


def _one_step(kind: str, student_dir: str, loss_kwargs: dict, fused: str):
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection, load_config
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.rollout import Sample  # noqa: F401
    from opkd_mcore.teacher.hf_teacher import TransformersTeacher
    from opkd_mcore.train.components import build_student, shard_layout, shared_padded_vocab
    from opkd_mcore.train.stages import RolloutBatch, ScoredBatch, teacher_stage, train_stage

    cfg = load_config(None, [f"model.student={student_dir}", "teacher.teachers.0.backend=hf",
                             f"teacher.teachers.0.model={student_dir}"], check_files=False, validate=False)
    padded, vocab = shared_padded_vocab(cfg)
    samples = _samples()
    if kind == "hf":
        scored, teacher, teacher_kind = teacher_stage(TransformersTeacher(student_dir, k=None),
                                                      RolloutBatch(samples)), None, "dense"
    else:
        scored, teacher_kind = ScoredBatch(samples=samples, teacher=[None] * len(samples)), "in_step"
        teacher = _in_step_teacher(kind, cfg, padded, vocab)
    # adam_eps=1 makes the update ~ lr * g: the weights after the step compare the gradients
    engine, _ = build_student(student_dir, OptimSection(lr=1.0, adam_eps=1.0, clip_grad=0.0),
                              padded_vocab=padded, teacher=teacher)
    loss = LossSection(fused_lm_head=fused, **loss_kwargs)
    plan = resolve_loss_plan(loss, device=engine.device, dtype=engine.params_dtype, teacher_kind=teacher_kind)
    result = train_stage(engine, scored, plan, ParallelSection(micro_batch_size=2, global_batch_size=4),
                         shard_layout(engine), ps.get_tensor_model_parallel_group())
    return result.metrics, [p.detach().clone() for p in engine.parameters()]


def _steps(rank, world, student_dir, tp, pp, kinds, loss_kwargs, fused):
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(tp=tp, pp=pp, seed=3))
    try:
        return {kind: _one_step(kind, student_dir, loss_kwargs, fused) for kind in kinds}
    finally:
        destroy_parallel()


def _assert_same_step(results: dict, reference: str = "hf"):
    ref_metrics, ref_params = results[reference]
    assert ref_metrics["train/loss"] > 1e-3  # the teacher prompt changes the distribution: a real signal
    for kind, (metrics, params) in results.items():
        for key in ("train/loss", "kd/per_token_loss", "train/grad_norm", "teacher/top1_agreement"):
            if key in ref_metrics:
                assert metrics[key] == pytest.approx(ref_metrics[key], rel=2e-5, abs=1e-6), (kind, key)
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{kind}: weights after the step")


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_in_step_teachers_on_their_own_prompts_equal_the_paired_reference(student, tp, pp):
    require_devices(tp * pp)
    ranks = run_distributed(_steps, tp * pp, student, tp, pp, ("hf", "megatron"),
                            {"divergence": "forward_kl"}, "off")
    for results in ranks:
        if pp == 1 or results["hf"][0]:
            _assert_same_step(results)

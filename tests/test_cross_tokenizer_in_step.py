"""A megatron teacher with another tokenizer inside the student's step (real Megatron over gloo,
tests/_dist.py): it runs on its own tokens and its TP-sharded logits give the loss of the same
checkpoint scored outside the step by the `transformers` teacher, at TP = 1, TP = 2 and PP = 2."""
from __future__ import annotations

import pytest

from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import require_devices, run_distributed
from tests._tokenizers import CHARS, digit_pair_tokenizer

pytestmark = pytest.mark.slow   # real Megatron in spawned processes: ~60 s for the three layouts

PROBLEMS = [("07+45=", "250"), ("13+9=", "22"), ("99+99=", "891"), ("4+4=", "8ab")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("xtok_in_step")
    dims = dict(num_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                intermediate_size=128, max_position_embeddings=64)
    student = TinyModelShape(vocab_size=64, hidden_size=64, **dims)
    teacher = TinyModelShape(vocab_size=160, hidden_size=96, **dims)   # another width and vocabulary
    return {"student": save_tiny_hf_model(str(root / "student"), "qwen3", student, seed=1, alphabet=CHARS),
            "teacher": save_tiny_hf_model(str(root / "teacher"), "qwen3", teacher, seed=2, init_std=0.1,
                                          tokenizer=digit_pair_tokenizer())}


def _step(rank, world, student_dir, teacher_dir, backend, tp, pp):
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from opkd_mcore.config import ParallelSection, load_config
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.rollout import Sample
    from opkd_mcore.train.components import build_student, shard_layout, shared_padded_vocab
    from opkd_mcore.train.stages import RolloutBatch, teacher_stage, train_stage
    from opkd_mcore.train.teacher_setup import build_in_step_teacher, cross_tokenizer_scorer

    init_parallel(ParallelConfig(tp=tp, pp=pp, seed=3))
    try:
        output = "dense" if backend == "hf" else "auto"
        overrides = [f"model.student={student_dir}", f"teacher.teachers.0.model={teacher_dir}",
                     f"teacher.teachers.0.backend={backend}", f"teacher.teachers.0.output={output}",
                     "loss.support=teacher", "loss.k=6", "loss.cross_tokenizer=gold", "loss.mass=tail",
                     "loss.temperature=1.5", "loss.fused_lm_head=off"]
        cfg = load_config(None, overrides, check_files=False, validate=False)
        padded, vocab = shared_padded_vocab(cfg)
        in_step = build_in_step_teacher(cfg, padded, vocab)
        engine, _ = build_student(student_dir, OptimSection(lr=1e-2), padded_vocab=padded, teacher=in_step)
        tok = AutoTokenizer.from_pretrained(student_dir)
        samples = []
        for i, (prompt, response) in enumerate(PROBLEMS):
            resp = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            samples.append(Sample(prompt_ids=tok(prompt)["input_ids"], response_ids=resp,
                                  response_logprobs=[-1.0] * len(resp), finish_reason="stop",
                                  weight_version=0, group_id=i // 2,
                                  data={"prompt": prompt, "messages": None}))
        scored = teacher_stage(cross_tokenizer_scorer(cfg), RolloutBatch(samples=samples))
        kind = "in_step" if backend == "megatron" else "dense"
        plan = resolve_loss_plan(cfg.loss, device=engine.device, dtype=engine.params_dtype, teacher_kind=kind)
        result = train_stage(engine, scored, plan, ParallelSection(micro_batch_size=2, global_batch_size=4),
                             shard_layout(engine), ps.get_tensor_model_parallel_group())
        return result.metrics
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def hf_metrics(models):
    metrics, = run_distributed(_step, 1, models["student"], models["teacher"], "hf", 1, 1)
    return metrics


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_in_step_teacher_on_its_own_tokens_matches_the_scoring_teacher(models, hf_metrics, tp, pp):
    require_devices(tp * pp)
    ranks = run_distributed(_step, tp * pp, models["student"], models["teacher"], "megatron", tp, pp)
    for metrics in ranks:
        for key in ("train/loss", "xtok/exact_rows", "xtok/uld_rows", "xtok/uld", "xtok/exact_teacher_mass"):
            assert metrics[key] == pytest.approx(hf_metrics[key], rel=1e-4, abs=1e-6), key
        assert metrics["train/update_applied"] == 1.0
    assert hf_metrics["xtok/uld_rows"] > 0 and hf_metrics["xtok/exact_rows"] > 0

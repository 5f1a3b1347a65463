"""The training step uses the project's own parts: fused loss kernels and a Megatron teacher in it.

In-process (real Megatron over gloo, tests/_dist.py): `train_stage` with `loss.impl: auto` runs the
C++ twin (counted by `opkd_kernels.fused_kd.LAUNCHES`) and gives the metrics of `impl: reference`;
the Triton kernels under TRITON_INTERPRET=1 do the same for one tiny step; the in-step Megatron
teacher holds only its TP shard, no optimizer state and no gradients, and a NaN in its logits or a
non-finite loss never becomes an update. End to end (`opkd train`, vLLM rollouts): a Megatron
teacher at TP=1, TP=2 and PP=2 gives the per-step losses of an `hf` teacher of the same checkpoint.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import free_port, require_devices, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("integration")
    student = TinyModelShape(vocab_size=V, hidden_size=128, num_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64)
    # a wider teacher with a padded vocabulary (40 rows for the same 15-token tokenizer)
    teacher = TinyModelShape(vocab_size=40, hidden_size=192, num_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64)
    return {"student": save_tiny_hf_model(str(root / "student"), "qwen3", student, seed=1, alphabet=ALPHABET),
            "teacher": save_tiny_hf_model(str(root / "teacher"), "qwen3", teacher, seed=2, alphabet=ALPHABET,
                                          init_std=0.1),
            "root": root}


def _scored(seed: int, dense: bool):
    """Four samples (two prompts x 2) with top-k or full-vocabulary teacher rows."""
    from opkd_mcore.losses import DenseTeacher, TopKTeacher
    from opkd_mcore.rollout import Sample
    from opkd_mcore.train.stages import ScoredBatch

    g = torch.Generator().manual_seed(seed)
    samples, rows = [], []
    for i in range(4):
        prompt = [1] + torch.randint(3, 15, (3 + i % 2,), generator=g).tolist()
        response = torch.randint(3, 15, (2 + i,), generator=g).tolist()
        samples.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-1.0] * len(response),
                              finish_reason="stop", weight_version=0, group_id=i // 2))
        logits = 3 * torch.randn(len(prompt) + len(response) - 1, V, generator=g)
        if dense:
            rows.append(DenseTeacher(logits=logits))
        else:
            lp, ids = torch.log_softmax(logits.double(), -1).topk(6, -1)
            rows.append(TopKTeacher(ids=ids, logprobs=lp.float()))
    return ScoredBatch(samples=samples, teacher=rows)


LOSSES = {  # name -> (LossSection kwargs, dense teacher rows)
    "topk_forward_renorm": (dict(support="teacher", divergence="forward_kl"), False),
    "topk_jsd_tail_coverage": (dict(support="teacher", divergence="jsd", beta=0.3, mass="tail",
                                    coverage_coef=0.2), False),
    "dense_reverse_kl_t2": (dict(divergence="reverse_kl", temperature=2.0, k=4), True),
    "dense_union_forward": (dict(support="union", k=4, divergence="forward_kl"), True),
}


def _train_once(model_dir, loss_kwargs, dense, impl, tp_group_size):
    """One optimizer step through `train_stage` (Megatron, the real objective) on fresh weights."""
    from megatron.core import parallel_state as ps

    from opkd_kernels.fused_kd import LAUNCHES
    from opkd_mcore.config import LossSection, ParallelSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.train.components import build_student, shard_layout
    from opkd_mcore.train.stages import train_stage

    # adam_eps=1 makes the update ~ lr * g (Adam's g/sqrt(v) would turn float noise in a ~0
    # gradient into a full +-lr step): the weights after the step then compare the gradients
    engine, _ = build_student(model_dir, OptimSection(lr=1.0, adam_eps=1.0, clip_grad=0.0))
    before = dict(LAUNCHES)
    # the logits kernels: with the interpreter on, `fused_lm_head: auto` would take the fused LM head
    loss = LossSection(impl=impl, fused_lm_head="off", **loss_kwargs)
    plan = resolve_loss_plan(loss, device=engine.device, dtype=engine.params_dtype,
                             teacher_kind="dense" if dense else "topk")
    result = train_stage(engine, _scored(7, dense), plan,
                         ParallelSection(micro_batch_size=2, global_batch_size=4), shard_layout(engine),
                         ps.get_tensor_model_parallel_group())
    launches = {k: LAUNCHES[k] - before.get(k, 0) for k in LAUNCHES}
    params = [p.detach().clone() for p in engine.parameters()]
    return result.metrics, launches, params


def _fused_vs_reference(rank, world, model_dir, impl):
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(tp=world, seed=3))
    try:
        out = {}
        for name, (kwargs, dense) in LOSSES.items():
            if impl == "triton" and name != "topk_jsd_tail_coverage":
                continue  # the interpreter is slow: one objective covers the backend's wiring
            fused = _train_once(model_dir, kwargs, dense, impl, world)
            reference = _train_once(model_dir, kwargs, dense, "reference", world)
            out[name] = (fused, reference)
        return out
    finally:
        destroy_parallel()


def _assert_same_step(fused, reference, backend, num_micro_batches):
    (m_f, launches_f, params_f), (m_r, launches_r, params_r) = fused, reference
    assert launches_f.get(backend, 0) == num_micro_batches  # the fused kernels ran, once per micro-batch
    assert sum(launches_r.values()) == 0  # and never on the reference path
    names = [k for k in m_r if k.startswith(("kd/", "train/loss", "train/grad_norm"))]
    assert {"kd/teacher_mass_on_support", "kd/student_mass_on_support", "train/loss"} <= set(names)
    for k in names:
        assert m_f[k] == pytest.approx(m_r[k], rel=2e-5, abs=1e-6), k
    for a, b in zip(params_f, params_r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cpu_twin_runs_in_tp2_training_steps_with_reference_metrics(models):
    per_rank = run_distributed(_fused_vs_reference, 2, models["student"], "auto")
    for rank_out in per_rank:
        assert set(rank_out) == set(LOSSES)
        for name, (fused, reference) in rank_out.items():
            _assert_same_step(fused, reference, "cpp", num_micro_batches=2)
    assert "kd/topk_overlap" in per_rank[0]["dense_union_forward"][0][0]


def test_triton_interpreter_runs_in_a_training_step(models):
    pytest.importorskip("triton")
    (rank_out,) = run_distributed(_fused_vs_reference, 1, models["student"], "triton",
                                  env={"TRITON_INTERPRET": "1"})
    fused, reference = rank_out["topk_jsd_tail_coverage"]
    _assert_same_step(fused, reference, "triton", num_micro_batches=2)


def test_fused_impl_that_cannot_run_is_refused_before_the_run(models):
    from opkd_mcore.config import ConfigError, load_config
    from opkd_mcore.train.components import loss_plan

    base = [f"model.student={models['student']}", f"teacher.teachers.0.model={models['student']}",
            "teacher.teachers.0.backend=hf", "loss.support=teacher", "rollout.max_model_len=64"]
    with pytest.raises(ConfigError, match="^loss.impl: 'triton' cannot run here"):
        loss_plan(load_config(None, base + ["loss.impl=triton"]))  # no GPU, no interpreter
    with pytest.raises(ConfigError, match="^loss.impl: 'cpp'.*policy_gradient"):
        loss_plan(load_config(None, base + ["loss.impl=cpp", "loss.form=policy_gradient"]))
    loss_plan(load_config(None, base + ["loss.impl=cpp"]))  # the twin is built here


# ---------------------------------------------------------------- the in-step Megatron teacher
def _in_step_teacher(rank, world, student_dir, teacher_dir, poison):
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection, load_config
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.teacher.base import MalformedTeacherOutputError
    from opkd_mcore.train.components import build_student, shard_layout, shared_padded_vocab
    from opkd_mcore.train.stages import train_stage
    from opkd_mcore.train.teacher_setup import build_in_step_teacher

    init_parallel(ParallelConfig(tp=world, seed=3))
    try:
        cfg = load_config(None, [f"model.student={student_dir}", f"teacher.teachers.0.model={teacher_dir}",
                                 "teacher.teachers.0.backend=megatron", "loss.support=null",
                                 "teacher.teachers.0.offload=true"], check_files=False, validate=False)
        padded, vocab = shared_padded_vocab(cfg)
        teacher = build_in_step_teacher(cfg, padded, vocab)
        engine, _ = build_student(student_dir, OptimSection(lr=1e-2), padded_vocab=padded, teacher=teacher)
        scored = _scored(5, dense=False)
        scored.teacher = [None] * len(scored.samples)  # scored inside the step
        optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
        facts = {
            "teacher_numel": teacher.num_parameters(),
            "teacher_in_optimizer": any(id(p) in optimized for c in teacher.chunks for p in c.parameters()),
            "teacher_wrapped": any(type(c).__name__ != "GPTModel" for c in teacher.chunks),
            "teacher_requires_grad": any(p.requires_grad for c in teacher.chunks for p in c.parameters()),
            "offloaded_between_steps": teacher.teacher.offloaded,
        }
        if poison:
            next(teacher.chunks[0].parameters()).data.fill_(float("nan"))
        before = [p.detach().clone() for p in engine.parameters()]
        try:
            plan = resolve_loss_plan(LossSection(divergence="forward_kl"), device=engine.device,
                                     dtype=engine.params_dtype, teacher_kind="in_step")
            result = train_stage(engine, scored, plan,
                                 ParallelSection(micro_batch_size=2, global_batch_size=4), shard_layout(engine),
                                 ps.get_tensor_model_parallel_group())
            facts["metrics"] = result.metrics
        except MalformedTeacherOutputError as err:
            facts["error"] = str(err)
        facts["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, engine.parameters()))
        facts["teacher_grads"] = any(p.grad is not None for c in teacher.chunks for p in c.parameters())
        facts["offloaded_after_step"] = teacher.teacher.offloaded
        return facts
    finally:
        destroy_parallel()


def test_in_step_teacher_holds_its_shard_only_and_no_training_state(models):
    from transformers import AutoModelForCausalLM

    full = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(models["teacher"]).parameters())
    tp1, = run_distributed(_in_step_teacher, 1, models["student"], models["teacher"], False)
    tp2 = run_distributed(_in_step_teacher, 2, models["student"], models["teacher"], False)
    assert tp1["teacher_numel"] == full
    for facts in tp2:
        assert facts["teacher_numel"] < 0.55 * full  # norms are replicated, every matrix is split
        assert not (facts["teacher_in_optimizer"] or facts["teacher_wrapped"] or facts["teacher_requires_grad"]
                    or facts["teacher_grads"])
        assert facts["offloaded_between_steps"] and facts["offloaded_after_step"]
        assert facts["metrics"]["train/update_applied"] == 1.0
        assert facts["metrics"]["train/loss"] == pytest.approx(tp1["metrics"]["train/loss"], rel=1e-5)
    assert 0.0 <= tp1["metrics"]["teacher/top1_agreement"] <= 1.0


def test_nan_in_the_in_step_teacher_is_an_error_naming_it_and_nothing_is_applied(models):
    facts, = run_distributed(_in_step_teacher, 1, models["student"], models["teacher"], True)
    assert "NaN" in facts["error"] and models["teacher"] in facts["error"]
    assert facts["unchanged"]


def _nonfinite_step(rank, world, student_dir):
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.packing import pack_sequences
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.components import build_student

    init_parallel(ParallelConfig())
    try:
        engine, _ = build_student(student_dir, OptimSection(lr=1e-2))
        before = [p.detach().clone() for p in engine.parameters()]
        batch = pack_sequences([[1, 4, 5, 6, 7]], [2])

        def nan_loss(logits, b):
            return logits.float().sum() * float("nan"), {}

        metrics = engine.train_step([batch], nan_loss)
        return metrics, all(torch.equal(a, b) for a, b in zip(before, engine.parameters()))
    finally:
        destroy_parallel()


def test_nonfinite_step_is_skipped_and_counted(models):
    (metrics, unchanged), = run_distributed(_nonfinite_step, 1, models["student"])
    assert metrics["train/update_applied"] == 0.0 and metrics["train/skipped_steps"] == 1.0
    assert unchanged


# ---------------------------------------------------------------- end to end: opkd train
def _run_train(models, name, nproc, *overrides):
    require_devices(nproc)
    out = str(models["root"] / name)
    cfg = {
        "model": {"student": models["student"]},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
        "loss": {"divergence": "forward_kl", "support": None},
        "rollout": {"prompts_per_step": 4, "n": 2, "max_new_tokens": 4, "max_model_len": 64},
        "teacher": {"teachers": [{"backend": "megatron", "model": models["teacher"]}]},
        "optim": {"lr": 1e-3},
        "data": {"num_train": 50, "num_eval": 10},
        "logging": {"progress_bar": False},
        "checkpoint": {"save_at_end": False, "export_hf_at_end": False},
        "run": {"steps": 3, "output_dir": out},
    }
    path = models["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), "-m", "opkd_mcore.cli"]
    proc = subprocess.run([*launcher, "train", "--config", str(path), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def hf_dense_losses(models):
    """The reference of the Megatron-teacher layouts: the same run with the `transformers` teacher."""
    hf, _ = _run_train(models, "hf_dense", 1, "teacher.teachers.0.backend=hf", "teacher.teachers.0.output=dense")
    reference = [row["train/loss"] for row in hf]
    assert len(reference) == 3 and reference[-1] < reference[0]
    return reference


# the fused loss kernels `opkd train` picks by default: Triton on a GPU, the C++ twin on CPU
DEFAULT_FUSED = "triton" if torch.cuda.is_available() else "cpp"
# the Megatron teacher's losses against the `transformers` teacher's, both float32 (no TF32: conftest.py)
TEACHER_LOSS_REL = 1e-4


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name, nproc, overrides", [
    ("tp1", 1, ()),
    ("tp2", 2, ("parallel.tp=2",)),
    ("pp2", 2, ("parallel.pp=2",)),
    # TP and PP together (a large model's layout) with 4 CPU processes standing in for 4 GPUs
    ("tp2pp2", 4, ("parallel.tp=2", "parallel.pp=2")),
    # the fused LM head's rows engine (gradients in the forward) through the entry point, on the
    # student and the in-step teacher's hidden states: the same losses as materialised logits
    ("tp1-rows", 1, ("loss.fused_lm_head=on", "loss.lm_head_engine=rows")),
    # activation recompute through the entry point: the same losses
    ("tp1-recompute", 1, ("parallel.recompute=selective",)),
])
def test_megatron_teacher_matches_hf_teacher(models, hf_dense_losses, name, nproc, overrides):
    require_devices(nproc)
    run, log = _run_train(models, f"megatron_{name}", nproc, *overrides)
    assert f"loss: fused kernels ({DEFAULT_FUSED})" in log
    if "loss.lm_head_engine=rows" in overrides:
        assert "loss.fused_lm_head: on" in log and "lm_head_engine: rows" in log
    assert [row["train/loss"] for row in run] == pytest.approx(hf_dense_losses, rel=TEACHER_LOSS_REL)
    assert all(row["teacher/nonfinite_rows"] == 0 and "teacher/top1_agreement" in row for row in run)
    assert all(row["timing/teacher"] == 0.0 for row in run)  # scored inside the step


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_teacher_sending_hidden_states_matches_hf_teacher(models, hf_dense_losses):
    """Exact dense KD from an in-process vLLM teacher's final-norm hidden states (`output: hidden`,
    the fused LM head applying the teacher's output weight) through `opkd train`: the losses of the
    `hf` teacher's full logits of the same checkpoint. The hidden states are bf16 rows (the wire
    format, `teacher/hidden_states.py`): a relative rounding of up to 2^-9 per element moves this
    teacher's logits by ~1e-3 and the losses by ~2e-4 relative (seen: 1.9e-4), against 1e-4 for the
    float32 teachers above; a wrong output weight, position or final norm changes the teacher's
    distribution itself, far beyond that."""
    run, log = _run_train(models, "vllm_hidden", 1, "teacher.teachers.0.backend=vllm",
                          "teacher.teachers.0.output=hidden", "loss.fused_lm_head=on")
    assert "loss.fused_lm_head: on" in log
    assert [row["train/loss"] for row in run] == pytest.approx(hf_dense_losses, rel=1e-3)
    assert all(row["timing/teacher"] > 0.0 and "teacher/top1_agreement" in row for row in run)


@pytest.mark.slow
@pytest.mark.vllm
def test_policy_gradient_form_at_temperature_07_with_task_rewards(models):
    """The importance ratio compares like with like: on the first step (weights the rollout used)
    the student's logprobs equal the sampler's at any sampling temperature, so |log r| ~ 0 and the
    PPO clip never fires; task rewards enter as group-normalised advantages."""
    rows, _ = _run_train(models, "pg_t07", 1, "loss.form=policy_gradient", "rollout.temperature=0.7",
                         "teacher.teachers.0.backend=hf", "teacher.teachers.0.top_k=8",
                         "loss.support=teacher", "loss.task_reward_coef=0.5",
                         "data.rewards={addition: 'tests.test_train_data:reward_for_test'}", "run.steps=2")
    first = rows[0]
    # mean |log r| over the batch: float32 rounding on CPU; on a GPU vLLM's attention multiplies in
    # TF32 (VLLM_FP32_LOGPROB_ATOL), 1.04e-4 seen on an H100. Mixing up the temperature instead
    # (logprobs of z / 0.7 against z) moves it by ~0.08 on this student (its logits: std 0.22).
    assert first["pg/abs_log_ratio"] < (1e-3 if torch.cuda.is_available() else 1e-4)
    assert first["pg/clip_fraction"] == 0.0
    assert first["reward/mean"] > 0 and first["train/update_applied"] == 1.0
    assert "teacher/top1_agreement" in first

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

import os

import pytest
import torch

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import require_devices, run_distributed

V = 32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


SELF_WEIGHTS = {"self_current": "current", "self_initial": "initial", "self_ema": "ema"}


def _in_step_teacher(kind: str, cfg, padded: int, vocab: int):
    from opkd_mcore.train.teacher_setup import build_in_step_teacher

    t = cfg.teacher.teachers[0]
    if kind == "megatron":
        t.backend, t.model = "megatron", cfg.model.student
    else:
        t.backend, t.model, t.weights, t.ema_decay = "self", "", SELF_WEIGHTS[kind], 0.5
    return build_in_step_teacher(cfg, padded, vocab)


def _one_step(kind: str, student_dir: str, loss_kwargs: dict, fused: str, steps: int = 1):
    """`steps` optimizer steps on `_samples()` with the teacher `kind`: (metrics of each step, the
    student's weights after, the engine)."""
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection, load_config
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
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
    scored.task_advantages = [1.0, -1.0, 0.5, -0.5]  # read by the policy-gradient form only
    # adam_eps=1 makes the update ~ lr * g: the weights after the step compare the gradients
    engine, _ = build_student(student_dir, OptimSection(lr=1.0, adam_eps=1.0, clip_grad=0.0),
                              padded_vocab=padded, teacher=teacher)
    loss = LossSection(fused_lm_head=fused, **loss_kwargs)
    plan = resolve_loss_plan(loss, device=engine.device, dtype=engine.params_dtype, teacher_kind=teacher_kind)
    metrics = [train_stage(engine, scored, plan, ParallelSection(micro_batch_size=2, global_batch_size=4),
                           shard_layout(engine), ps.get_tensor_model_parallel_group()).metrics
               for _ in range(steps)]
    return metrics, [p.detach().clone() for p in engine.parameters()], engine


# one optimizer step per case: (name, teacher kinds, loss options, loss.fused_lm_head)
KINDS = ("hf", "megatron", "self_current", "self_initial")
OBJECTIVES = {
    "forward_kl": (KINDS, {"divergence": "forward_kl"}, "off"),
    "forward_kl_fused_rows": (KINDS, {"divergence": "forward_kl", "lm_head_engine": "rows"}, "on"),
    "reverse_kl_union": (("hf", "self_current"), {"divergence": "reverse_kl", "support": "union", "k": 4},
                         "off"),
    "jsd_t2_topk": (("hf", "self_current"), {"divergence": "jsd", "beta": 0.3, "temperature": 2.0,
                                             "support": "teacher", "k": 5, "mass": "tail"}, "off"),
    "pg_k3_task_rewards": (("hf", "self_current"), {"form": "policy_gradient", "kl_estimator": "k3",
                                                    "task_reward_coef": 0.5}, "off"),
}


def _steps(rank, world, student_dir, tp, pp, cases):
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(tp=tp, pp=pp, seed=3))
    try:
        out = {}
        for name in cases:
            kinds, loss_kwargs, fused = OBJECTIVES[name]
            out[name] = {}
            for kind in kinds:
                # the fused LM head takes no dense logits: the reference runs them materialised
                on = "off" if kind == "hf" else fused
                metrics, params, _ = _one_step(kind, student_dir, loss_kwargs, on)
                out[name][kind] = (metrics[0], params)
        return out
    finally:
        destroy_parallel()


def _assert_same_step(name: str, results: dict, reference: str = "hf"):
    ref_metrics, ref_params = results[reference]
    assert abs(ref_metrics["train/loss"]) > 1e-3, name  # the teacher prompt changes the distribution
    for kind, (metrics, params) in results.items():
        for key in ("train/loss", "kd/per_token_loss", "train/grad_norm", "teacher/top1_agreement",
                    "pg/sampled_kl"):
            if key in ref_metrics:
                assert metrics[key] == pytest.approx(ref_metrics[key], rel=2e-5, abs=1e-6), (name, kind, key)
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}, {kind}: weights after the step")


@pytest.mark.parametrize("tp, pp, cases", [
    (1, 1, tuple(OBJECTIVES)),
    (2, 1, ("forward_kl", "forward_kl_fused_rows", "reverse_kl_union")),
    (1, 2, ("forward_kl", "pg_k3_task_rewards")),
])
def test_self_teacher_equals_a_separate_megatron_teacher_and_the_paired_reference(student, tp, pp, cases):
    """`self` (current and initial), a megatron teacher of the same checkpoint and the `transformers`
    reference give one step the same loss, metrics and gradients, for every loss form."""
    require_devices(tp * pp)
    for per_rank in run_distributed(_steps, tp * pp, student, tp, pp, cases):
        for name, results in per_rank.items():
            _assert_same_step(name, results)


# ---------------------------------------------------------------- weights: ema
def _named(chunks) -> dict:
    from opkd_mcore.engine.lm_head import gpt_model

    return {f"{i}.{n}": p.detach().double().clone() for i, c in enumerate(chunks)
            for n, p in gpt_model(c).named_parameters()}


def _ema_run(rank, world, student_dir, out_dir, tp):
    """Three steps with `weights: ema` (decay 0.5), the EMA checked against a hand computation after
    each; a checkpoint after step 2 restored into a fresh run, whose third step must be the same."""
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from opkd_mcore.train.components import shard_layout
    from opkd_mcore.train.stages import ScoredBatch, train_stage

    init_parallel(ParallelConfig(tp=tp, seed=3))
    try:
        facts = {"hand_error": 0.0}
        initial_metrics, _, _ = _one_step("self_initial", student_dir, {"divergence": "forward_kl"}, "off")
        metrics, _, engine = _one_step("self_ema", student_dir, {"divergence": "forward_kl"}, "off", steps=0)
        teacher = engine.teacher
        facts["first_is_initial"] = all(torch.equal(a, b) for a, b in
                                        zip(_named(teacher.chunks).values(), _named(engine.model).values()))
        facts["teacher_dtype"] = str(next(teacher.chunks[0].parameters()).dtype)
        plan = resolve_loss_plan(LossSection(), device=engine.device, dtype=engine.params_dtype,
                                 teacher_kind="in_step")

        def step(e):
            scored = ScoredBatch(samples=_samples(), teacher=[None] * 4)
            return train_stage(e, scored, plan, ParallelSection(micro_batch_size=2, global_batch_size=4),
                               shard_layout(e), ps.get_tensor_model_parallel_group()).metrics

        losses = []
        for _ in range(2):
            before = _named(teacher.chunks)
            losses.append(step(engine)["train/loss"])
            student, after = _named(engine.model), _named(teacher.chunks)
            for name, ema in after.items():  # by hand: decay * ema + (1 - decay) * student, float64
                expected = 0.5 * before[name] + 0.5 * student[name]
                facts["hand_error"] = max(facts["hand_error"], float((ema - expected).abs().max()))
        facts["first_loss"], facts["initial_loss"] = losses[0], initial_metrics[0]["train/loss"]
        facts["ema_moved"] = not torch.equal(before[name], after[name])
        save_checkpoint(out_dir, engine, TrainerState(step=2), "{}\n")
        saved = _named(teacher.chunks)
        facts["third"] = step(engine)["train/loss"]
        _, _, fresh = _one_step("self_ema", student_dir, {"divergence": "forward_kl"}, "off", steps=0)
        load_checkpoint(f"{out_dir}/checkpoints/step_000002", fresh)
        facts["restored"] = all(torch.equal(saved[n], p) for n, p in _named(fresh.teacher.chunks).items())
        facts["third_resumed"] = step(fresh)["train/loss"]
        return facts
    finally:
        destroy_parallel()


@pytest.mark.parametrize("tp", [1, 2])
def test_ema_teacher_follows_the_student_by_hand_and_is_restored_from_checkpoints(student, tmp_path, tp):
    require_devices(tp)
    for facts in run_distributed(_ema_run, tp, student, str(tmp_path / "run"), tp):
        assert facts["first_is_initial"] and facts["teacher_dtype"] == "torch.float32"
        assert facts["first_loss"] == pytest.approx(facts["initial_loss"], rel=1e-6)  # before any update
        assert facts["ema_moved"] and facts["hand_error"] < 1e-7  # float32 storage of a float64 average
        assert facts["restored"]
        assert facts["third_resumed"] == pytest.approx(facts["third"], rel=1e-6)


# ---------------------------------------------------------------- config
@pytest.fixture
def base(tmp_path, monkeypatch):
    """A valid config over a local 4-head checkpoint whose teacher is the student itself."""
    import json

    import yaml

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    student = tmp_path / "student"
    student.mkdir()
    (student / "config.json").write_text(json.dumps(dict(
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=64,
        architectures=["Qwen3ForCausalLM"])))
    cfg = {"model": {"student": str(student)}, "loss": {"support": None},
           "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
           "rollout": {"prompts_per_step": 4, "n": 2},
           "data": {"teacher_prompt_template": "{answer}|{prompt}"},
           "teacher": {"teachers": [{"name": "me", "backend": "self"}]},
           "run": {"output_dir": str(tmp_path / "run")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), str(student)


@pytest.mark.parametrize("overrides, match", [
    (["teacher.teachers.0.model=/some/dir"], "^teacher.teachers.0.model: a self teacher is the student"),
    (["teacher.teachers.0.weights=ema", "teacher.teachers.0.ema_decay=1.0"],
     r"^teacher.teachers.0.ema_decay: expected a value in \(0, 1\)"),
    (["teacher.teachers.0.weights=ema", "teacher.teachers.0.ema_decay=0.0"], "^teacher.teachers.0.ema_decay"),
    (["teacher.teachers.0.weights=latest"], "^teacher.teachers.0.weights: expected one of"),
    (["teacher.teachers.0.offload=true"], "^teacher.teachers.0.offload: only a megatron teacher's weights"),
    (["teacher.teachers.0.output=hidden"], "^teacher.teachers.0.output: 'hidden'"),
    (["teacher.teachers.0.output=topk", "teacher.teachers.0.weights=initial", "loss.support=teacher"],
     "^teacher.teachers.0.weights: output: topk scores with the rollout engine"),
    (["teacher.teachers.0.output=topk", "loss.support=teacher", "controller.kind=ray"],
     "^teacher.teachers.0.output: a self teacher with output: topk scores with the rollout engine of the "
     "torchrun"),
    (["teacher.teachers.0.output=topk", "loss.support=teacher", "weight_sync.every_steps=2"],
     "^weight_sync.every_steps: a self teacher with output: topk"),
    (["loss.confidence_alpha=1.0"],
     "^loss.confidence_alpha: .* a self teacher with dense output scores inside"),
    (["teacher.teachers=[{name: me, backend: self}, {name: other, backend: hf, output: dense, "
      "model: MODEL, data_sources: [code]}]"],
     "^teacher.teachers.0.backend: a self teacher with dense output scores every micro-batch"),
    (["teacher.teachers=[{name: me, backend: hf, model: MODEL, weights: ema}]", "loss.support=teacher"],
     "^teacher.teachers.0.weights: only a self teacher chooses its weights"),
])
def test_self_teacher_options_are_checked_naming_the_key(base, overrides, match):
    from opkd_mcore.config import ConfigError, load_config

    path, student = base
    with pytest.raises(ConfigError, match=match):
        load_config(path, [o.replace("MODEL", student) for o in overrides])


def test_self_teacher_kinds_and_routing(base):
    from opkd_mcore.config import load_config
    from opkd_mcore.config.loss_rules import runs_in_step, teacher_kind
    from opkd_mcore.config.placement_rules import teacher_actor_endpoints

    path, student = base
    dense = load_config(path, [])
    assert teacher_kind(dense.teacher.teachers) == "in_step" and teacher_actor_endpoints(dense) == []
    for weights in ("initial", "ema"):  # a copy may wait in host memory between steps
        assert load_config(path, [f"teacher.teachers.0.weights={weights}", "teacher.teachers.0.offload=true"])
    # top-k from the rollout engine, routed by data source next to an external teacher
    topk = load_config(path, [f"teacher.teachers=[{{name: me, backend: self, output: topk, top_k: 8}}, "
                              f"{{name: ext, backend: hf, model: {student}, top_k: 8, "
                              "data_sources: [code]}]",
                              "loss.support=teacher"])
    assert teacher_kind(topk.teacher.teachers) == "topk"
    assert not any(runs_in_step(t) for t in topk.teacher.teachers)
    assert [t.name for t, _ in teacher_actor_endpoints(topk)] == ["me", "ext"]


# ---------------------------------------------------------------- output: topk, from the rollout engine
@pytest.mark.vllm
def test_the_rollout_engine_scores_the_teacher_prompts_as_a_top_k_self_teacher(student, tmp_path):
    """`backend: self, output: topk`: the rollout engine `opkd train` builds (raw logprobs, enough of
    them) generates, then scores teacher prompt + response; the rows paired with the student's
    sequence are the float64 `transformers` top-k after the teacher prompt."""
    from transformers import AutoModelForCausalLM

    from opkd_mcore.config import load_config
    from opkd_mcore.rollout import SamplingConfig
    from opkd_mcore.train.components import build_rollout
    from opkd_mcore.train.stages import PromptBatch, rollout_stage, teacher_stage
    from opkd_mcore.train.teacher_setup import build_scoring_teacher
    from tests.conftest import VLLM_FP32_LOGPROB_ATOL

    cfg = load_config(None, [f"model.student={student}", "teacher.teachers.0.backend=self",
                             "teacher.teachers.0.output=topk", "teacher.teachers.0.top_k=6",
                             "loss.support=teacher", "rollout.max_model_len=64",
                             "rollout.gpu_memory_utilization=0.12",
                             "data.teacher_prompt_template='{answer}|{prompt}'"], validate=False)
    rollout = build_rollout(cfg)
    try:
        teacher = build_scoring_teacher(cfg, V, rollout)
        assert "rollout engine" in teacher.address
        prompts = PromptBatch(indices=[0, 1], prompt_ids=[[1, 4, 5, 13], [1, 6, 12, 7, 13]], data=[{}, {}],
                              seeds=[1, 2], teacher_prompt_ids=[[1, 9, 9, 14, 4, 5, 13], [1, 3, 13]])
        rolled = rollout_stage(rollout, prompts, SamplingConfig(n=2, max_new_tokens=4, temperature=1.0))
        scored = teacher_stage(teacher, rolled)
    finally:
        rollout.shutdown()
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float64).eval()
    for sample, rows in zip(scored.samples, scored.teacher):
        p_s, p_t, r = len(sample.prompt_ids), len(sample.teacher_prompt_ids), len(sample.response_ids)
        with torch.no_grad():
            logits = model(torch.tensor([sample.teacher_sequence])).logits[0]
        ref = torch.log_softmax(logits[p_t - 1:p_t - 1 + r], -1)
        got_ids, got_lp = rows.ids[p_s - 1:], rows.logprobs[p_s - 1:].double()
        torch.testing.assert_close(got_lp, ref.topk(6, -1).values, atol=VLLM_FP32_LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(ref.gather(1, got_ids), got_lp, atol=VLLM_FP32_LOGPROB_ATOL, rtol=0)
        assert (rows.ids[:p_s - 1] == -1).all()  # the student's prompt rows: padding


# ---------------------------------------------------------------- end to end: opkd train
def _opkd_train(root, student_dir, name, nproc, *overrides):
    """Three steps of `opkd train` on the synthetic task, the teacher reading the answer before the prompt."""
    import json
    import subprocess
    import sys

    import yaml

    from tests._dist import free_port

    out = str(root / name)
    cfg = {"model": {"student": student_dir},
           "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
           "loss": {"divergence": "forward_kl", "support": None},
           "rollout": {"prompts_per_step": 4, "n": 2, "max_new_tokens": 4, "max_model_len": 64},
           "teacher": {"teachers": [{"backend": "self", "weights": "initial"}]},
           "optim": {"lr": 1e-3},
           "data": {"num_train": 50, "num_eval": 10, "teacher_prompt_template": "{answer}+{prompt}"},
           "logging": {"progress_bar": False},
           "checkpoint": {"save_at_end": False, "export_hf_at_end": False},
           "run": {"steps": 3, "output_dir": out}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), "-m", "opkd_mcore.cli"]
    proc = subprocess.run([*launcher, "train", "--config", str(path), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.vllm
def test_opkd_train_with_a_self_teacher_under_pp2_gives_the_losses_of_the_paired_reference(student, tmp_path):
    """Through the launcher (prompts and teacher prompts encoded on every rank, rollout on rank 0):
    the frozen self teacher in the PP=2 step gives the per-step losses of an `hf` teacher of the
    student's checkpoint scoring teacher prompt + response on rank 0, and the current-weights teacher
    the first step's."""
    require_devices(2)
    reference = _opkd_train(tmp_path, student, "hf", 1, "teacher.teachers.0.backend=hf",
                            f"teacher.teachers.0.model={student}", "teacher.teachers.0.output=dense",
                            "teacher.teachers.0.weights=current")
    initial = _opkd_train(tmp_path, student, "self_initial_pp2", 2, "parallel.pp=2")
    current = _opkd_train(tmp_path, student, "self_current_pp2", 2, "parallel.pp=2",
                          "teacher.teachers.0.weights=current")
    losses = [row["train/loss"] for row in reference]
    assert losses[0] > 1e-3
    assert [row["train/loss"] for row in initial] == pytest.approx(losses, rel=1e-4)
    assert current[0]["train/loss"] == pytest.approx(losses[0], rel=1e-4)
    assert all(row["timing/teacher"] == 0.0 for row in initial + current)  # scored inside the step
    assert all(row["timing/teacher"] > 0.0 for row in reference)

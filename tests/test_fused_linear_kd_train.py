"""A training step with `loss.fused_lm_head: on` equals the step with `off` (CPU, real Megatron over gloo).

`train_stage` on a tiny Qwen3 student, once with the output layer and the loss fused (the chunked
C++ / torch twin, counted by `opkd_kernels.fused_linear_kd.LAUNCHES`) and once with materialised
logits (the logits kernels): same loss, same KD metrics, same gradient norm and the same weights
after the step. Covered: a top-k teacher at TP=2, the in-step Megatron teacher (wider, padded
vocabulary: hidden states + its weight shard) at TP=2 and PP=2, tied input/output weights (their
gradient adds the fused backward to the embedding's), and the config rules of `fused_lm_head`.
`lm_head_engine: rows` (gradients in the forward from the aggregation's row weights) gives the chunked
engine's step at TP=2 (in-step Megatron teacher with seq-mean-token-mean, tied weights with top-k rows).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import run_distributed
from tests.test_train_integration import _scored

pytest.importorskip("megatron.core")
V = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_head")
    shape = dict(vocab_size=V, hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=64)
    teacher = TinyModelShape(**{**shape, "vocab_size": 40, "hidden_size": 96})
    return {"student": save_tiny_hf_model(str(root / "student"), "qwen3", TinyModelShape(**shape), seed=1,
                                          alphabet=ALPHABET),
            "tied": save_tiny_hf_model(str(root / "tied"), "qwen3",
                                       TinyModelShape(**shape, tie_word_embeddings=True), seed=3, alphabet=ALPHABET),
            "teacher": save_tiny_hf_model(str(root / "teacher"), "qwen3", teacher, seed=2, alphabet=ALPHABET,
                                          init_std=0.1)}


def _step(student_dir, teacher_dir, loss_kwargs, fused: str):
    """One optimizer step through `train_stage`; (metrics, fused launches, weights after)."""
    from megatron.core import parallel_state as ps

    from opkd_kernels.fused_linear_kd import LAUNCHES
    from opkd_mcore.config import LossSection, ParallelSection, load_config
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.train.components import build_student, shard_layout, shared_padded_vocab
    from opkd_mcore.train.stages import train_stage
    from opkd_mcore.train.teacher_setup import build_in_step_teacher

    teacher = padded = None
    scored = _scored(7, dense=False)
    if teacher_dir is not None:   # the in-step Megatron teacher: rows are scored inside the step
        cfg = load_config(None, [f"model.student={student_dir}", f"teacher.teachers.0.model={teacher_dir}",
                                 "teacher.teachers.0.backend=megatron", "loss.support=null"],
                          check_files=False, validate=False)
        padded, vocab = shared_padded_vocab(cfg)
        teacher = build_in_step_teacher(cfg, padded, vocab)
        scored.teacher = [None] * len(scored.samples)
    # adam_eps=1: the update is ~ lr * g, so the weights after the step compare the gradients
    engine, _ = build_student(student_dir, OptimSection(lr=1.0, adam_eps=1.0, clip_grad=0.0),
                              padded_vocab=padded, teacher=teacher)
    before = dict(LAUNCHES)
    plan = resolve_loss_plan(LossSection(fused_lm_head=fused, **loss_kwargs), device=engine.device,
                             dtype=engine.params_dtype,
                             teacher_kind="topk" if teacher_dir is None else "in_step")
    result = train_stage(engine, scored, plan,
                         ParallelSection(micro_batch_size=2, global_batch_size=4), shard_layout(engine),
                         ps.get_tensor_model_parallel_group())
    params = [p.detach().clone() for p in engine.parameters()]
    launches = {name: count - before.get(name, 0) for name, count in LAUNCHES.items() if count != before.get(name, 0)}
    return result.metrics, launches, params


CASES = {  # name -> (student, teacher or None for top-k rows, LossSection kwargs)
    "topk_jsd_tail_coverage": ("student", None, dict(support="teacher", divergence="jsd", beta=0.3, mass="tail",
                                                     coverage_coef=0.2)),
    "megatron_teacher_reverse_kl": ("student", "teacher", dict(divergence="reverse_kl", temperature=1.5)),
    "tied_topk_forward": ("tied", None, dict(support="teacher", divergence="forward_kl")),
}


def _on_vs_off(rank, world, dirs, names, tp, pp, variants=(("on", {}), ("off", {}))):
    """Per case: one step per variant (`loss.fused_lm_head`, extra LossSection kwargs)."""
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(tp=tp, pp=pp, seed=3))
    try:
        out = {}
        for name in names:
            student, teacher, kwargs = {**CASES, **ROWS_CASES}[name]
            out[name] = tuple(_step(dirs[student], dirs.get(teacher), {**kwargs, **extra}, fused)
                              for fused, extra in variants)
        return out
    finally:
        destroy_parallel()


def _assert_same_step(on, off, last_stage: bool):
    (m_on, launches_on, params_on), (m_off, launches_off, params_off) = on, off
    assert sum(launches_off.values()) == 0
    assert sum(launches_on.values()) == (2 if last_stage else 0)   # one fused call per micro-batch, last stage only
    names = [k for k in m_off if k.startswith(("kd/teacher_mass", "kd/student_mass", "kd/per_token", "train/loss",
                                                "train/grad_norm", "teacher/"))]
    assert "train/loss" in names and m_on["train/update_applied"] == 1.0
    for k in names:
        assert m_on[k] == pytest.approx(m_off[k], rel=2e-5, abs=1e-6), k
    for a, b in zip(params_on, params_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_fused_lm_head_step_matches_materialised_logits_at_tp2(models):
    per_rank = run_distributed(_on_vs_off, 2, models, list(CASES), 2, 1)
    for rank_out in per_rank:
        for on, off in rank_out.values():
            _assert_same_step(on, off, last_stage=True)
    assert "teacher/top1_agreement" in per_rank[0]["megatron_teacher_reverse_kl"][0][0]


def test_fused_lm_head_step_matches_materialised_logits_at_pp2(models):
    per_rank = run_distributed(_on_vs_off, 2, models, ["megatron_teacher_reverse_kl"], 1, 2)
    for stage, rank_out in enumerate(per_rank):
        on, off = rank_out["megatron_teacher_reverse_kl"]
        _assert_same_step(on, off, last_stage=stage == 1)


ROWS_CASES = {  # the rows engine (gradients in the forward from the aggregation's weights) vs chunked
    "megatron_teacher_jsd_seq_mean": ("student", "teacher", {"divergence": "jsd", "beta": 0.4, "temperature": 1.5,
                                                             "aggregation": "seq-mean-token-mean"}),
    "tied_topk_tail_token_mean": ("tied", None, {"support": "teacher", "divergence": "forward_kl", "mass": "tail",
                                                 "coverage_coef": 0.2}),
}


def test_rows_engine_step_matches_chunked_at_tp2(models):
    """`loss.lm_head_engine: rows` through `train_stage`: the scalar it back-propagates (sum of the
    aggregation's row weights times the loss) gives the chunked engine's loss, metrics and update."""
    variants = (("on", {"lm_head_engine": "rows"}), ("on", {"lm_head_engine": "chunked"}))
    per_rank = run_distributed(_on_vs_off, 2, models, list(ROWS_CASES), 2, 1, variants)
    for rank_out in per_rank:
        for (m_rows, launches_rows, params_rows), (m_chunked, launches_chunked, params_chunked) in rank_out.values():
            # one call per micro-batch, of the rows engine, then of the chunked one
            assert sum(launches_rows.values()) == sum(launches_chunked.values()) == 2
            assert all(name.startswith("rows-") for name in launches_rows)
            assert not any(name.startswith("rows-") for name in launches_chunked)
            names = [k for k in m_chunked if k.startswith(("kd/", "train/loss", "train/grad_norm", "teacher/"))]
            assert "train/loss" in names and m_rows["train/update_applied"] == 1.0
            for k in names:
                assert m_rows[k] == pytest.approx(m_chunked[k], rel=2e-5, abs=1e-6), k
            for a, b in zip(params_rows, params_chunked):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("overrides, match", [
    (["loss.fused_lm_head=on", "loss.form=policy_gradient"], "^loss.fused_lm_head: 'on' fuses"),
    (["loss.fused_lm_head=on", "loss.impl=reference"], "^loss.fused_lm_head: 'on' runs"),
    (["loss.fused_lm_head=on", "teacher.teachers.0.backend=hf", "teacher.teachers.0.output=dense",
      "loss.support=null"], "^loss.fused_lm_head: 'on' needs the teacher"),
    (["loss.fused_lm_head=sometimes"], "^loss.fused_lm_head: expected one of"),
    (["loss.lm_head_engine=fastest"], "^loss.lm_head_engine: expected one of"),
    (["loss.lm_head_chunk_mb=0"], "^loss.lm_head_chunk_mb: expected > 0"),
    (["loss.lm_head_chunk_mb=1.5"], "^loss.lm_head_chunk_mb"),
    (["loss.lm_head_chunk_mb=nan"], "^loss.lm_head_chunk_mb"),
])
def test_fused_lm_head_config_errors(models, overrides, match):
    from opkd_mcore.config import ConfigError, load_config

    base = [f"model.student={models['student']}", f"teacher.teachers.0.model={models['student']}",
            "teacher.teachers.0.backend=hf", "loss.support=teacher", "rollout.max_model_len=64"]
    with pytest.raises(ConfigError, match=match):
        load_config(None, base + overrides)
    load_config(None, base + ["loss.fused_lm_head=on"])
    load_config(None, base + ["loss.fused_lm_head=on", "loss.lm_head_engine=rows"])


def test_auto_is_on_only_where_the_triton_tiles_run():
    from opkd_mcore.config import LossSection
    from opkd_mcore.losses.plan import resolve_loss_plan

    def fused_lm_head_plan(loss, teacher_kind):   # the decision, as the run makes it at start-up
        plan = resolve_loss_plan(loss, device="cpu", dtype=torch.float32, teacher_kind=teacher_kind)
        return plan.fused_lm_head

    auto = LossSection(fused_lm_head="auto", support="teacher")
    assert not fused_lm_head_plan(auto, "topk")        # the chunked twin: only with on
    assert fused_lm_head_plan(LossSection(fused_lm_head="on", support="teacher"), "topk")
    with pytest.raises(ValueError, match="^loss.fused_lm_head: 'on' cannot run: the teacher hands over full"):
        fused_lm_head_plan(LossSection(fused_lm_head="on"), "dense")
    tiles = LossSection(fused_lm_head="on", support="teacher", lm_head_engine="tiles")
    with pytest.raises(ValueError, match="cannot run: loss.lm_head_engine: tiles needs the Triton kernels"):
        fused_lm_head_plan(tiles, "topk")


def test_lm_head_engine_rule(monkeypatch):
    """auto: the rows engine where the Triton kernels run; elsewhere the chunked engine for a dense
    teacher on the full vocabulary, the tiles (None: impl's choice) for a sparse support; a named
    twin (cpp / torch) is never overridden."""
    from opkd_mcore.config import LossSection
    from opkd_mcore.losses.fused_linear import engine_name
    from opkd_mcore.losses.plan import lm_head_engine_rule

    def lm_head_engine(loss, teacher_kind, rows=None):   # the rule with the kernels `rows` would run
        return lm_head_engine_rule(loss, teacher_kind, None if rows is None else engine_name(rows, loss.impl))

    hidden, topk = "hidden", "topk"   # teacher kinds reaching the head as HiddenTeacher / TopKTeacher
    assert lm_head_engine(LossSection(), hidden) == "chunked"
    assert lm_head_engine(LossSection(support="union", k=2), hidden) is None
    assert lm_head_engine(LossSection(support="teacher"), topk) is None
    assert lm_head_engine(LossSection(support="teacher", lm_head_engine="chunked"), topk) == "chunked"
    assert lm_head_engine(LossSection(lm_head_engine="tiles"), hidden) is None
    assert lm_head_engine(LossSection(impl="torch"), hidden) is None
    assert lm_head_engine(LossSection(lm_head_engine="rows"), topk) == "rows"            # asked for: any teacher,
    assert lm_head_engine(LossSection(lm_head_engine="rows", impl="torch"), hidden) == "rows"   # any logits kernels
    rows_cpu = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert lm_head_engine(LossSection(), hidden, rows_cpu) == "chunked"          # no Triton here: as before
    assert lm_head_engine(LossSection(support="teacher"), topk, rows_cpu) is None
    assert lm_head_engine(LossSection(impl="torch"), hidden, rows_cpu) is None
    from opkd_mcore.platform import device as platform_device

    monkeypatch.setattr(platform_device, "triton_kernels_usable", lambda tensor: True)   # as on a GPU
    assert lm_head_engine(LossSection(), hidden, rows_cpu) == "rows"
    assert lm_head_engine(LossSection(support="teacher"), topk, rows_cpu) == "rows"
    assert lm_head_engine(LossSection(lm_head_engine="tiles"), topk, rows_cpu) is None     # named: as asked
    assert lm_head_engine(LossSection(lm_head_engine="chunked"), hidden, rows_cpu) == "chunked"
    assert lm_head_engine(LossSection(impl="cpp"), hidden, rows_cpu) is None


def test_chunked_engine_name_off_the_gpu_is_the_twin():
    from opkd_kernels import cpu_backend
    from opkd_kernels.fused_linear_kd import select_linear_engine

    engine = select_linear_engine(torch.zeros(3, 4), "chunked")
    assert engine.name == ("chunked-cpp" if cpu_backend.available() else "chunked-torch")


def test_lm_head_chunk_mb_reaches_the_rows_engine(monkeypatch):
    """`loss.lm_head_chunk_mb` is the rows engine's chunk budget in bytes (None: its own default)."""
    import opkd_mcore.train.objective as objective
    from opkd_mcore.config import LossSection
    from opkd_mcore.engine.lm_head import LmHeadInput
    from opkd_mcore.losses import TopKTeacher
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.train.objective import StepCounts, make_loss_fn

    seen = []
    real = objective.linear_kd_loss_weighted
    monkeypatch.setattr(objective, "linear_kd_loss_weighted",
                        lambda *a, chunk_bytes=None, **kw: seen.append(chunk_bytes) or real(*a, chunk_bytes=chunk_bytes, **kw))
    g = torch.Generator().manual_seed(0)
    head = LmHeadInput(torch.randn(6, 4, generator=g, requires_grad=True), torch.randn(10, 4, generator=g))
    ids = torch.stack([torch.randperm(10, generator=g)[:3] for _ in range(6)])   # distinct per row
    batch = SimpleNamespace(loss_mask=torch.ones(6), seq_ids=torch.zeros(6, dtype=torch.long),
                            sequence_weights=None, num_sequences=1, tokens=torch.zeros(6, dtype=torch.long),
                            teacher=TopKTeacher(ids, torch.log_softmax(torch.randn(6, 3, generator=g), -1)))
    for mb in (None, 3):
        loss = LossSection(support="teacher", fused_lm_head="on", lm_head_engine="rows", lm_head_chunk_mb=mb)
        plan = resolve_loss_plan(loss, device="cpu", dtype=torch.float32, teacher_kind="topk")
        scalar, _ = make_loss_fn(plan, StepCounts(num_tokens=6, num_seqs=1))(head, batch)
        scalar.backward()
    assert seen == [None, 3 << 20] and head.hidden.grad is not None

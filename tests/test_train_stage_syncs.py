"""The train stage makes the host wait for the device at most a fixed number of times per step.

A host sync inside the micro-batch loop (a value check on the teacher rows, `repeat_interleave`
without its output size, an `.item()`) stops the host from queueing the next kernels until the
device has drained, once per micro-batch. On CPU every op is synchronous, so the check is on what
the ops are (`tests/_host_sync.py`), counted over `engine.train_step` on a tiny Qwen3 student: the
count with three micro-batches must equal the count with one (what remains is the optimizer's
once-per-step reads after the last backward). Rows the loss would reject still stop the step, read
once after the schedule.
"""
from __future__ import annotations

import traceback

import pytest
import torch

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import run_distributed
from tests._host_sync import SyncingOpRecorder
from tests.test_train_integration import _scored

pytest.importorskip("megatron.core")

# the CPU stand-in for the accelerator's attention kernel (TE / flash-attention on a GPU) reads the
# packing's bounds on the host; it never runs on an accelerator
CPU_ONLY = ("platform/sdpa_attention.py",)


class _Recorder(SyncingOpRecorder):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = len(self.seen)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.seen) > seen and any(f.filename.endswith(CPU_ONLY) for f in traceback.extract_stack()):
            self.seen.pop()
        return out


def _syncs_per_step(rank, world, student_dir, fused_head: str):
    """Syncing ops of one `train_step` over 1 and over 4 micro-batches of the same samples."""
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.components import build_student, shard_layout
    from opkd_mcore.train.objective import make_loss_fn
    from opkd_mcore.train.stages import pack_micro_batches

    init_parallel(ParallelConfig(seed=3))
    try:
        engine, _ = build_student(student_dir, OptimSection(lr=1e-3, clip_grad=1.0))
        extra = {"lm_head_engine": "rows"} if fused_head == "on" else {}
        plan = resolve_loss_plan(LossSection(support="teacher", fused_lm_head=fused_head, **extra),
                                 device=engine.device, dtype=engine.params_dtype, teacher_kind="topk")
        assert plan.fused_lm_head == (fused_head == "on")
        scored = _scored(7, dense=False)
        out = {}
        for budget in (1000, 9, 1000):   # the first step warms up (lazy state of the optimizer)
            par = ParallelSection(micro_batch_size=4, global_batch_size=4, max_tokens_per_micro_batch=budget)
            batches, counts = pack_micro_batches(scored, par, shard_layout(engine))
            loss_fn = make_loss_fn(plan, counts, ps.get_tensor_model_parallel_group())
            with _Recorder() as rec:
                metrics = engine.train_step(batches, loss_fn, fused_lm_head=plan.fused_lm_head)
            assert metrics["train/update_applied"] == 1.0
            out[len(batches)] = sorted(rec.seen)
        return out
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    shape = TinyModelShape(vocab_size=32, hidden_size=64, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("syncs") / "student"), "qwen3", shape, seed=1,
                              alphabet=ALPHABET)


@pytest.mark.parametrize("fused_head", ["on", "off"])
def test_host_syncs_do_not_grow_with_micro_batches(student, fused_head):
    per_count = run_distributed(_syncs_per_step, 1, student, fused_head)[0]
    assert sorted(per_count) == [1, 4], per_count.keys()
    one, four = per_count[1], per_count[4]
    assert four == one, f"host syncs per step: {len(one)} with 1 micro-batch, {len(four)} with 4: {four}"


def _malformed_step(rank, world, student_dir):
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses import TopKTeacher
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.losses.teacher_outputs import MalformedTeacherOutputError
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.components import build_student, shard_layout
    from opkd_mcore.train.stages import train_stage

    init_parallel(ParallelConfig(seed=3))
    try:
        engine, _ = build_student(student_dir, OptimSection(lr=1e-2))
        plan = resolve_loss_plan(LossSection(support="teacher"), device=engine.device,
                                 dtype=engine.params_dtype, teacher_kind="topk")
        scored = _scored(7, dense=False)
        rows = scored.teacher[2]
        ids = rows.ids.clone()
        ids[-1, 1] = ids[-1, 0]   # an id twice in a response row of the third sample
        scored.teacher[2] = TopKTeacher(ids=ids, logprobs=rows.logprobs)
        before = [p.detach().clone() for p in engine.parameters()]
        par = ParallelSection(micro_batch_size=2, global_batch_size=4)
        with pytest.raises(MalformedTeacherOutputError, match="an id twice in a row; no update applied"):
            train_stage(engine, scored, plan, par, shard_layout(engine), ps.get_tensor_model_parallel_group())
        return all(torch.equal(a, b.detach()) for a, b in zip(before, engine.parameters()))
    finally:
        destroy_parallel()


def test_malformed_topk_rows_stop_the_step_without_an_update(student):
    assert run_distributed(_malformed_step, 1, student)[0]

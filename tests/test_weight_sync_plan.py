"""Bucket plan: layout rules, digest, and the messages that name the offending tensor."""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.weight_sync.plan import ALIGN_BYTES, BucketPlan, tensor_group


class MetaForPlanTest:
    """Stands in for `opkd_mcore.models.WeightMeta` (same four fields) to keep these tests pure."""

    def __init__(self, hf_name, shape, dtype=torch.float32, pp_stage=0):
        self.hf_name, self.shape, self.dtype, self.pp_stage = hf_name, shape, dtype, pp_stage


def _layer(i, stage=0, hidden=32, dtype=torch.float32):
    p = f"model.layers.{i}."
    return [MetaForPlanTest(p + "self_attn.q_proj.weight", (hidden, hidden), dtype, stage),
            MetaForPlanTest(p + "self_attn.k_proj.weight", (hidden // 2, hidden), dtype, stage),
            MetaForPlanTest(p + "self_attn.v_proj.weight", (hidden // 2, hidden), dtype, stage),
            MetaForPlanTest(p + "mlp.gate_proj.weight", (2 * hidden, hidden), dtype, stage),
            MetaForPlanTest(p + "input_layernorm.weight", (hidden,), dtype, stage)]


def _model(num_layers=4, stages=1, hidden=32, dtype=torch.float32):
    per_stage = num_layers // stages
    meta = [MetaForPlanTest("model.embed_tokens.weight", (100, hidden), dtype, 0)]
    for i in range(num_layers):
        meta += _layer(i, i // per_stage, hidden, dtype)
    meta += [MetaForPlanTest("model.norm.weight", (hidden,), dtype, stages - 1),
             MetaForPlanTest("lm_head.weight", (100, hidden), dtype, stages - 1)]
    return meta


def _layer_bytes(hidden=32):
    return 4 * (hidden * hidden + 2 * (hidden // 2) * hidden + 2 * hidden * hidden) + 4 * ALIGN_BYTES


def test_layout_invariants():
    meta = _model(num_layers=6, stages=2)
    plan = BucketPlan.from_metadata(meta, bucket_bytes=2 * _layer_bytes())
    assert [s.name for s in plan.slots] == [m.hf_name for m in meta]
    for bucket in plan.buckets:
        stages = {plan.slots[i].pp_stage for i in bucket.slots}
        assert stages == {bucket.pp_stage}  # never mixes stages
        spans = sorted((plan.slots[i].offset, plan.slots[i].offset + plan.slots[i].nbytes) for i in bucket.slots)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        assert all(off % ALIGN_BYTES == 0 for off, _ in spans)
        assert spans[-1][1] <= bucket.nbytes <= plan.bucket_bytes
        assert not bucket.splits_group
    # no decoder layer is split across buckets when it fits in one
    for i in range(6):
        assert len({plan.slot(f"model.layers.{i}.{n}").bucket for n in
                    ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "input_layernorm.weight")}) == 1
    assert plan.stages == (0, 1)
    assert plan.total_bytes == sum(s.nbytes for s in plan.slots)


def test_large_tensor_goes_alone_and_oversized_group_is_flagged():
    meta = [MetaForPlanTest("model.embed_tokens.weight", (1000, 64)),  # 256000 bytes > bucket
            *_layer(0, hidden=64)]  # one layer (~57 KB) larger than the bucket as a whole
    plan = BucketPlan.from_metadata(meta, bucket_bytes=40_000)
    embed = plan.slot("model.embed_tokens.weight")
    assert [b.slots for b in plan.buckets if b.index == embed.bucket] == [(0,)]
    layer_buckets = {plan.slot(m.hf_name).bucket for m in meta[1:]}
    assert len(layer_buckets) > 1
    assert all(plan.buckets[b].splits_group for b in layer_buckets)
    assert not plan.buckets[embed.bucket].splits_group


def test_digest_is_stable_and_sensitive():
    a = BucketPlan.from_metadata(_model(), 4096)
    b = BucketPlan.from_metadata(_model(), 4096)
    assert a.digest() == b.digest() and a.first_difference(b) is None
    assert BucketPlan.from_json(a.to_json()).digest() == a.digest()
    other_dtype = BucketPlan.from_metadata(_model(dtype=torch.bfloat16), 4096)
    assert other_dtype.digest() != a.digest()
    msg = a.first_difference(other_dtype)
    assert "'model.embed_tokens.weight'" in msg and "bfloat16" in msg
    other_bucket = BucketPlan.from_metadata(_model(), 8192)
    assert "bucket" in a.first_difference(other_bucket)
    shorter = BucketPlan.from_metadata(_model()[:-1], 4096)
    assert "'lm_head.weight' exists only here" in a.first_difference(shorter)


def test_mismatch_against_expected_names_tensor():
    plan = BucketPlan.from_metadata(_model(num_layers=2), 4096)
    expected = {s.name: (s.shape, s.dtype) for s in plan.slots}
    assert plan.mismatch_against(expected) is None
    wrong_shape = dict(expected, **{"model.layers.1.mlp.gate_proj.weight": ((7, 32), torch.float32)})
    assert "'model.layers.1.mlp.gate_proj.weight'" in plan.mismatch_against(wrong_shape)
    missing = {k: v for k, v in expected.items() if k != "model.norm.weight"}
    assert "'model.norm.weight'" in plan.mismatch_against(missing)
    extra = dict(expected, **{"model.layers.0.self_attn.q_norm.weight": ((8,), torch.float32)})
    assert "'model.layers.0.self_attn.q_norm.weight'" in plan.mismatch_against(extra)


def test_tensor_group():
    assert tensor_group("model.layers.12.mlp.experts.3.up_proj.weight") == "model.layers.12"
    assert tensor_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert tensor_group("lm_head.weight") == "lm_head"


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPlan.from_metadata(_model(), bucket_bytes=10)
    with pytest.raises(ValueError, match="'model.norm.weight' appears twice"):
        BucketPlan.from_metadata(_model() + [MetaForPlanTest("model.norm.weight", (32,))], 4096)
    with pytest.raises(ValueError, match="attribute 'hf_name'"):
        BucketPlan.from_metadata([("x", (1,), torch.float32, 0)], 4096)
    with pytest.raises(ValueError, match="'w' has dtype 'float32'"):
        BucketPlan.from_metadata([MetaForPlanTest("w", (1,), "float32")], 4096)
    with pytest.raises(ValueError, match="metadata"):
        BucketPlan.from_metadata([], 4096)


def test_accepts_models_weight_meta():
    from opkd_mcore.models import WeightMeta

    plan = BucketPlan.from_metadata([WeightMeta("model.norm.weight", (8,), torch.float32, 0)], 4096)
    assert plan.slot("model.norm.weight").nbytes == 32


def _moe_model(num_layers=3, experts=4, hidden=32):
    """An MoE model's export split into two sources (EP=2): source 0 has the shared tensors and
    experts [0, experts/2), source 1 the other experts, listed in HF order as the export does."""
    meta = [MetaForPlanTest("model.embed_tokens.weight", (100, hidden), torch.float32, 0)]
    for i in range(num_layers):
        meta += _layer(i, 0, hidden)
        for e in range(experts):
            for w in ("gate_proj", "up_proj", "down_proj"):
                meta.append(MetaForPlanTest(f"model.layers.{i}.mlp.experts.{e}.{w}.weight", (hidden, hidden),
                                            torch.float32, int(e >= experts // 2)))
    meta += [MetaForPlanTest("model.norm.weight", (hidden,), torch.float32, 0),
             MetaForPlanTest("lm_head.weight", (100, hidden), torch.float32, 0)]
    return meta


def _groups_of(plan, bucket):
    return [tensor_group(plan.slots[i].name) for i in bucket.slots]


def test_layer_order_merges_sources_so_each_layer_completes_before_the_next():
    # one layer's share per bucket and source (source 0's is 41,216 bytes, source 1's 24,576)
    plan = BucketPlan.from_metadata(_moe_model(), bucket_bytes=44 * 1024)
    assert plan.order == "layer" and plan.stages == (0, 1)
    sequence = plan.receive_sequence()
    assert sorted(b.index for b in sequence) == list(range(len(plan.buckets)))
    for stage in plan.stages:  # each source's buckets keep their own order
        assert [b for b in sequence if b.pp_stage == stage] == plan.stage_buckets(stage)
    # the independent reference: every layer's tensors (both sources) arrive before any of the next
    # layer's; the embedding first, the final norm and LM head last
    seen = [g for b in sequence for g in _groups_of(plan, b)]
    layers = [int(g.split(".")[2]) for g in seen if ".layers." in g]
    assert layers == sorted(layers) and seen[0] == "model.embed_tokens" and seen[-1] == "lm_head"
    # the embedding, then one bucket per layer and source, then the final norm and LM head
    assert [b.pp_stage for b in sequence] == [0, 0, 1, 0, 1, 0, 1, 0]
    assert not any(b.splits_group for b in plan.buckets)
    # drained source after source, layer 0's experts of source 1 come after every layer of source 0
    by_source = BucketPlan.from_metadata(_moe_model(), bucket_bytes=44 * 1024, order="source")
    assert [b.pp_stage for b in by_source.receive_sequence()] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert by_source.digest() != plan.digest()  # both ends agree on the order through the digest
    assert BucketPlan.from_json(by_source.to_json()).order == "source"


def test_layer_order_keeps_pipeline_stages_in_stage_order():
    plan = BucketPlan.from_metadata(_model(num_layers=4, stages=2), bucket_bytes=2 * _layer_bytes())
    sequence = plan.receive_sequence()
    assert [b.index for b in sequence] == list(range(len(plan.buckets)))
    assert [b.pp_stage for b in sequence] == sorted(b.pp_stage for b in sequence)


def test_layer_order_takes_a_split_group_before_the_other_source():
    # source 0's layer groups are larger than a bucket: both pieces of layer i come before source 1's
    # layer i + 1, and the ties go to the lower source
    plan = BucketPlan.from_metadata(_moe_model(num_layers=2, experts=8), bucket_bytes=16 * 1024)
    sequence = plan.receive_sequence()
    firsts = [(int(_groups_of(plan, b)[0].split(".")[2]) if ".layers." in _groups_of(plan, b)[0] else None,
               b.pp_stage) for b in sequence]
    layer_items = [f for f in firsts if f[0] is not None]
    assert layer_items == sorted(layer_items)
    assert any(b.splits_group for b in plan.buckets)


def test_unknown_receive_order_is_refused():
    with pytest.raises(ValueError, match="order: expected one of"):
        BucketPlan.from_metadata(_model(), order="random")

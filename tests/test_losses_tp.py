"""kd_loss over a vocabulary sharded across real processes (gloo): TP = 2 and TP = 4 give the TP = 1
values and gradients. One spawned group of 4 processes runs every case: the whole world is the
TP = 4 group and two subgroups {0, 1}, {2, 3} are TP = 2 groups."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests._dist import run_distributed

N, VOCAB, K = 6, 4 * 37, 8  # 148 is not a multiple of 128; shards of 37 (TP 4) and 74 (TP 2)


def make_inputs(dtype):
    gen = torch.Generator().manual_seed(1234)
    student = torch.randn(N, VOCAB, generator=gen, dtype=torch.float64) * 2
    teacher = torch.randn(N, VOCAB, generator=gen, dtype=torch.float64) * 2
    log_p = torch.log_softmax(teacher, dim=-1)
    ids = log_p.topk(K, dim=-1).indices
    # row 0: the first id of every TP-4 shard (and of every TP-2 shard) next to off-shard ids
    ids[0] = torch.tensor([0, 37, 74, 111, 5, 40, 147, 80])
    logprobs = log_p.gather(1, ids)
    ids[1, 3:6] = -1  # padding inside a row
    ids[2] = -1  # all padding
    logprobs = torch.where(ids >= 0, logprobs, torch.tensor(float("-inf"), dtype=torch.float64))
    return student.to(dtype), teacher.to(dtype), ids, logprobs.to(dtype)


def cases():
    out = [dict(divergence=d, beta=b, support=None) for d, b in (("forward_kl", .5), ("reverse_kl", .5),
                                                                   ("jsd", .3), ("jsd", 0.0), ("jsd", 1.0))]
    for teacher_kind, support in (("dense", "teacher"), ("topk", "teacher"), ("dense", "union")):
        for divergence, beta in (("forward_kl", .5), ("reverse_kl", .5), ("jsd", .3)):
            for mass in ("renorm", "tail", "raw"):
                if mass == "raw" and divergence != "forward_kl":
                    continue
                out.append(dict(teacher_kind=teacher_kind, divergence=divergence, beta=beta, support=support,
                                mass=mass, coverage_coef=0.5, k=5 if teacher_kind == "dense" else None))
    return out


def compare_case(case, dtype, group, tp_rank, tp_size):
    """Max |difference| of (value, local gradient, masses, overlap) between this TP group and TP = 1."""
    from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss_with_stats

    case = dict(case)
    kind = case.pop("teacher_kind", "dense")
    student, teacher, ids, logprobs = make_inputs(dtype)
    shard = slice(tp_rank * VOCAB // tp_size, (tp_rank + 1) * VOCAB // tp_size)
    full_teacher = DenseTeacher(teacher) if kind == "dense" else TopKTeacher(ids, logprobs)
    local_teacher = DenseTeacher(teacher[:, shard].contiguous()) if kind == "dense" else full_teacher
    weights = torch.linspace(-1.0, 2.0, N, dtype=torch.float64)
    full_in = student.clone().requires_grad_()
    local_in = student[:, shard].clone().requires_grad_()
    full, full_stats = kd_loss_with_stats(full_in, full_teacher, temperature=1.3, overlap_k=4, **case)
    local, local_stats = kd_loss_with_stats(local_in, local_teacher, temperature=1.3, tp_group=group,
                                            overlap_k=4, **case)
    (full * weights.to(full.dtype)).sum().backward()
    (local * weights.to(local.dtype)).sum().backward()
    diffs = [(full - local).abs().max(), (full_in.grad[:, shard] - local_in.grad).double().abs().max(),
             (full_stats.teacher_mass - local_stats.teacher_mass).abs().max(),
             (full_stats.student_mass - local_stats.student_mass).abs().max(),
             (full_stats.topk_overlap - local_stats.topk_overlap).abs().max()]
    return [float(d) for d in diffs], float(local_in.grad.double().abs().sum()), local.double().tolist()


def tp_worker(rank, world_size):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank must create every group
    results = {}
    for tp_size, group, tp_rank in ((4, dist.group.WORLD, rank), (2, pairs[rank // 2], rank % 2)):
        for dtype in (torch.float64, torch.bfloat16):
            for i, case in enumerate(cases() if dtype == torch.float64 else cases()[5::4]):
                results[(tp_size, str(dtype), i)] = compare_case(case, dtype, group, tp_rank, tp_size)
    return results


def test_tp2_and_tp4_match_tp1():
    per_rank = run_distributed(tp_worker, 4)
    keys = per_rank[0].keys()
    assert len(keys) == 2 * (len(cases()) + len(cases()[5::4]))
    for key in keys:
        tp_size, dtype, i = key
        tol = 1e-12 if dtype == "torch.float64" else 1e-5  # bf16 inputs: fp32 math, reduction order
        grad_tol = 1e-12 if dtype == "torch.float64" else 1e-2  # bf16 gradients: one rounding step
        for rank, results in enumerate(per_rank):
            (value, grad, t_mass, s_mass, overlap), grad_norm, _ = results[key]
            where = f"TP={tp_size} {dtype} case {i} ({cases()[i] if 'float64' in dtype else ''}) rank {rank}"
            assert value < tol and t_mass < tol and s_mass < tol and overlap == 0.0, where
            assert grad < grad_tol * max(1.0, grad_norm), where
        # the per-token loss is identical on every rank of a TP group
        group_ranks = range(4) if tp_size == 4 else ((0, 1), (2, 3))[0]
        values = [per_rank[r][key][2] for r in group_ranks]
        assert all(v == values[0] for v in values), key
    # something was actually differentiated on every shard
    assert all(res[(4, "torch.float64", 7)][1] > 0 for res in per_rank)

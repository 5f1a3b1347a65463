"""Packed-sequence RoPE and attention boundaries without host syncs (`opkd_mcore.platform`).

`megatron_thd_rope.apply_rotary_pos_emb_thd` against megatron-core's own `_apply_rotary_pos_emb_thd`
(bitwise: both end in Megatron's `_apply_rotary_pos_emb_bshd` on the same frequencies), in both of
Megatron's frequency layouts, with and without interleaving; Megatron's reads the device (`.item()`)
and ours does not. `sdpa_attention.packed_layout` reads a `cu_seqlens` tensor once, however many
layers ask, and again after an in-place change. Real process groups of one rank (spawned).
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests._host_sync import SyncingOpRecorder

pytest.importorskip("megatron.core")


def _rope_cases(rank, world):
    import torch.distributed as dist
    from megatron.core.models.common.embeddings import rope_utils

    from opkd_mcore.platform import megatron_thd_rope

    group = dist.new_group([0])
    assert megatron_thd_rope.install() and megatron_thd_rope.install()   # idempotent
    assert rope_utils._apply_rotary_pos_emb_thd is megatron_thd_rope.apply_rotary_pos_emb_thd
    original = megatron_thd_rope._ORIGINAL
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7, 3]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(total, 3, 8, generator=g)
    results = []
    for rows in (max(lengths) + 2, total):   # Megatron's two layouts: max length, or one row per token
        freqs = torch.randn(rows, 1, 1, 8, generator=g)
        for interleaved in (False, True):
            kwargs = {"rotary_interleaved": interleaved, "mscale": 1.3, "cp_group": group}
            with SyncingOpRecorder() as theirs_rec:
                theirs = original(t, cu, freqs, **kwargs)
            with SyncingOpRecorder() as ours_rec:
                ours = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, **kwargs)
            assert torch.equal(ours, theirs), (rows, interleaved)
            assert not ours_rec.seen, ours_rec.seen
            results.append(bool(theirs_rec.seen))
    return results


def test_thd_rope_equals_megatron_without_its_host_reads():
    (megatron_synced,) = run_distributed(_rope_cases, 1)
    assert all(megatron_synced)   # the check can fail: Megatron's own version is caught


def test_thd_rope_install_refuses_a_different_signature(monkeypatch, caplog):
    from megatron.core.models.common.embeddings import rope_utils

    from opkd_mcore.platform import megatron_thd_rope

    def other(t, cu_seqlens, freqs, cp_size=1):
        return t

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", other)
    assert megatron_thd_rope.install() is False
    assert rope_utils._apply_rotary_pos_emb_thd is other
    assert "keeping it" in caplog.text


def test_packed_layout_reads_each_tensor_once():
    from opkd_mcore.platform.sdpa_attention import packed_layout

    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    first = packed_layout(cu)
    assert first.bounds == [0, 3, 4, 9]
    with SyncingOpRecorder() as rec:
        for _ in range(8):   # the other layers of the forward
            assert packed_layout(cu) is first
    assert not rec.seen
    seq, pos = first.padded_batch_indices(torch.device("cpu"))
    assert seq.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2] and pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert first.padded_batch_indices(torch.device("cpu"))[0] is seq
    cu[3] = 8                                                      # modified in place: read again
    assert packed_layout(cu) is not first and packed_layout(cu).bounds == [0, 3, 4, 8]
    same_values = torch.tensor([0, 3, 4, 8], dtype=torch.int32)    # another micro-batch's tensor
    assert packed_layout(same_values) is not packed_layout(cu)

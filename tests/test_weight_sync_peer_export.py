"""The peer export at TP=2 in real processes: each TP rank writes its own shards into the sending
rank's buckets (CPU shared memory standing in for device peer access), no all-gather runs, and the
receiver gets the same bytes as the gathering export, for tied and untied output layers.
"""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import asdict

import pytest
import torch

from opkd_mcore.weight_sync.megatron_source import SyncGroupsConfig
from tests._dist import free_port, run_distributed
from tests.test_weight_sync_replay import change_weights
from tests.test_weight_sync_transport import _digest, _receiver_proc, _start


def _tp2_sender(rank, world, hf_dir, sync_cfg, unmappable_rank=None):
    """Three syncs after changing the weights in place (the third after a parameter got new
    storage); per sync the gathering export's digests (the reference) and how many all-gathers
    the sync itself ran. `unmappable_rank`: that TP rank cannot map the sender's buffers (as a
    rank on another host, or whose process sees one device, could not)."""
    import torch.distributed as dist

    from opkd_mcore.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights
    from opkd_mcore.platform.ipc_handles import IpcHandleError
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.weight_sync import peer_export
    from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport

    if rank == unmappable_rank:
        def refuse(handle, what, peer=False):
            raise IpcHandleError(f"{what}: could not map the sender's buffer (test: no peer access)")
        peer_export.open_ipc_handle = refuse
    init_parallel(ParallelConfig(tp=2, seed=3))
    try:
        chunks = build_model(load_hf_config(hf_dir), params_dtype=torch.float32)
        load_hf_weights(chunks, hf_dir)
        sync = MegatronWeightExport(chunks, SyncGroupsConfig(**sync_cfg))
        sync.connect()
        gathers = {"n": 0}
        name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        real = getattr(dist, name)  # what the gathering export calls (torch >= 2.13 renamed it)

        def counted(*args, **kwargs):
            gathers["n"] += 1
            return real(*args, **kwargs)

        params, out = list(chunks[0].parameters()), []
        for v in (1, 2, 3):
            change_weights(params, v, move=v == 3)
            reference = {n: _digest(t) for n, t in iter_hf_weights(chunks, stages="local")}
            gathers["n"] = 0
            setattr(dist, name, counted)
            try:
                sync.sync(v)
            finally:
                setattr(dist, name, real)
            out.append((reference, gathers["n"]))
        sync.close()
        return {"owner": sync.sender is not None, "peer": sync.peer is not None, "syncs": out}
    finally:
        destroy_parallel()


@pytest.mark.parametrize("tp_export,tied,unmappable", [("auto", False, None), ("peer", True, None),
                                                       ("gather", False, None), ("auto", True, 1)])
def test_tp2_export_delivers_the_gathered_bytes(tmp_path, tp_export, tied, unmappable):
    """`auto` with a rank that cannot map the buffers all-gathers instead (and says so in its log)."""
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    shape = TinyModelShape(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=tied)
    hf_dir = save_tiny_hf_model(str(tmp_path / "tiny"), "qwen3", shape)
    cfg = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=120,
                           bucket_bytes=64 * 1024, tp_export=tp_export)
    queue = mp.get_context("spawn").Queue()
    receiver = _start(_receiver_proc, 1, cfg.stage_groups(1), 3, 10**6, queue)
    per_rank = run_distributed(_tp2_sender, 2, hf_dir, asdict(cfg), unmappable)
    kind, _, payload = queue.get(timeout=120)
    receiver.join(30)
    assert kind == "receiver", payload
    versions, loaded = payload[0], payload[1]
    assert versions == [1, 2, 3]
    (owner,) = [r for r in per_rank if r["owner"]]
    peer = tp_export != "gather" and unmappable is None
    assert all(r["peer"] == peer for r in per_rank)
    for (reference, gathers), received in zip(owner["syncs"], loaded):
        assert received == reference  # every tensor, bit for bit, padding rows of the vocabulary dropped
        assert (gathers == 0) == peer, gathers


def test_tp_export_choices_agree_with_the_config_check():
    from opkd_mcore.config import validate
    from opkd_mcore.weight_sync.peer_export import TP_EXPORTS

    assert validate.TP_EXPORTS == TP_EXPORTS


def test_peer_export_of_an_moe_model_is_refused_naming_the_key():
    """An MoE student's experts leave from their own EP ranks; the peer export covers dense models."""
    from types import SimpleNamespace

    from opkd_mcore.weight_sync import megatron_source

    fake = SimpleNamespace(ep=2, cfg=SyncGroupsConfig(tp_export="peer"))
    with pytest.raises(ValueError, match=r"weight_sync.tp_export=peer: dense models only .*expert parallelism 2"):
        megatron_source.MegatronWeightExport._check_tp_export(fake)


def _tp2_peer_required(rank, world, hf_dir, sync_cfg):
    try:
        _tp2_sender(rank, world, hf_dir, sync_cfg, unmappable_rank=1)
    except RuntimeError as err:
        return str(err)
    return None


def test_peer_export_required_but_unmappable_names_the_rank(tmp_path):
    """`tp_export=peer` where TP rank 1 cannot map the sender's buffers: every rank fails at the first
    sync naming the rank and the key (nothing was sent; the receiver is never needed)."""
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    hf_dir = save_tiny_hf_model(str(tmp_path / "tiny"), "qwen3", TinyModelShape(num_key_value_heads=2))
    cfg = SyncGroupsConfig(base_port=free_port(8), num_receivers=0, timeout_s=60, bucket_bytes=64 * 1024,
                           tp_export="peer")
    errors = run_distributed(_tp2_peer_required, 2, hf_dir, asdict(cfg))
    assert all(e is not None and "weight_sync.tp_export=peer: TP rank(s) [1] could not map" in e
               for e in errors), errors

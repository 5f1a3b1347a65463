"""Weight sync: bucketed export from the trainer into the rollout engine (see DESIGN.md, issue 5).

plan.py (bucket plan + digest) · sender.py (per-PP-stage, double-buffered) · transport.py (ABC +
registry) · group_transport.py / colocated_ipc.py (transports) · bucket_receiver.py (engine-free
receive) · receiver.py (vLLM worker extension) · vllm_handle.py (driver side, concurrent start) ·
megatron_source.py (who sends what from a Megatron job) · engine_link.py (trainer rank that
also drives the engine) · copy_replay.py (a bucket's pack or load recorded once, replayed as copies).
"""
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from opkd_mcore.weight_sync.engine_link import EngineWeightSync
from opkd_mcore.weight_sync.megatron_source import MegatronWeightSync, SyncGroupsConfig
from opkd_mcore.weight_sync.plan import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    BucketPlan,
    PlanMismatchError,
    TensorSlot,
)
from opkd_mcore.weight_sync.sender import SenderStats, WeightSender
from opkd_mcore.weight_sync.transport import (
    TRANSPORTS,
    TransportConfig,
    WeightSyncAborted,
    WeightSyncTimeout,
    WeightTransport,
    make_transport,
)
from opkd_mcore.weight_sync.vllm_handle import RECEIVER_CLS, VllmSyncHandle, run_concurrently

__all__ = [
    "BucketReceiver", "EngineWeightSync", "MegatronWeightSync", "SyncGroupsConfig", "RECEIVER_CLS", "VllmSyncHandle",
    "run_concurrently", "DEFAULT_BUCKET_BYTES", "Bucket", "BucketPlan", "PlanMismatchError", "TensorSlot", "SenderStats",
    "WeightSender", "TRANSPORTS", "TransportConfig", "WeightSyncAborted", "WeightSyncTimeout",
    "WeightTransport", "make_transport",
]

"""Weight sync: bucketed export from the trainer into the rollout engine (see DESIGN.md, "Weights on
the wire").

Sending side: plan.py (bucket plan + digest) · `BucketSender` (sender.py: one source's tensors
packed into two reused buffers and streamed) · `MegatronWeightExport` (megatron_source.py: on
every trainer rank, which ranks export and send what, TP / EP gathers or the peer export) ·
copy_replay.py (a bucket's pack or load recorded once, replayed as copies).
Transports: `WeightTransport` (transport.py: the ABC + registry) · group_transport.py /
colocated_ipc.py.
Receiving side: `BucketReceiver` (bucket_receiver.py: engine-free receive) · receiver.py (the vLLM
worker extension) · `VllmReceiverHandle` (vllm_handle.py: the driver's non-blocking calls to an
engine's workers).
Both ends in one process: `SpmdWeightSync` (engine_link.py: the torchrun layout's rank that owns
the engine pauses it, receives and sends in one call).
"""
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from opkd_mcore.weight_sync.engine_link import SpmdWeightSync
from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport, SyncGroupsConfig
from opkd_mcore.weight_sync.plan import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    BucketPlan,
    PlanMismatchError,
    TensorSlot,
)
from opkd_mcore.weight_sync.sender import BucketSender, SenderStats
from opkd_mcore.weight_sync.transport import (
    TRANSPORTS,
    TransportConfig,
    WeightSyncAborted,
    WeightSyncTimeout,
    WeightTransport,
    make_transport,
)
from opkd_mcore.weight_sync.vllm_handle import RECEIVER_CLS, VllmReceiverHandle, run_concurrently

__all__ = [
    "BucketReceiver", "SpmdWeightSync", "MegatronWeightExport", "SyncGroupsConfig", "RECEIVER_CLS",
    "VllmReceiverHandle", "run_concurrently", "DEFAULT_BUCKET_BYTES", "Bucket", "BucketPlan",
    "PlanMismatchError", "TensorSlot", "SenderStats", "BucketSender", "TRANSPORTS", "TransportConfig",
    "WeightSyncAborted", "WeightSyncTimeout", "WeightTransport", "make_transport",
]

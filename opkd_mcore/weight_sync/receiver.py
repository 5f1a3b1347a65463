"""The vLLM side: a worker extension that receives weight buckets and loads them into the model.

Pass `worker_extension_cls="opkd_mcore.weight_sync.receiver.VllmWeightReceiver"` to `vllm.LLM`;
the driver then reaches these methods with `llm.collective_rpc(name, args=...)` (see
`vllm_handle.py`, which also starts the calls concurrently with the trainer's side).

Why not vLLM's native weight-transfer API: its engines are configured at engine start, its
collective engine is tied to one GPU backend (nothing for CPU groups or other accelerators), and
the API changed twice in a year. We use the layers it is built on: `model.load_weights` per
bucket straight into the engine's tensors where vLLM's processing after loading is a no-op (dense
unquantized models on GPUs, and unquantized fused-MoE experts on vLLM's Triton backends: one copy
per tensor, or per expert tensor, no allocation; from the second sync on, each bucket's recorded
copies are replayed without the Python loaders, see `copy_replay.py`), and layerwise reload
(`initialize_layerwise_reload` → `load_weights` per bucket → `finalize_layerwise_reload`)
everywhere else, e.g. on CPU backends that repack linear weights after loading (a plain
`load_weights` into such an engine fails). `engine_load_mode` decides.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict

import torch

from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver, ExpectedWeights
from opkd_mcore.weight_sync.copy_replay import ModelStorages, replay_over
from opkd_mcore.weight_sync.transport import TransportConfig

logger = logging.getLogger(__name__)


def expected_hf_weights(hf_config, dtype: torch.dtype) -> ExpectedWeights:
    """Names/shapes of the HF checkpoint tensors of an architecture, from its config alone (meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    state, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights travel once, under their first name
            continue
        seen.add(id(tensor))
        state[name] = tensor
    # transformers >= 5 holds MoE experts fused ([E, 2F, H] gate_up_proj); checkpoints (and our
    # stream) name them per expert. Its save-time reversal maps back, shapes only on meta tensors.
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: the module's names are the checkpoint's
        revert_weight_conversion = None
    if revert_weight_conversion is not None:
        state = revert_weight_conversion(model, state)
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


def _layerwise_reload_api():
    try:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError as err:  # the API moved between vLLM releases; keep the failure explicit
        raise ImportError("weight sync needs vLLM's layerwise reload "
                          "(vllm.model_executor.model_loader.reload.layerwise)") from err
    return initialize_layerwise_reload, finalize_layerwise_reload


def _own_deferred_tensors(buffers: list[torch.Tensor]) -> tuple[int, int]:
    """Copy what vLLM's layerwise reload keeps of a bucket beyond `load_weights`; returns how many
    layers hold loaded tensors (incomplete: waiting for more) and the bytes copied.

    The reload buffers the arguments of a layer's weight loaders until the layer is complete (an
    MoE layer's experts come from every EP rank's source; a layer whose loaded elements do not
    reach its size, a vocabulary padded past the checkpoint's rows, waits for `finalize`), and
    until then it holds the very tensors it was given. Those are views into a receive buffer that
    the next bucket overwrites, so they are copied here.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storages = {b.untyped_storage().data_ptr() for b in buffers}
    holding = copied = 0
    for info in list(LAYERWISE_INFO.values()):
        holding += bool(info.loaded_weights)
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                    bound.arguments[key] = value.clone()
                    copied += value.numel() * value.element_size()
    return holding, copied


@contextlib.contextmanager
def _cpu_moe_prepack_on_update(model):
    """Prepack fused-MoE expert weights after a weight update on vLLM's CPU backend.

    vLLM (0.32) runs the experts' own `process_weights_after_loading` (on the CPU: repacking w13/w2
    into the grouped-GEMM layout) only when the MoE kernel is first built; a weight update goes
    through `_setup_kernel` with the kernel already present and skips it, so a reloaded CPU engine
    would multiply with unpacked weights (its own `reload_weights` has the same fault). While this
    context is open, each MoE layer's processing is followed by the experts' processing; the
    layerwise reload then copies the packed values into the engine's tensors. Layers that receive
    nothing are never processed, so nothing is packed twice. Other platforms are left alone.
    """
    from vllm.platforms import current_platform

    patched = []
    if current_platform.is_cpu():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            if experts is None or not hasattr(experts, "process_weights_after_loading") or \
                    any(m is method for m in patched):  # a method object shared by layers: wrap once
                continue

            def process(layer, original=method.process_weights_after_loading, experts=experts):
                original(layer)
                experts.process_weights_after_loading(layer)

            method.process_weights_after_loading = process  # instance attribute: shadows the method
            patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading


# vLLM releases whose unquantized fused-MoE processing was read and found to leave a Triton
# backend's experts exactly as the weight loader writes them (see `_fused_moe_layout_change`)
MOE_DIRECT_VLLM_RELEASES = ("0.26.", "0.32.")


def _fused_moe_layout_change(method, layer) -> str | None:
    """None where vLLM's unquantized fused-MoE processing left `layer`'s experts (w13_weight
    [E, 2F, H], w2_weight [E, H, F]) exactly as the experts' weight loader writes them, else why not.

    Judged on the layer's state after start-up. In the releases listed, processing on a CUDA GPU
    selects a backend ("TRITON" on Hopper: vLLM puts FlashInfer's unquantized kernels after Triton
    on SM90; "BATCHED_TRITON" under a batched all-to-all), converts the weights to its format, which
    for both Triton backends is `.contiguous()` of tensors created contiguous (the same storage
    back), re-registers them as parameters over that storage, and builds the modular kernel, which
    reads them at every call. The other backends re-layout: FlashInfer CUTLASS swaps w1/w3, TRT-LLM
    permutes into blocks, AITER shuffles, XPU transposes, ROCm pads Triton's rows (a strided view,
    seen here as non-contiguous), the CPU repacks. vLLM expert parallelism maps experts through a
    table that EPLB may change and is not accepted either.
    """
    import vllm

    # first: another release may not even have the modules below
    if not vllm.__version__.startswith(MOE_DIRECT_VLLM_RELEASES):
        return f"vLLM {vllm.__version__}: its fused-MoE processing was not checked for in-place loads"
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    if type(method) is not UnquantizedFusedMoEMethod:  # a subclass or platform override may re-layout
        return f"{type(method).__name__} is not vLLM's UnquantizedFusedMoEMethod"
    backend = getattr(method, "unquantized_backend", None)
    if backend not in (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.BATCHED_TRITON):
        return f"fused-MoE backend {getattr(backend, 'value', backend)} converts the expert layout"
    if getattr(method, "moe_kernel", None) is None:
        return "the fused-MoE kernel is not set up (processing has not run)"
    if getattr(layer, "expert_map", None) is not None:
        return "vLLM expert parallelism (an expert map)"
    for name in ("w13_weight", "w2_weight"):
        w = getattr(layer, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_contiguous() \
                or getattr(w, "is_shuffled", False):
            return f"{name} is not a contiguous [experts, rows, cols] tensor in the loaded layout"
    return None


def _processing_change(method, layer) -> str | None:
    """None where vLLM's processing after loading leaves `layer`'s weights as its loaders write them
    (off the CPU), else why not: the unquantized linear / embedding methods (whose processing does
    nothing off the CPU; on the CPU it repacks the weights for its GEMM library) and the
    unquantized fused-MoE method where `_fused_moe_layout_change` finds its processing a no-op."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    process = getattr(type(method), "process_weights_after_loading", None)
    if process in (UnquantizedLinearMethod.process_weights_after_loading,
                   UnquantizedEmbeddingMethod.process_weights_after_loading):
        return None
    if isinstance(method, FusedMoEMethodBase):
        return _fused_moe_layout_change(method, layer)
    return f"{type(method).__name__} processes its weights after loading"


def engine_load_mode(model, on_cpu: bool) -> str:
    """How a sync loads into the engine's model: "direct" or "layerwise".

    "direct" is `model.load_weights` straight into the engine's tensors (each weight loader copies
    its slice in place), as verl and vLLM's own RLHF examples do. It is exact only where vLLM's
    processing after loading is a no-op, so it is chosen only then: off the CPU, and every layer
    that owns weights uses the unquantized linear / embedding method, or the unquantized fused-MoE
    method on a Triton backend without vLLM expert parallelism (`_fused_moe_layout_change`); a
    subclass that overrides the processing, a quantized layer, a fused-MoE layer on another kernel
    all keep "layerwise". "layerwise" is vLLM's layerwise reload: each layer is rebuilt, loaded,
    processed and copied back (needed on the CPU, whose linear layers repack). Attention modules
    own no checkpoint weights in an unquantized model and are not consulted.
    """
    from vllm.model_executor.layers.attention import Attention

    if on_cpu:
        return "layerwise"
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or isinstance(module, Attention):
            continue
        why = _processing_change(method, module)
        if why is not None:
            logger.info("weight sync loads layerwise: %s (%s)", name or type(module).__name__, why)
            return "layerwise"
    return "direct"


class VllmWeightReceiver:
    """Mixed into vLLM's worker class; `self` is the worker (model_runner, model_config, rank)."""

    def opkd_join_weight_sync(self, groups: list[dict], rank_offset: int = 1, check_plan: bool = True,
                              transport: str = "group") -> int:
        """Join one weight-sync group per trainer PP stage; returns this worker's group rank."""
        if getattr(self, "_opkd_receiver", None) is not None:
            # still held: its trainer rebuilt the groups after an engine died (a planned rebuild
            # closes both ends first), so nobody closes the other end with this one
            self._opkd_receiver.close(abort=True)
        expected = None
        if check_plan:
            expected = expected_hf_weights(self.model_config.hf_config, self.model_config.dtype)
        self._opkd_receiver = BucketReceiver(expected)
        self._opkd_replay = None  # records point into the receive buffers, which are new
        self._opkd_weights_consistent = True
        rank = rank_offset + self.rank
        self._opkd_receiver.join([TransportConfig(**g) for g in groups], rank, transport)
        return rank

    def opkd_receive_weights(self) -> int:
        """Receive one full sync into the model; returns the weight version now loaded."""
        self._opkd_enter_t = time.monotonic()  # against the receiver's own start: this method's prologue
        receiver = self._opkd_receiver_or_raise()
        model = self.model_runner.model
        if self._opkd_load_mode() == "direct":
            self._opkd_reload_s, self._opkd_held = 0.0, {}
            self._opkd_weights_consistent = False   # until every bucket is in: a failure leaves a mix
            version = receiver.receive(lambda named: model.load_weights(weights=named),
                                       lambda: self._opkd_replay_for(model), loads_in_place=True)
            self._opkd_weights_consistent = True
            logger.info("loaded weight version %d (in place)", version)
            return version
        initialize, finalize = _layerwise_reload_api()
        start = time.perf_counter()
        initialize(model)
        self._opkd_reload_s = time.perf_counter() - start
        ok = False
        held = self._opkd_held = {"layers_max": 0, "copied_bytes": 0, "copy_s": 0.0}

        def load(named):
            model.load_weights(weights=named)
            start = time.perf_counter()
            layers, copied = _own_deferred_tensors(receiver.buffers())
            held["copy_s"] += time.perf_counter() - start
            held["layers_max"] = max(held["layers_max"], layers)
            held["copied_bytes"] += copied

        with _cpu_moe_prepack_on_update(model):
            try:
                # views even of a bucket that splits a layer: what the reload keeps of them past
                # `load` is copied there (a copy of every such bucket's tensors would add one of
                # whole layers' experts where the plan's buckets are smaller than an MoE layer)
                version = receiver.receive(load, loads_in_place=True)
                ok = True
            finally:
                # restores kernel tensors of layers that got nothing, so the engine stays usable
                start = time.perf_counter()
                finalize(model, self.model_config)
                self._opkd_reload_s += time.perf_counter() - start
                self._opkd_weights_consistent = ok
        logger.info("loaded weight version %d", version)
        return version

    def _opkd_replay_for(self, model):
        """The loaders' copies, recorded once per bucket (anew if the engine's tensors moved)."""
        self._opkd_replay = replay_over(getattr(self, "_opkd_replay", None), self._opkd_storages_of(model))
        return self._opkd_replay

    def _opkd_storages_of(self, model) -> set[int]:
        """Storage pointers of the engine model's tensors, walked again only when they may have moved."""
        storages = getattr(self, "_opkd_storages", None)
        if storages is None or storages.modules[0] is not model:
            # another model object (a rebuild): the old one, still held here, would look unchanged
            storages = self._opkd_storages = ModelStorages(model)
        return storages.current()

    def opkd_weight_sync_stats(self) -> dict:
        stats = asdict(self._opkd_receiver_or_raise().stats)
        stats["weights_consistent"] = self._opkd_weights_consistent
        # host seconds of the last sync in vLLM's layerwise reload set-up and finalize
        stats["last_reload_s"] = getattr(self, "_opkd_reload_s", 0.0)
        # `time.monotonic()` on entering the last receive (the receiver's start is `last_start_t`)
        stats["last_enter_t"] = getattr(self, "_opkd_enter_t", 0.0)
        stats["load_mode"] = self._opkd_load_mode()
        # layerwise loads of the last sync: the most layers vLLM held incomplete after a bucket (their
        # loaded tensors buffered), the bytes of those copied out of the receive buffers, and the
        # host seconds of that check and copy (part of `last_load_s`)
        held = getattr(self, "_opkd_held", {})
        stats["last_layers_in_flight_max"] = held.get("layers_max", 0)
        stats["last_deferred_copy_bytes"] = held.get("copied_bytes", 0)
        stats["last_deferred_copy_s"] = held.get("copy_s", 0.0)
        return stats

    def _opkd_load_mode(self) -> str:
        mode = getattr(self, "_opkd_mode", None)
        if mode is None:
            from vllm.platforms import current_platform

            mode = self._opkd_mode = engine_load_mode(self.model_runner.model, current_platform.is_cpu())
            logger.info("weight sync loads into the engine %s", mode)
        return mode

    def opkd_clock(self) -> float:
        """This worker's `time.monotonic()`: against the caller's clock (one per host), how long
        an engine call takes to reach the worker and to come back."""
        return time.monotonic()

    def opkd_close_weight_sync(self) -> None:
        receiver = getattr(self, "_opkd_receiver", None)
        if receiver is not None:
            receiver.close()
            self._opkd_receiver = None

    def _opkd_receiver_or_raise(self) -> BucketReceiver:
        receiver = getattr(self, "_opkd_receiver", None)
        if receiver is None:
            raise RuntimeError("weight sync: call opkd_join_weight_sync before receiving")
        return receiver

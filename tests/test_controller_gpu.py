"""The Ray controller on two GPUs: one visible device per actor, the peer export, an engine's death.

What the CPU module (`test_controller_schedules.py`) cannot show. Ray gives every actor one visible
device, so trainer rank 1 writes its shards into rank 0's bucket buffers, and engine 1 reads those
buffers, through IPC handles of a device neither can see; and the rebuild after an engine's death
runs with real CUDA processes. Placement colocated (trainer rank r and rollout engine r on GPU r, the
hf teacher beside rank 0), student TP=2, `weight_sync.tp_export: peer` (a rank that cannot map the
buffers is an error, not a fallback), transport auto (device IPC: colocated engines cannot join an
NCCL group with the trainer rank on their device).

- A run of 4 sync steps: both engines end with the trainer's weights. The reference is independent
  of the engines: a float64 `transformers` forward of the run's exported checkpoint scores each
  engine's greedy tokens (logprobs within the float32-on-GPU bound of `conftest.py`, each token the
  reference's arg-max unless the top two are closer than that bound), and the weights moved (the
  initial checkpoint scores the same tokens differently).
- The same run under `one_step_off`: the engines, resident, generate beside the trainer on its GPUs;
  one version stale after the first step, and both engines end with the trainer's weights.
- Rollout engine 0 killed while version 2 streams to it: Ray restarts it, the driver rebuilds the
  groups and syncs again; every prompt is trained exactly once, the first step equals the
  un-faulted run's, and both engines end with the trainer's weights.

Needs two CUDA devices and Ray; marked `gpu`, `vllm`, `slow`.
"""
from __future__ import annotations

import os

import pytest
import torch

from opkd_mcore.train.samples_log import audit, read_samples
from tests.conftest import VLLM_FP32_LOGPROB_ATOL
from tests.test_controller_schedules import DATASET, PROMPTS, STEPS, N, _greedy, write_run_config

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

OVERRIDES = ["controller.kind=ray", "controller.placement=colocated", "controller.rollout_engines=2",
             "controller.sync_timeout_s=30", "weight_sync.tp_export=peer", "run.device=cuda"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    ray = pytest.importorskip("ray")
    from opkd_mcore.config import load_config
    from opkd_mcore.controller import WorkerGroups

    root = tmp_path_factory.mktemp("controller_gpu")
    # a larger step than the CPU module's: the weights must move well past the GPU's float32 bound
    path = write_run_config(root, rollout={"gpu_memory_utilization": 0.2}, optim={"lr": 1e-2},
                            checkpoint={"export_hf_at_end": True})
    ray.init(address="local", num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False)
    groups = None
    try:
        groups = WorkerGroups(load_config(path, OVERRIDES), world_size=2)
        assert groups.transport() == "colocated_ipc"
        yield {"root": root, "config": path, "groups": groups, "student": str(root / "student"),
               "results": {}}
    finally:
        if groups is not None:
            groups.shutdown()
        ray.shutdown()


def _run(cluster, name, *overrides, on_event=None):
    from opkd_mcore.config import load_config
    from opkd_mcore.controller import RayController

    out = str(cluster["root"] / name)
    cfg = load_config(cluster["config"], [*OVERRIDES, f"run.output_dir={out}", *overrides])
    history = RayController(cfg, groups=cluster["groups"], on_event=on_event).run()
    return history, read_samples(out), os.path.join(out, "student_hf")


def _reference_run(cluster):
    if "plain" not in cluster["results"]:
        cluster["results"]["plain"] = _run(cluster, "plain")
    return cluster["results"]["plain"]


def _reference_logprobs(checkpoint: str, samples) -> list[torch.Tensor]:
    """float64 log-softmax rows of a `transformers` forward at each response position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float64).eval()
    rows = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1]
            rows.append(torch.log_softmax(logits, dim=-1))
    return rows


def _assert_engines_hold(cluster, export_dir: str) -> None:
    """Every engine got every sync: its greedy tokens are the exported checkpoint's."""
    import ray

    assert ray.get([r.ping.remote() for r in cluster["groups"].rollouts]) == [STEPS, STEPS]
    moved = 0.0
    for samples in _greedy(cluster["groups"]):
        final = _reference_logprobs(export_dir, samples)
        initial = _reference_logprobs(cluster["student"], samples)
        for s, ref, ref0 in zip(samples, final, initial):
            picked = ref.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert s.response_logprobs == pytest.approx(picked.tolist(), abs=VLLM_FP32_LOGPROB_ATOL)
            top2 = ref.topk(2, dim=-1).values
            clear = top2[:, 0] - top2[:, 1] > 2 * VLLM_FP32_LOGPROB_ATOL
            assert (picked == top2[:, 0])[clear].all(), (s.response_ids, ref.argmax(-1).tolist())
            before = ref0.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
            moved = max(moved, float((picked - before).abs().max()))
    assert moved > 10 * VLLM_FP32_LOGPROB_ATOL  # else an engine left at the initial weights would pass


def test_peer_export_and_device_ipc_with_one_visible_device_per_actor(cluster):
    history, rows, export_dir = _reference_run(cluster)
    assert len(history) == STEPS and audit(rows, N, DATASET).ok and len(rows) == STEPS * PROMPTS * N
    _assert_engines_hold(cluster, export_dir)


def test_engine_killed_mid_sync_is_rebuilt_on_gpus(cluster):
    import ray

    killed = {}

    def kill_mid_sync(name, info):  # the sync after step 1 has started on every member
        if name == "sync_started" and info["version"] == 2 and not killed:
            killed.update(info)
            ray.kill(cluster["groups"].rollouts[0], no_restart=False)

    history, rows, export_dir = _run(cluster, "killed_mid_sync", on_event=kill_mid_sync)
    assert killed and history[-1]["faults/rollout_restarts"] >= 1
    reference_history, reference_rows, _ = _reference_run(cluster)
    assert audit(rows, N, DATASET).ok and len(rows) == STEPS * PROMPTS * N
    # step 0 equals the un-faulted run's; later steps train on updates whose GPU reductions (atomic
    # adds in the embedding's backward) may round differently run to run, so the audit and the
    # engines' weights check them
    assert [r for r in rows if r["step"] == 0] == [r for r in reference_rows if r["step"] == 0]
    assert history[0]["train/loss"] == reference_history[0]["train/loss"]
    _assert_engines_hold(cluster, export_dir)


def test_one_step_off_with_engines_generating_beside_the_trainer_on_its_gpus(cluster):
    """Colocated and overlapped: the engines stay resident and generate step t+1 on the trainer
    ranks' GPUs while step t trains; every prompt is trained once, one version stale after the
    first step, and both engines end with the trainer's weights."""
    history, rows, export_dir = _run(cluster, "one_step_off", "run.schedule=one_step_off")
    assert len(history) == STEPS and audit(rows, N, DATASET).ok and len(rows) == STEPS * PROMPTS * N
    lags = {r["step"]: r["version_trained"] - r["version_generated"] for r in rows}
    assert lags == {0: 0, **{s: 1 for s in range(1, STEPS)}}
    _assert_engines_hold(cluster, export_dir)

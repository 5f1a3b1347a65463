"""An MoE student trained by MegatronEngine with its experts split over expert-TP (ETP=2 at TP=1).

Two gloo processes, a tiny Qwen3-MoE (8 experts, top-2), the experts of `model.moe_experts=auto`
(torch_grouped on a CPU) and again SequentialMLP. Attention and embeddings are data-parallel over
the two ranks while every expert's FFN is split in half over them: Megatron's token dispatcher
gathers the tokens of both ranks over the expert tensor-and-model-parallel group, each rank runs
its half of fc1 / fc2 on all of them and the partial fc2 outputs are summed back by a
reduce-scatter. The same steps at ETP=1 (DP=2, experts replicated) run in the same processes.

Checked against independent references: the losses and gradient norms of every step against the
HF model trained in float64 with `torch.optim.AdamW` (the reference of the EP=2 train tests, same
tolerances), the weights exported after the steps against the ETP=1 run's export, and the export
right after loading against the checkpoint's bytes (so the loader's per-ETP-rank slices and the
export's gather over ETP are each other's inverse). Then `parallel.etp` in the product's config:
`opkd train --check` passes at etp=2 and the layouts that cannot work are config errors naming it.
"""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from opkd_mcore import launch
from opkd_mcore.config import ConfigError, load_config
from tests._dist import run_distributed
from tests._hf_config import hf_checkpoint
from tests.test_engine import CLIP, LR, STEPS, _ce_loss_fn, _global_loss_tokens, _my_micro_batches
from tests.test_models_moe_train import _check_steps, hf_reference

LAYOUTS = {"etp1": dict(ep=1, etp=1), "etp2": dict(ep=1, etp=2), "etp2-sequential": dict(ep=1, etp=2)}
EXPERTS = {"etp2-sequential": "sequential"}  # model.moe_experts of a case; the others: auto


def _loaded_mismatches(chunks, hf_dir: str) -> list[str]:
    """HF names whose export (every rank gathers) differs bitwise from the checkpoint, or is missing."""
    from safetensors import safe_open

    from opkd_mcore.models import iter_hf_weights

    bad, seen = [], set()
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
        for name, tensor in iter_hf_weights(chunks, stages="all"):
            seen.add(name)
            if not torch.equal(f.get_tensor(name), tensor):
                bad.append(name)
        return bad + sorted(set(f.keys()) - seen - {"lm_head.weight"})


def _train_case(name, hf_dir):
    from megatron.core import parallel_state as ps

    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(seed=7, **LAYOUTS[name]))
    try:
        chunks = build_model(load_hf_config(hf_dir), moe_experts=EXPERTS.get(name, "auto"))
        load_hf_weights(chunks, hf_dir)
        mismatches = _loaded_mismatches(chunks, hf_dir)
        engine = MegatronEngine(chunks, OptimSection(lr=LR, clip_grad=CLIP, weight_decay=0.1))
        loss_fn = _ce_loss_fn(_global_loss_tokens())
        history = [engine.train_step(_my_micro_batches(), loss_fn) for _ in range(STEPS)]
        export = {n: t.clone() for n, t in iter_hf_weights(engine.model, stages="all")}
        return {"history": history, "export": export, "loaded_mismatches": mismatches,
                "etp": ps.get_expert_tensor_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
                "expert_dp": ps.get_expert_data_parallel_world_size()}
    finally:
        destroy_parallel()


def _train_worker(rank, world, hf_dir):
    return {name: _train_case(name, hf_dir) for name in LAYOUTS}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    shape = TinyModelShape(vocab_size=255, num_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("moe_etp") / "qwen3_moe"), "qwen3_moe", shape,
                              seed=3, alphabet="0123456789+= ", init_std=0.05)


@pytest.fixture(scope="module")
def trained(hf_dir):
    return run_distributed(_train_worker, 2, hf_dir)


@pytest.fixture(scope="module")
def reference(hf_dir):
    return hf_reference(hf_dir, 0.0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_is_the_one_asked_for(trained, name):
    etp = LAYOUTS[name]["etp"]
    for rank in trained:
        # attention is data-parallel over both ranks; the experts are replicated only at ETP=1
        assert (rank[name]["etp"], rank[name]["dp"], rank[name]["expert_dp"]) == (etp, 2, 2 // etp)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loaded_export_reproduces_checkpoint_bit_for_bit(trained, name):
    for rank in trained:
        assert rank[name]["loaded_mismatches"] == []


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_etp_train_steps_match_hf_adamw(trained, reference, name):
    history = trained[0][name]["history"]
    assert trained[1][name]["history"] == history  # every rank reports the same metrics
    _check_steps(history, reference)


# Adam divides each gradient by its running RMS, so an element whose gradient is ~0 moves by up to LR
# on float32 rounding alone (a few elements of 10^5 do, by ~1e-5): 1% of one step's LR bounds that,
# while a wrong expert-TP shard or a missed gradient reduction moves whole tensors by ~LR per step.
WEIGHT_ATOL = 0.01 * LR


@pytest.mark.parametrize("name", ["etp2", "etp2-sequential"])
def test_etp_export_after_steps_matches_etp1(trained, hf_dir, name):
    from safetensors.torch import load_file

    expected = trained[0]["etp1"]["export"]
    initial = load_file(os.path.join(hf_dir, "model.safetensors"))
    moved = max((expected[n] - initial[n]).abs().max().item() for n in expected if ".experts." in n)
    assert moved > 100 * WEIGHT_ATOL  # the steps moved the experts far beyond the tolerance
    for rank in trained:
        got = rank[name]["export"]
        assert list(got) == list(expected)
        for hf_name, tensor in got.items():
            torch.testing.assert_close(tensor, expected[hf_name], rtol=1e-4, atol=WEIGHT_ATOL,
                                       msg=lambda m, n=hf_name: f"{n}: {m}")


# ----------------------------------------------------------------------------- config
@pytest.fixture
def etp_config(tmp_path, monkeypatch):
    """A run of a weightless tiny Qwen3-MoE student (8 experts of FFN 64) on 2 ranks at etp=2."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tree = {"model": {"student": hf_checkpoint(tmp_path, "moe", family="qwen3_moe")},
            "parallel": {"etp": 2, "world_size": 2, "micro_batch_size": 2, "global_batch_size": 8},
            "loss": {"support": "teacher"},
            "rollout": {"prompts_per_step": 4, "n": 2},
            "teacher": {"teachers": [{"backend": "vllm", "model": hf_checkpoint(tmp_path, "teacher"),
                                      "top_k": 8}]},
            "run": {"output_dir": str(tmp_path / "run")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path), hf_checkpoint(tmp_path, "dense")


def test_opkd_train_check_passes_at_etp2(etp_config, capsys):
    path, _ = etp_config
    assert launch.main(["--check", "--config", path]) == 0, capsys.readouterr().err
    assert yaml.safe_load(capsys.readouterr().out)["parallel"]["etp"] == 2


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.etp=3", "parallel.world_size=3", "parallel.global_batch_size=6", "rollout.n=3",
      "rollout.prompts_per_step=2"], "3 does not divide the student's expert FFN size 64"),
    (["parallel.etp=4", "parallel.world_size=2"], "etp*ep*pp = 4 does not divide the world size 2 (etp=4, ep=1"),
    (["parallel.etp=2", "parallel.ep=2", "parallel.world_size=2"],
     "etp*ep*pp = 4 does not divide the world size 2 (etp=2, ep=2"),
    (["parallel.etp=0"], "> 0"),
])
def test_bad_etp_is_a_config_error_naming_it(etp_config, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(etp_config[0], overrides)
    assert str(err.value).startswith("parallel.etp: ") and fragment in str(err.value), str(err.value)


def test_etp_on_a_dense_student_is_a_config_error_naming_it(etp_config):
    path, dense = etp_config
    with pytest.raises(ConfigError) as err:
        load_config(path, [f"model.student={dense}"])
    assert str(err.value).startswith("parallel.etp: ") and "has no experts" in str(err.value), str(err.value)

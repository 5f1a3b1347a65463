"""Data-parallel rollout: two vLLM engines in two Ray actors behave like one engine (~1 min on 2 cores)."""
import pytest

from opkd_mcore.models.tiny import save_tiny_hf_model
from opkd_mcore.rollout import RolloutConfig, SamplingConfig
from opkd_mcore.rollout.ray_rollout import split_evenly

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 4, 5], [1, 6], [1, 7, 8, 9], [1, 10], [1, 11, 12]]


def test_split_evenly_covers_every_prompt_once():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]


@pytest.mark.slow
def test_two_engines_split_prompts_and_share_versions(tmp_path):
    ray = pytest.importorskip("ray")

    from opkd_mcore.rollout.ray_rollout import RayRolloutGroup

    model_dir = save_tiny_hf_model(str(tmp_path / "tiny"), seed=3, init_std=0.1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}})
    try:
        group = RayRolloutGroup(model_dir, RolloutConfig(dtype="float32", max_model_len=64),
                                num_engines=2)
        sampled = group.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=4, seed=0),
                                 data=[{"i": i} for i in range(len(PROMPTS))])
        assert [s.group_id for s in sampled] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
        assert all(s.prompt_ids == PROMPTS[s.group_id] and s.data == {"i": s.group_id} for s in sampled)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
        samples = group.generate(PROMPTS, greedy)
        # both engines hold the same weights: greedy answers do not depend on which one ran a prompt
        again = group.generate(PROMPTS[::-1], greedy)
        by_prompt = {tuple(s.prompt_ids): s.response_ids for s in samples}
        assert all(by_prompt[tuple(s.prompt_ids)] == s.response_ids for s in again)
        group.pause()
        group.set_weight_version(3)
        group.resume()
        assert {s.weight_version for s in group.generate(PROMPTS, greedy)} == {3}
        group.shutdown()
    finally:
        ray.shutdown()

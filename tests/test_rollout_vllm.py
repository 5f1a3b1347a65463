"""VllmRollout against a real vLLM (CPU build) engine and a `transformers` forward of the same tokens."""
import dataclasses
import logging
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from opkd_mcore.models.tiny import save_tiny_hf_model
from opkd_mcore.rollout import RolloutConfig, SamplingConfig
from tests.conftest import VLLM_FP32_LOGPROB_ATOL, engine_kwargs

pytestmark = pytest.mark.vllm

CHAT_TEMPLATE = "<bos>{% for m in messages %}{{ m['content'] }}={% endfor %}"
PROMPTS = [[1, 4, 5, 6], [1, 7, 8], [1, 9, 10, 11, 12]]
LOGPROB_ATOL = VLLM_FP32_LOGPROB_ATOL   # why it depends on the device: tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # init_std 0.1 gives peaked distributions, so sampled tokens and top-k sets are not near-ties
    out = save_tiny_hf_model(str(tmp_path_factory.mktemp("rollout") / "tiny"), seed=3, init_std=0.1)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rollout(model_dir):
    from opkd_mcore.rollout.vllm_rollout import VllmRollout

    engine = VllmRollout(model_dir, RolloutConfig(dtype="float32", max_model_len=256, **engine_kwargs()))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def hf_response_logits(hf_model, sample):
    """float64 logits of the positions that predict each response token."""
    ids = torch.tensor([sample.sequence])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].double()
    start = len(sample.prompt_ids) - 1
    return logits[start:start + len(sample.response_ids)]


def test_n_samples_per_prompt_with_groups_and_version(rollout):
    data = [{"data_source": f"src{i}"} for i in range(len(PROMPTS))]
    samples = rollout.generate(PROMPTS, SamplingConfig(n=4, temperature=1.0, max_new_tokens=6, seed=1),
                               data=data)
    assert len(samples) == 4 * len(PROMPTS)
    for i, s in enumerate(samples):
        assert s.group_id == i // 4
        assert s.prompt_ids == PROMPTS[s.group_id]
        assert s.data == data[s.group_id]
        assert 1 <= len(s.response_ids) <= 6 and len(s.response_logprobs) == len(s.response_ids)
        assert s.finish_reason in ("length", "stop")
        assert s.weight_version == 0
    # four samples of one prompt at temperature 1 over a peaked-but-not-degenerate model differ
    assert len({tuple(s.response_ids) for s in samples[:4]}) > 1


def test_responses_without_logprobs_are_the_same_tokens(rollout):
    """`SamplingConfig.logprobs=False` (what the trainer asks when nothing reads them): the same
    seeded samples, without the per-token logprob lists."""
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=4)
    with_lp = rollout.generate(PROMPTS, sampling)
    without = rollout.generate(PROMPTS, dataclasses.replace(sampling, logprobs=False))
    assert [s.response_ids for s in without] == [s.response_ids for s in with_lp]
    assert all(s.response_logprobs is None for s in without)
    assert all(len(s.response_logprobs) == len(s.response_ids) for s in with_lp)


def test_seeds_are_per_prompt_and_per_sample_and_reproducible(rollout):
    """The same prompt twice in one batch gets two independent streams (a shared per-request seed
    made them identical); the same seeds give the same samples again, whatever the batching."""
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=11)
    prompt = PROMPTS[2]
    first = [s.response_ids for s in rollout.generate([prompt, prompt], sampling)]
    assert first[:3] != first[3:]  # prompt copies differ
    assert len({tuple(r) for r in first[:3]}) == 3  # so do the samples of one prompt
    assert [s.response_ids for s in rollout.generate([prompt, prompt], sampling)] == first
    seeded = rollout.generate([PROMPTS[0], prompt], SamplingConfig(n=3, temperature=1.0, max_new_tokens=8),
                              seeds=[5, 6])
    alone = rollout.generate([prompt], SamplingConfig(n=3, temperature=1.0, max_new_tokens=8), seeds=[6])
    assert [s.response_ids for s in seeded[3:]] == [s.response_ids for s in alone]


def test_raw_logprobs_are_the_models_at_temperature_one(model_dir, hf_model):
    """`logprobs_mode=raw_logprobs` (what `opkd train` uses): sampled at T=0.7, the logprobs are
    log softmax(z) -- comparable with the student's at T=1 in the policy-gradient ratio."""
    from opkd_mcore.rollout.vllm_rollout import VllmRollout

    engine = VllmRollout(model_dir, RolloutConfig(dtype="float32", max_model_len=128,
                                                  logprobs_mode="raw_logprobs", **engine_kwargs()))
    try:
        samples = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=0.7, max_new_tokens=8, seed=2))
    finally:
        engine.shutdown()
    for s in samples:
        ref = torch.log_softmax(hf_response_logits(hf_model, s), dim=-1)
        expected = ref[torch.arange(len(s.response_ids)), torch.tensor(s.response_ids)]
        torch.testing.assert_close(torch.tensor(s.response_logprobs, dtype=torch.float64),
                                   expected, atol=LOGPROB_ATOL, rtol=0)


def test_sampler_logprobs_match_transformers_with_temperature(rollout, hf_model):
    temperature = 0.7
    samples = rollout.generate(PROMPTS, SamplingConfig(n=2, temperature=temperature,
                                                       max_new_tokens=8, seed=2))
    for s in samples:
        ref = torch.log_softmax(hf_response_logits(hf_model, s) / temperature, dim=-1)
        expected = ref[torch.arange(len(s.response_ids)), torch.tensor(s.response_ids)]
        torch.testing.assert_close(torch.tensor(s.response_logprobs, dtype=torch.float64),
                                   expected, atol=LOGPROB_ATOL, rtol=0)


def test_top_k_sampling_stays_in_top_k_and_renormalises(rollout, hf_model):
    top_k, temperature = 3, 1.3
    samples = rollout.generate(PROMPTS, SamplingConfig(n=3, temperature=temperature, top_k=top_k,
                                                       max_new_tokens=6, seed=3))
    for s in samples:
        logits = hf_response_logits(hf_model, s) / temperature
        top_vals, top_ids = logits.topk(top_k, dim=-1)
        for t, tok in enumerate(s.response_ids):
            assert tok in top_ids[t].tolist(), f"token {tok} at step {t} outside the top-{top_k}"
            expected = logits[t, tok] - torch.logsumexp(top_vals[t], dim=0)
            assert abs(s.response_logprobs[t] - expected.item()) < LOGPROB_ATOL


def test_greedy_stop_token_ends_response(rollout):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    full = rollout.generate(PROMPTS[:1], greedy)[0]
    assert full.finish_reason == "length" and len(full.response_ids) == 8
    stop = full.response_ids[3]
    cut = full.response_ids.index(stop)
    stopped = rollout.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_new_tokens=8,
                                                           stop_token_ids=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == full.response_ids[:cut + 1]


def test_pause_holds_generation_and_new_version_is_recorded(rollout):
    rollout.pause()
    results = []
    worker = threading.Thread(target=lambda: results.extend(
        rollout.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=2, seed=5))))
    worker.start()
    time.sleep(1.0)
    assert worker.is_alive() and not results, "generate ran while the engine was paused"
    rollout.set_weight_version(7)  # a weight update happens here in training
    rollout.resume()
    worker.join(timeout=120)
    assert [s.weight_version for s in results] == [7]
    assert rollout.weight_version == 7
    rollout.set_weight_version(0)


def test_prefix_cache_is_reused_within_a_weight_version_only(rollout, monkeypatch):
    """Requests carry their weight version as vLLM's cache salt: a prompt's cached KV is reused at
    the same version and never after a weight update, so a sync need not reset the cache."""
    block = rollout.llm.llm_engine.vllm_config.cache_config.block_size
    if block + 2 > rollout.cfg.max_model_len:
        pytest.skip(f"this platform's KV block ({block} tokens) is longer than the engine's context")
    prompt = [1] + [4 + i % 20 for i in range(block)]
    cached = []
    generate = rollout.llm.generate

    def spy(*args, **kwargs):  # the real engine's outputs, with how many prompt tokens came from its cache
        outputs = generate(*args, **kwargs)
        cached.extend(o.num_cached_tokens for o in outputs)
        return outputs

    monkeypatch.setattr(rollout.llm, "generate", spy)
    once = SamplingConfig(max_new_tokens=1, seed=1)
    rollout.generate([prompt], once)
    rollout.generate([prompt], once)
    assert cached[-1] >= block  # the same version: the prompt's full block came from the cache
    rollout.set_weight_version(rollout.weight_version + 1)
    rollout.generate([prompt], once)
    assert cached[-1] == 0  # a new version hashes its blocks anew
    rollout.set_weight_version(0)


def test_sleep_degrades_with_message_where_unsupported(rollout, caplog):
    if rollout.sleep_supported:
        pytest.skip("this platform has a real sleep mode")
    with caplog.at_level(logging.WARNING, logger="opkd_mcore.rollout.vllm_rollout"):
        assert rollout.sleep() is False
    assert "nothing freed" in caplog.text
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=1))
    rollout.wake_up()
    assert len(rollout.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=1))) == 1


def test_teacher_on_engine_with_small_max_logprobs_is_refused(rollout):
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    # the rollout engine was built with max_logprobs=20 (RolloutConfig default)
    with pytest.raises(ValueError, match=r"teacher\.k.*at most 20 logprobs"):
        VllmTeacher(rollout.llm, VllmTeacherConfig(k=32))


def test_chat_messages_go_through_the_chat_template(rollout, model_dir):
    messages = [{"role": "user", "content": "12+3"}]
    sample = rollout.generate([messages], SamplingConfig(max_new_tokens=2, seed=0))[0]
    expected = AutoTokenizer.from_pretrained(model_dir)("<bos>12+3=", add_special_tokens=False)
    assert sample.prompt_ids == expected["input_ids"] and len(sample.prompt_ids) == 6


@pytest.mark.parametrize("prompts, sampling, match", [
    ([[]], SamplingConfig(), r"prompts\[0\]"),
    (["12+3"], SamplingConfig(), r"prompts\[0\]"),
    ([[1, 2]], SamplingConfig(n=0), r"sampling\.n"),
    ([[1, 2]], SamplingConfig(top_p=0.0), r"sampling\.top_p"),
    ([[1, 2]], SamplingConfig(n=2, temperature=0.0), r"sampling\.n.*greedy"),
])
def test_bad_input_names_the_argument(rollout, prompts, sampling, match):
    with pytest.raises(ValueError, match=match):
        rollout.generate(prompts, sampling)


def test_config_rejects_unknown_logprobs_mode():
    with pytest.raises(ValueError, match="logprobs_mode"):
        RolloutConfig(logprobs_mode="logits").validate()


def test_logprobs_not_of_the_sampled_tokens_are_refused():
    """vLLM's flat per-token logprobs must start each step with the sampled token; anything else
    would train on another token's logprob."""
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    from opkd_mcore.rollout.vllm_rollout import VllmRollout

    steps = FlatLogprobs()
    steps.append({7: Logprob(logprob=-0.5, rank=1)})
    steps.append({9: Logprob(logprob=-1.5, rank=2)})
    good = SimpleNamespace(token_ids=[7, 9], logprobs=steps, finish_reason="length")
    assert VllmRollout._to_sample([1], good, 3, 0, {}).response_logprobs == [-0.5, -1.5]
    with pytest.raises(RuntimeError, match="prompt 4.*not of its sampled tokens"):
        VllmRollout._to_sample([1], SimpleNamespace(token_ids=[7, 8], logprobs=steps, finish_reason="length"),
                               3, 4, {})

"""Top-k teacher rows on the engine's device (`teacher/device_topk.py`, `scoring: device`).

- the math against a float64 `log_softmax` reference: odd shapes, temperature != 1, chunks, padding
  rows of a padded vocabulary, a vocabulary smaller than k, and the TP form over a real gloo group;
- the packed rows' format and the errors that name a bad row;
- (`-m vllm`) a real vLLM CPU engine: the rows equal `prompt_logprobs`' (ids exactly, ties aside)
  and `transformers`' float64 top-k, at temperature 1 and 0.6, for a sequence that fills the
  engine's context, sequences prefilled in chunks; an engine passed in is scored as it was built;
  TP=2 (slow); and `opkd train` end to end (slow): the losses of the device path equal those of the
  prompt_logprobs path.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from opkd_mcore.losses.teacher_outputs import PAD_ID, MalformedTeacherOutputError, TopKTeacher
from opkd_mcore.teacher.device_topk import (
    device_scoring_blocker,
    pack_rows,
    topk_logprobs,
    unpack_rows,
)
from tests._dist import run_distributed


def _reference(hidden, weight, k, temperature, vocab_size=None):
    """float64 log_softmax over the real vocabulary, its top-k (values descending)."""
    logits = hidden.double() @ weight.double().T
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    return torch.log_softmax(logits / temperature, dim=-1).topk(min(k, logits.shape[1]), dim=-1)


def _inputs(n=37, h=19, v=101, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen) * 0.7


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_topk_logprobs_match_the_float64_reference(temperature, chunk_rows):
    hidden, weight = _inputs()
    logprobs, ids = topk_logprobs(hidden, weight, k=7, temperature=temperature, chunk_rows=chunk_rows)
    ref_v, ref_i = _reference(hidden, weight, 7, temperature)
    assert logprobs.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (37, 7)
    torch.testing.assert_close(logprobs.double(), ref_v, rtol=0, atol=2e-5)
    assert torch.equal(ids, ref_i)  # random float logits: no ties


def test_padding_rows_of_a_padded_vocabulary_get_no_probability():
    """Rows past `vocab_size` (a vocabulary padded for TP) are masked, even when their logits are
    the largest: the values are the real vocabulary's log-softmax."""
    hidden, weight = _inputs(v=96)
    padded = torch.cat([weight, weight[:8] * 50])  # 104 rows, 8 of padding with huge logits
    logprobs, ids = topk_logprobs(hidden, padded, k=5, temperature=1.0, vocab_size=96)
    ref_v, ref_i = _reference(hidden, weight, 5, 1.0)
    torch.testing.assert_close(logprobs.double(), ref_v, rtol=0, atol=2e-5)
    assert torch.equal(ids, ref_i)


def test_a_vocabulary_smaller_than_k_is_padded():
    hidden, weight = _inputs(n=3, v=4)
    logprobs, ids = topk_logprobs(hidden, weight, k=6, temperature=1.0)
    ref_v, ref_i = _reference(hidden, weight, 4, 1.0)
    assert torch.equal(ids[:, :4], ref_i) and (ids[:, 4:] == PAD_ID).all()
    assert (logprobs[:, 4:] == -math.inf).all()
    torch.testing.assert_close(logprobs[:, :4].double(), ref_v, rtol=0, atol=2e-5)


def _sharded_topk(rank, world, hidden, weight, vocab, k, temperature):
    import torch.distributed as dist

    v_local = weight.shape[0] // world
    shard = weight[rank * v_local:(rank + 1) * v_local]

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    return topk_logprobs(hidden, shard, k=k, temperature=temperature, vocab_start=rank * v_local,
                         vocab_size=vocab, gather=gather, chunk_rows=6)


def test_tp_shards_give_the_full_vocabulary_top_k():
    """Each rank holds a block of rows (the last one padded); one all-gather per chunk gives every rank
    the global normaliser and top-k, equal to the single-rank reference."""
    world = 3
    hidden, weight = _inputs(n=17, v=100)
    padded = torch.cat([weight, torch.zeros(-(-100 // world) * world - 100, weight.shape[1])])
    k, temperature = 9, 0.8
    ref_v, ref_i = _reference(hidden, weight, k, temperature)
    for logprobs, ids in run_distributed(_sharded_topk, world, hidden, padded, 100, k, temperature):
        torch.testing.assert_close(logprobs.double(), ref_v, rtol=0, atol=2e-5)
        assert torch.equal(ids, ref_i)


def test_packed_rows_round_trip_with_padding():
    logprobs = torch.tensor([[-0.1, -2.5, -math.inf], [-0.7, -0.9, -3.0]])
    ids = torch.tensor([[151935, 0, PAD_ID], [3, 7, 11]])
    packed = pack_rows(logprobs, ids)
    assert packed.shape == (2, 6) and packed.dtype == torch.float32
    rows = unpack_rows(packed, 3, 151936, "req")
    assert torch.equal(rows.ids, ids) and torch.equal(rows.logprobs, logprobs)


@pytest.mark.parametrize("packed, match", [
    (torch.zeros(2, 5), r"expected float32 top-k rows \[L-1, 6\]"),
    (torch.zeros(2, 6, dtype=torch.bfloat16), "expected float32"),
    (pack_rows(torch.tensor([[-0.1, float("nan"), -1.0]]), torch.tensor([[1, 2, 3]])), "position 0"),
    (pack_rows(torch.tensor([[-0.1, -0.2, -1.0]]), torch.tensor([[1, 99, 3]])), r"ids in \[0, 50\)"),
    (pack_rows(torch.tensor([[0.5, -0.2, -1.0]]), torch.tensor([[1, 2, 3]])), "logprobs <= 0"),
])
def test_malformed_packed_rows_name_the_sequence(packed, match):
    with pytest.raises(MalformedTeacherOutputError, match=rf"seq 4.*{match}"):
        unpack_rows(packed, 3, 50, "seq 4")


def _edited_checkpoint(root, edit: str) -> str:
    """A tiny checkpoint with one thing the device scorer cannot reproduce (or none)."""
    import safetensors.torch

    from opkd_mcore.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model(str(root / edit), seed=1)
    if edit == "softcap":
        with open(f"{model}/config.json") as f:
            config = json.load(f)
        with open(f"{model}/config.json", "w") as f:
            json.dump({**config, "final_logit_softcapping": 30.0}, f)
    elif edit in ("bias", "no_lm_head"):
        tensors = safetensors.torch.load_file(f"{model}/model.safetensors")
        if edit == "bias":
            tensors["lm_head.bias"] = torch.zeros(tensors["lm_head.weight"].shape[0])
        else:
            del tensors["lm_head.weight"]
        safetensors.torch.save_file(tensors, f"{model}/model.safetensors")
    return model


@pytest.mark.parametrize("edit, reason", [
    ("plain", None),
    ("softcap", "sets final_logit_softcapping=30.0"),
    ("bias", "the LM head has a bias"),
    ("no_lm_head", "has no 'lm_head.weight'"),
])
def test_checkpoints_whose_logits_are_more_than_the_output_weight_keep_prompt_logprobs(tmp_path, edit,
                                                                                       reason):
    blocker = device_scoring_blocker(_edited_checkpoint(tmp_path, edit))
    assert blocker is None if reason is None else reason in blocker


@pytest.mark.parametrize("overrides, match", [
    (["teacher.teachers.0.scoring=fast"], r"scoring: expected one of \['auto', 'prompt_logprobs', 'devi"),
    (["teacher.teachers.0.backend=hf", "teacher.teachers.0.scoring=device"],
     r"scoring: 'device' chooses how a vllm or remote teacher .* \(backend 'hf', output 'topk'\)"),
    (["teacher.teachers.0.output=hidden", "teacher.teachers.0.scoring=prompt_logprobs", "loss.support=null"],
     r"scoring: 'prompt_logprobs' .* \(backend 'vllm', output 'hidden'\)"),
])
def test_scoring_errors_name_the_key(overrides, match):
    from opkd_mcore.config import ConfigError, load_config

    base = ["model.student=/student", "teacher.teachers.0.model=/teacher", "loss.support=teacher"]
    with pytest.raises(ConfigError, match=rf"^teacher.teachers.0.{match}"):
        load_config(None, base + overrides, check_files=False)
    for backend in ("vllm", "remote"):  # both scorings of both backends that have them
        for scoring in ("device", "prompt_logprobs"):
            url = ["teacher.teachers.0.url=http://127.0.0.1:8000"] if backend == "remote" else []
            cfg = load_config(None, base + url + [f"teacher.teachers.0.backend={backend}",
                                                  f"teacher.teachers.0.scoring={scoring}"], check_files=False)
            assert cfg.teacher.teachers[0].scoring == scoring


def assert_same_rows(got: TopKTeacher, want: TopKTeacher, atol: float) -> tuple[int, int]:
    """Equal top-k rows up to ties: values within `atol` at every place, and the same id at every
    place whose value is more than `atol` from its neighbours' (the last place excepted: its
    neighbour, the (k+1)-th value, is not returned). Near-tied places may hold their ids in either
    order, as `torch.topk` leaves them; the float64 reference (`assert_same_topk`) checks those.
    Returns (places compared exactly, places before the last): a caller checks that most were."""
    assert got.ids.shape == want.ids.shape
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=atol)
    gap = (want.logprobs[:, 1:] - want.logprobs[:, :-1]).abs() > atol
    ones = torch.ones(gap.shape[0], 1, dtype=torch.bool)
    separated = torch.cat([ones, gap], 1) & torch.cat([gap, ~ones], 1)
    assert torch.equal(got.ids[separated], want.ids[separated])
    return int(separated[:, :-1].sum()), separated[:, :-1].numel()


# ---------------------------------------------------------------- a real vLLM engine (CPU build)
SEQUENCES = [[1, 4, 5, 6, 7, 8, 9], [1, 10, 11], [1, 3, 3, 3, 12, 4, 5, 6, 2]]
MAX_MODEL_LEN = 64
# a sequence that fills the engine's context: every position is scored, the last token's too
FULL = [1] + [3 + (i * 7) % 13 for i in range(MAX_MODEL_LEN - 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from opkd_mcore.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model(str(tmp_path_factory.mktemp("device_topk") / "tiny"), seed=5, init_std=0.1)


def _teacher(model, **cfg):
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig
    from tests.conftest import engine_kwargs

    return VllmTeacher(model, VllmTeacherConfig(dtype="float32", max_model_len=MAX_MODEL_LEN,
                                                **engine_kwargs(**cfg)))


# On an H200 (vLLM 0.26, CUDA; 2026-11-28) the first test with these engines did not finish in 516 s:
# its sequence filling the engine's context never finished prefilling (0.26 keeps a position free for
# a pooling request; a sequence is sent without its last token since, `hidden_states.pooled_input`).
# A bound per test on a GPU keeps a hang from taking the lane's whole call (the next tests still run
# and report); elsewhere the run's own timeout (None)
ENGINE_TEST_BOUND = pytest.mark.timeout(timeout=300 if torch.cuda.is_available() else None)


@pytest.fixture(scope="module")
def device_teacher(model_dir):
    # scoring: auto. 16 tokens per engine step: longer sequences are scored in chunks (chunked
    # prefill), and the pooler hands the scorer each one's hidden states once, whole
    teacher = _teacher(model_dir, k=8, extra_engine_kwargs=dict(
        max_num_batched_tokens=16, enable_chunked_prefill=True, max_num_seqs=4))
    yield teacher
    teacher.close()


@pytest.fixture(scope="module")
def logprobs_teacher(model_dir):
    # temperature != 1: the engine returns the whole vocabulary; teachers at temperature 1 reuse it
    teacher = _teacher(model_dir, k=8, temperature=0.6, scoring="prompt_logprobs")
    yield teacher
    teacher.close()


@ENGINE_TEST_BOUND
@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_device_rows_equal_prompt_logprobs_rows(device_teacher, logprobs_teacher, model_dir, temperature):
    """Both paths on the same sequences (one filling the context): ids equal up to ties, logprobs
    within float32 tolerance, and both the float64 transformers top-k."""
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig
    from tests.conftest import VLLM_FP32_LOGPROB_ATOL
    from tests.test_teacher_vllm import assert_same_topk, reference_logprobs

    assert device_teacher.scoring == "device" and logprobs_teacher.scoring == "prompt_logprobs"
    seqs = [*SEQUENCES, FULL]
    cfg = VllmTeacherConfig(k=8, temperature=temperature)
    on_device = VllmTeacher(device_teacher.llm, cfg)  # an engine passed in: scored as it was built
    by_logprobs = VllmTeacher(logprobs_teacher.llm, cfg)
    assert on_device.scoring == "device" and by_logprobs.scoring == "prompt_logprobs"
    got, want = on_device.score(seqs), by_logprobs.score(seqs)
    assert [g.ids.shape for g in got] == [(len(s) - 1, 8) for s in seqs]
    exact = total = 0
    for seq, g, w in zip(seqs, got, want):
        compared = assert_same_rows(g, w, atol=VLLM_FP32_LOGPROB_ATOL)
        exact, total = exact + compared[0], total + compared[1]
        assert_same_topk(g, reference_logprobs(model_dir, seq, temperature), 8)
    assert exact >= 0.9 * total  # near-ties are rare: the ids were compared, not waved through


@ENGINE_TEST_BOUND
@pytest.mark.vllm
def test_an_engine_passed_in_is_scored_as_it_was_built(device_teacher, logprobs_teacher):
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    with pytest.raises(ValueError, match=r"scoring: 'device' needs an engine built for it.*'generate'"):
        VllmTeacher(logprobs_teacher.llm, VllmTeacherConfig(k=8, scoring="device"))
    with pytest.raises(ValueError, match=r"'prompt_logprobs' needs an engine built for it.*'pooling'"):
        VllmTeacher(device_teacher.llm, VllmTeacherConfig(k=8, scoring="prompt_logprobs"))


def test_device_scoring_of_a_softcapped_checkpoint_is_refused_before_any_engine(tmp_path):
    with pytest.raises(ValueError, match="scoring: 'device' cannot reproduce the logits.*softcapping"):
        _teacher(_edited_checkpoint(tmp_path, "softcap"), k=4, scoring="device")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_tp2_engine_scores_the_full_vocabulary(tmp_path, monkeypatch):
    """TP=2: each worker holds half of a vocabulary of 251 rows (the second half padded by one row)
    and the rows are the full vocabulary's top-k, at temperature 1 and 0.7."""
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig
    from tests._dist import require_devices
    from tests.test_teacher_vllm import assert_same_topk, reference_logprobs

    require_devices(2)
    if not torch.cuda.is_available():  # vLLM's CPU workers each need their own cores to bind
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            pytest.skip("a TP=2 vLLM CPU engine needs 2 cores")
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    shape = TinyModelShape(vocab_size=251, num_key_value_heads=2)  # KV heads split over 2 workers
    model = save_tiny_hf_model(str(tmp_path / "tiny"), shape=shape, seed=7, init_std=0.1)
    teacher = _teacher(model, k=8, tensor_parallel_size=2, scoring="device")
    try:
        for temperature in (1.0, 0.7):
            rows = VllmTeacher(teacher.llm, VllmTeacherConfig(k=8, temperature=temperature)).score(SEQUENCES)
            for seq, got in zip(SEQUENCES, rows):
                assert_same_topk(got, reference_logprobs(model, seq, temperature), 8)
    finally:
        teacher.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_opkd_train_with_device_scoring_equals_prompt_logprobs(tmp_path):
    """`opkd train` with the in-process vLLM top-k teacher (the run's default, scoring on the device)
    gives the losses of the same run scoring by prompt_logprobs: same rollouts (same seed), teacher
    rows equal to float32 rounding. The student and teacher of `test_train_integration`'s runs, the
    teacher with the student's vocabulary (a top-k teacher's ids must be the student's)."""
    from opkd_mcore.data import ALPHABET
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
    from tests.test_train_integration import V, _run_train

    common_shape = dict(vocab_size=V, num_layers=2, num_attention_heads=2, num_key_value_heads=2,
                        intermediate_size=256, max_position_embeddings=64)
    models = {"root": tmp_path,
              "student": save_tiny_hf_model(str(tmp_path / "student"), "qwen3", TinyModelShape(
                  hidden_size=128, **common_shape), seed=1, alphabet=ALPHABET),
              "teacher": save_tiny_hf_model(str(tmp_path / "teacher"), "qwen3", TinyModelShape(
                  hidden_size=192, **common_shape), seed=2, alphabet=ALPHABET, init_std=0.1)}

    common = ("teacher.teachers.0.backend=vllm", "teacher.teachers.0.top_k=8",
              "teacher.teachers.0.dtype=float32", "loss.support=teacher", "run.steps=2")
    runs = {}
    for scoring in ("device", "prompt_logprobs"):
        rows, log = _run_train(models, f"topk_{scoring}", 1, *common,
                               f"teacher.teachers.0.scoring={scoring}")
        assert f"top-8 rows by {'the engine' if scoring == 'device' else 'vLLM'}" in log
        assert all(row["timing/teacher"] > 0 for row in rows)
        runs[scoring] = [(row["train/loss"], row["kd/teacher_mass_on_support"]) for row in rows]
    assert len(runs["device"]) == 2
    for got, want in zip(runs["device"], runs["prompt_logprobs"]):
        assert got == pytest.approx(want, rel=1e-5)

"""In-process vLLM teacher (real vLLM CPU engine) against a float64 `transformers` forward."""
import math

import pytest
import torch

from opkd_mcore.losses.teacher_outputs import PAD_ID, TopKTeacher
from opkd_mcore.models.tiny import save_tiny_hf_model
from opkd_mcore.teacher.base import MalformedTeacherOutputError, topk_from_ranked
from tests.conftest import engine_kwargs, vllm_fp32_logprob_atol

pytestmark = pytest.mark.vllm

SEQUENCES = [[1, 4, 5, 6, 7, 8, 9], [1, 10, 11], [1, 3, 3, 3, 12, 4, 5, 6, 2]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("teacher") / "tiny"), seed=5, init_std=0.1)


@pytest.fixture(scope="module")
def tempered_teacher(model_dir):
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    # the prompt_logprobs path (the device path: tests/test_teacher_device_topk.py). Temperature != 1
    # builds the engine with unlimited logprobs; the k-only teachers reuse it
    teacher = VllmTeacher(model_dir, VllmTeacherConfig(k=8, temperature=0.6, dtype="float32",
                                                       max_model_len=64, scoring="prompt_logprobs",
                                                       **engine_kwargs()))
    yield teacher
    teacher.close()


def reference_logprobs(model_dir, seq, temperature=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1]
    return torch.log_softmax(logits / temperature, dim=-1)


def assert_same_topk(got: TopKTeacher, ref_logprobs: torch.Tensor, k: int, atol: float | None = None):
    """Same top-k as the reference up to near-ties: values match the reference's sorted top-k,
    and the reference gives each returned id the returned logprob (within `atol`; by default the
    float32 engine's bound for these rows, `vllm_fp32_logprob_atol`)."""
    atol = vllm_fp32_logprob_atol(ref_logprobs) if atol is None else atol
    ref_vals, _ = ref_logprobs.topk(k, dim=-1)
    assert got.ids.shape == (ref_logprobs.shape[0], k)
    torch.testing.assert_close(got.logprobs.double(), ref_vals, atol=atol, rtol=0)
    torch.testing.assert_close(ref_logprobs.gather(1, got.ids), got.logprobs.double(), atol=atol, rtol=0)
    assert (got.ids != PAD_ID).all()


@pytest.mark.parametrize("k", [1, 8])
def test_topk_rows_match_transformers(tempered_teacher, model_dir, k):
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    teacher = VllmTeacher(tempered_teacher.llm, VllmTeacherConfig(k=k))
    scored = teacher.score(SEQUENCES)
    assert len(scored) == len(SEQUENCES)
    for seq, rows in zip(SEQUENCES, scored):
        assert rows.ids.shape[0] == len(seq) - 1  # row t scores token t+1
        assert_same_topk(rows, reference_logprobs(model_dir, seq), k)


def test_temperature_is_honoured_exactly(tempered_teacher, model_dir):
    scored = tempered_teacher.score(SEQUENCES[:2])
    for seq, rows in zip(SEQUENCES, scored):
        assert_same_topk(rows, reference_logprobs(model_dir, seq, temperature=0.6), 8)


def test_short_sequence_is_rejected_naming_it(tempered_teacher):
    with pytest.raises(ValueError, match=r"sequences\[1\].*at least 2 tokens"):
        tempered_teacher.score([[1, 2, 3], [4]])


def test_topk_rows_drop_entries_beyond_k_and_pad_small_vocab():
    ranked = [[(5, -2.5, 2), (3, -0.1, 1), (9, -7.0, 40)]]  # id 9: the actual token, beyond top-k
    out = topk_from_ranked(ranked, 2, request="req-1", vocab_size=16)
    assert out.ids.tolist() == [[3, 5]]
    padded = topk_from_ranked([[(1, -0.1, 1), (0, -2.4, 2)]], 4, request="req-1", vocab_size=2)
    assert padded.ids.tolist() == [[1, 0, PAD_ID, PAD_ID]]
    assert padded.logprobs[0, 2:].tolist() == [-math.inf, -math.inf]


@pytest.mark.parametrize("ranked, match", [
    ([[(3, float("nan"), 1), (4, -1.0, 2)]], "NaN"),
    ([[(3, -0.5, 1)]], "expected 2 top-k entries, got 1"),
    ([[(3, -0.5, 1), (3, -0.7, 2)]], "duplicate"),
    ([[(3, -0.5, 1), (99, -0.7, 2)]], "outside"),
])
def test_malformed_rows_name_the_request(ranked, match):
    with pytest.raises(MalformedTeacherOutputError, match=rf"req-7, position 0: .*{match}"):
        topk_from_ranked(ranked, 2, request="req-7", vocab_size=16)


def _reference_topk(rows, k, vocab_size):
    """The per-position algorithm `topk_from_flat` replaced: dict semantics for repeated ids (the
    last copy wins), sort by (rank, -logprob), keep k; padding as in TopKTeacher."""
    ids = torch.full((len(rows), k), PAD_ID, dtype=torch.int64)
    logprobs = torch.full((len(rows), k), -math.inf, dtype=torch.float32)
    for t, entries in enumerate(rows):
        last = {tok: (lp, rank) for tok, lp, rank in entries}
        top = sorted(((tok, lp, r) for tok, (lp, r) in last.items() if r <= k), key=lambda e: (e[2], -e[1]))[:k]
        ids[t, :len(top)] = torch.tensor([e[0] for e in top], dtype=torch.int64)
        logprobs[t, :len(top)] = torch.tensor([e[1] for e in top], dtype=torch.float32)
    return TopKTeacher(ids=ids, logprobs=logprobs)


@pytest.mark.parametrize("seed", range(4))
def test_flat_topk_equals_the_per_position_reference(seed):
    """Random rows as vLLM lays them out: the scored token first (beyond k, or repeated exactly
    among the top-k with its own rank, tied values included), then ranks 1..k."""
    from opkd_mcore.teacher.base import topk_from_flat

    gen = torch.Generator().manual_seed(seed)
    vocab, k = 50, 6
    rows = []
    for _ in range(40):
        ids = torch.randperm(vocab, generator=gen)[:k + 1].tolist()
        values = sorted((torch.randint(-8, 0, (k,), generator=gen).double() / 4).tolist(), reverse=True)
        top = [(ids[r], values[r], r + 1) for r in range(k)]
        pick = int(torch.randint(0, 3, (1,), generator=gen))
        if pick == 0:  # the scored token ranks beyond k
            scored = (ids[k], -9.0, k + 5)
        else:  # it is one of the top-k; with tied values its own rank may be another tie's
            r = int(torch.randint(0, k, (1,), generator=gen))
            first_tie = values.index(values[r])
            scored = (ids[r], values[r], first_tie + 1 if pick == 2 else r + 1)
        rows.append([scored] + top)
    flat = [e for row in rows for e in row]
    got = topk_from_flat([e[0] for e in flat], [e[1] for e in flat], [e[2] for e in flat],
                         [len(r) for r in rows], k, request="req", vocab_size=vocab)
    want = _reference_topk(rows, k, vocab)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)


def test_flat_prompt_logprobs_give_the_rows_of_the_dict_form(tempered_teacher, monkeypatch):
    """The teacher reads vLLM's flat logprobs; the dict form of the same outputs (vLLM's own view of
    them), read the old way, gives the same rows bit for bit. One engine call: a second call's values
    may differ in the last bit on a GPU, where kernels depend on how the batch was scheduled."""
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    k, llm, outputs = 8, tempered_teacher.llm, []
    generate = llm.generate

    def recording_generate(*args, **kwargs):
        result = generate(*args, **kwargs)
        outputs.extend(result)
        return result

    monkeypatch.setattr(llm, "generate", recording_generate)
    scored = VllmTeacher(llm, VllmTeacherConfig(k=k)).score(SEQUENCES)
    assert len(outputs) == len(SEQUENCES)
    for rows, out in zip(scored, outputs):
        # prompt positions 1.., then the token sampled after them (which scores the sequence's last token)
        positions = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
        ranked = [[(tok, lp.logprob, lp.rank) for tok, lp in pos.items()] for pos in positions]
        want = _reference_topk(ranked, k, tempered_teacher.vocab_size)
        assert torch.equal(rows.ids, want.ids) and torch.equal(rows.logprobs, want.logprobs)


@pytest.mark.parametrize("scoring", ["auto", "prompt_logprobs"])
def test_the_run_teacher_scores_a_sample_that_fills_the_rollout_context(tmp_path, scoring):
    """A sample of exactly rollout.max_model_len tokens (a prompt that leaves just max_new_tokens,
    and a response that uses them all) goes through the in-process teacher the run builds, with a
    teacher whose positions end there too (max_position_embeddings = rollout.max_model_len); its
    rows match transformers. vLLM's generate runner refuses a prompt that fills its context, and
    an engine one position longer than the model allows is refused too. Both ways of scoring: the
    run's default (auto: on the device, a pooling engine) and prompt_logprobs."""
    from opkd_mcore.config import RolloutSection, TeacherEndpoint, TeacherSection, TrainConfig
    from opkd_mcore.models.tiny import TinyModelShape
    from opkd_mcore.train.teacher_setup import build_scoring_teacher

    max_model_len, k = 32, 4
    shape = TinyModelShape(max_position_embeddings=max_model_len)
    model = save_tiny_hf_model(str(tmp_path / "short"), shape=shape, seed=6, init_std=0.1)
    endpoint = TeacherEndpoint(backend="vllm", model=model, top_k=k, dtype="float32", scoring=scoring)
    memory = engine_kwargs()["gpu_memory_utilization"]
    cfg = TrainConfig(rollout=RolloutSection(max_model_len=max_model_len, max_new_tokens=8,
                                             gpu_memory_utilization=memory),
                      teacher=TeacherSection(teachers=[endpoint]))
    teacher = build_scoring_teacher(cfg)
    assert teacher.scoring == ("device" if scoring == "auto" else scoring)
    try:
        full = [1] + [3 + (i * 7) % 13 for i in range(max_model_len - 1)]
        rows = teacher.score([full, full[:5]])
    finally:
        teacher.close()
    assert [r.ids.shape for r in rows] == [(max_model_len - 1, k), (4, k)]
    for seq, got in zip([full, full[:5]], rows):
        assert_same_topk(got, reference_logprobs(model, seq), k)

"""TeacherRouter with real teachers (`transformers` forwards; a real client to a closed port)."""
import pytest
import torch

from opkd_mcore.losses.teacher_outputs import DenseTeacher
from opkd_mcore.models.tiny import save_tiny_hf_model
from opkd_mcore.teacher.base import TeacherUnavailableError
from opkd_mcore.teacher.hf_teacher import TransformersTeacher
from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher
from opkd_mcore.teacher.router import TeacherRouter
from tests._dist import free_port

SEQS = [[1, 4, 5, 6], [1, 7, 8], [1, 9, 10, 11, 12], [1, 3, 4], [1, 5, 5, 5, 5], [1, 6, 2]]
DATA = [{"data_source": s} for s in ("math", "code", "math", "math", "code", "math")]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    return {name: save_tiny_hf_model(str(root / name), seed=seed, init_std=0.1)
            for name, seed in (("math", 1), ("code", 2))}


@pytest.fixture(scope="module")
def teachers(dirs):
    return {"math": [TransformersTeacher(dirs["math"], k=5), TransformersTeacher(dirs["math"], k=5)],
            "code": TransformersTeacher(dirs["code"], k=5)}


def dead_client(**kw):
    """A real HTTP client pointed at a port nobody listens on."""
    return RemoteVllmTeacher(RemoteTeacherConfig(url=f"http://127.0.0.1:{free_port()}", model="x",
                                                 max_retries=1, backoff_s=0.01, **kw))


def test_each_sample_goes_to_its_teacher_and_load_is_spread(teachers, dirs):
    router = TeacherRouter(teachers, chunk_size=1, max_workers=2)
    scored = router.score(SEQS, DATA)
    for seq, d, out in zip(SEQS, DATA, scored):
        own = TransformersTeacher(dirs[d["data_source"]], k=5).score([seq])[0]
        other = TransformersTeacher(dirs["code" if d["data_source"] == "math" else "math"], k=5)
        assert torch.equal(out.ids, own.ids) and torch.allclose(out.logprobs, own.logprobs)
        assert not torch.allclose(out.logprobs, other.score([seq])[0].logprobs)
    # Which replica finishes first is timing; what least-in-flight guarantees with as many workers
    # as replicas is that both are used and neither ever holds two chunks while the other idles.
    math = router.pools["math"]
    assert sum(math.served) == 4 and min(math.served) >= 1, math.served
    assert math.peak_in_flight == [1, 1], math.peak_in_flight
    assert router.pools["code"].served == [2]


def test_unknown_or_missing_source_is_an_error_naming_the_sample(teachers):
    router = TeacherRouter(teachers)
    with pytest.raises(ValueError, match=r"data\[1\]\['data_source'\] = 'poetry'.*\['code', 'math'\]"):
        router.score(SEQS[:2], [{"data_source": "math"}, {"data_source": "poetry"}])
    with pytest.raises(ValueError, match=r"data\[0\]: no 'data_source' field"):
        router.score(SEQS[:1], [{}])
    assert len(TeacherRouter(teachers, default="code").score(SEQS[:1], [{}])) == 1


def test_unreachable_replica_is_skipped(teachers):
    router = TeacherRouter({"math": [dead_client(), teachers["math"][0]]}, chunk_size=1)
    scored = router.score(SEQS[:3], [{"data_source": "math"}] * 3)
    assert all(out.ids.shape == (len(s) - 1, 5) for s, out in zip(SEQS, scored))


def test_teacher_that_stays_unreachable_is_reported_with_its_address(teachers):
    dead = [dead_client(), dead_client()]
    router = TeacherRouter({"math": teachers["math"], "code": dead})
    with pytest.raises(TeacherUnavailableError, match=r"teacher 'code': every replica unreachable") as err:
        router.score(SEQS, DATA)
    for replica in dead:
        assert replica.address in str(err.value)


def test_dense_teacher_rows_and_temperature(dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs["math"], dtype=torch.float32).eval()
    out = TransformersTeacher(dirs["math"], k=None, temperature=2.0).score([SEQS[0]])[0]
    assert isinstance(out, DenseTeacher) and out.logits.shape == (len(SEQS[0]) - 1, 256)
    with torch.no_grad():
        ref = model(torch.tensor([SEQS[0]])).logits[0, :-1] / 2.0
    torch.testing.assert_close(out.logits, ref)


def test_router_config_errors():
    with pytest.raises(ValueError, match="default: 'b' is not one of the teachers"):
        TeacherRouter({"a": dead_client()}, default="b")
    with pytest.raises(ValueError, match=r"teachers\['a'\]: expected at least one replica"):
        TeacherRouter({"a": []})


@pytest.mark.parametrize("k", [None, 5])
def test_nan_from_an_hf_teacher_is_an_error_naming_it(dirs, k):
    from opkd_mcore.teacher.base import MalformedTeacherOutputError

    teacher = TransformersTeacher(dirs["code"], k=k)
    with torch.no_grad():
        teacher.model.lm_head.weight[3].fill_(float("nan"))
    with pytest.raises(MalformedTeacherOutputError, match=f"^{dirs['code']}, sequence 0: NaN"):
        teacher.score(SEQS[:2])

"""Weight sync on two GPUs over NCCL when the receiver dies mid-sync: the trainer aborts and rebuilds.

After a rollout engine died, the controller rebuilds the weight-sync groups
(`opkd_mcore/controller/driver.py`, `_sync`): every trainer rank leaves the old group with
`close_weight_sync(abort=True)`, on its actor's control thread beside the blocked send
(`WorkerGroups.abort_trainer_weight_sync`; here: from another thread of the sender), down to
`StatelessGroupTransport.close(abort=True)`, which aborts the NCCL communicator instead of running the
orderly teardown that waits for the dead member; the engine comes back, and new groups are bound and
synced. The CPU tests (`test_weight_sync_transport.py`) cover this over gloo, where a transfer whose peer is gone fails on the
host within the group's timeout. On a GPU it is different: a transfer only orders the streams, so the
sender's `sync` need not fail at all, its broadcast hangs on the device, and what releases that stream
is the abort, or NCCL's own watchdog at the group's timeout (torch's default reaction to that is to tear
the whole process down; the weight-sync groups are built to abort only their communicator,
`opkd_mcore/platform/stateless_group.py`). That is what these tests check, with real processes and the
real NCCL backend:

- sender (the trainer's stage owner) on GPU 0 and receivers (stand-ins for engine workers,
  `BucketReceiver`) on GPU 1, each a spawned process that selects its GPU with
  `torch.cuda.set_device` before any CUDA use, as `opkd_mcore.platform.parallel` does;
- the receiver of the first group `os._exit`s after its first bucket (exit code 17);
- the sender records what its `sync` did (returned, raised, or still blocked on the host: the blocking
  copy of a bucket's trailer synchronises the stream that waits on the hung broadcast), then aborts
  the group, checks that the device drains, that its source tensors are untouched, and syncs a new
  version over a new group (new port, new transport, new `BucketSender`, same plan) to a new receiver,
  whose bytes are compared with the source's;
- the second test lets the old group run into its NCCL timeout before aborting: the trainer must
  survive a hung engine.

Every step that could hang runs in a thread of the sender with a time limit, and the sender reports
each step through a queue: a hang or a crash shows as a failed assertion that tells the story (steps,
timings, exit codes), never as a hung test run. The tensors are large (about 400 MiB in 32 MiB
buckets) so that the broadcasts after the receiver's death cannot all fit in NCCL's buffers: the
sender's stream really hangs.

Needs two CUDA devices; marked `gpu` and skipped elsewhere.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import threading
import time
import traceback

import pytest
import torch

from opkd_mcore.weight_sync import BucketPlan, BucketSender, TransportConfig, make_transport
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from tests._dist import free_port, require_devices
from tests.test_weight_sync_transport import _digest, _start

SENDER_GPU, RECEIVER_GPU = 0, 1
DEAD_RECEIVER_EXIT = 17  # the dying receiver's exit code (as `_receiver_proc` of the CPU tests)
DEAD_VERSION, NEW_VERSION = 5, 6
# as the repo's other NCCL tests: NVLink multicast off (see the device notes)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NCCL_SETTINGS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                 "TORCH_NCCL_ENABLE_MONITORING", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_BUFFSIZE")

HIDDEN, LAYERS = 2048, 12
BUCKET_BYTES = 33 << 20  # one 32 MiB layer (and its norm) per bucket

JOIN_S = 300.0  # group creation: the new receiver waits for the sender to reach the new group
ABORTING_GROUP_TIMEOUT_S = 30.0  # first test: the abort comes well before NCCL's timeout
WATCHDOG_GROUP_TIMEOUT_S = 15.0  # second test: the timeout is waited out
NEW_GROUP_TIMEOUT_S = 60.0
TIMEOUT_MARGIN_S = 15.0  # past a group's timeout: NCCL's watchdog has had its say
RECEIVER_DEATH_LIMIT_S = 120.0  # the sender waits this long to hear that its receiver died
SYNC_GRACE_S = 5.0  # after the death: time for `sync` to return or raise before it counts as blocked
STEP_LIMIT_S = 30.0  # abort, device synchronize, orderly close
PROBE_S = 10.0  # the synchronize probe after the timeout (before the abort)
NEW_SYNC_LIMIT_S = 120.0
SCENARIO_LIMIT_S = 420.0  # one test's processes, all in all
AFTER_SENDER_S = 30.0  # the receivers' time to finish once the sender has exited


# ---- the model: deterministic, on the CPU; the sender moves it to its GPU ---------------------------

def _spec() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    spec = [("model.embed_tokens.weight", (512, HIDDEN), torch.float32)]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        big = ((HIDDEN, 4096), torch.float32) if layer % 2 == 0 else ((4096, 4096), torch.bfloat16)
        spec += [(p + "mlp.down_proj.weight", *big), (p + "input_layernorm.weight", (HIDDEN,), torch.float32)]
    return spec + [("lm_head.weight", (512, HIDDEN), torch.float32), ("model.extra_ids", (7,), torch.int64)]


def _model(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + version)
    out = []
    for name, shape, dtype in _spec():
        if dtype == torch.int64:
            out.append((name, torch.arange(shape[0], dtype=dtype) * version))
        else:
            out.append((name, torch.randn(shape, generator=g).to(dtype)))
    return out


def _plan() -> BucketPlan:
    return BucketPlan.from_named_tensors([(n, torch.empty(s, dtype=d, device="meta")) for n, s, d in _spec()],
                                         BUCKET_BYTES)


# ---- child processes (module level: spawn pickles them by reference) ---------------------------------

def _setup_child(gpu: int) -> None:
    """Before any CUDA use: NCCL settings, then this process's GPU (as `bind_local_device` does)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    torch.cuda.set_device(gpu)
    torch.zeros(1, device=f"cuda:{gpu}")  # the context now, not inside the group's first collective


class _InThread:
    """`fn()` in a daemon thread on `gpu` (CUDA's current device is per thread): the caller waits with
    a limit, so that a hang becomes a report rather than a hung process."""

    def __init__(self, fn, gpu: int = SENDER_GPU):
        self.error: str | None = None
        self.started, self.ended = time.monotonic(), None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn, gpu), daemon=True).start()

    def _run(self, fn, gpu: int) -> None:
        try:
            torch.cuda.set_device(gpu)
            fn()
        except BaseException as err:  # recorded, not raised: the caller reports it
            self.error = f"{type(err).__name__}: {err}"[:600]
        finally:
            self.ended = time.monotonic()
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def outcome(self) -> dict:
        if not self.finished:
            return {"outcome": "blocked", "elapsed_s": round(time.monotonic() - self.started, 2)}
        return {"outcome": "raised" if self.error else "returned", "error": self.error,
                "elapsed_s": round(self.ended - self.started, 2)}


def _exit_now(queue, code: int) -> None:
    """Leave without the interpreter's teardown (threads stuck in CUDA calls), the reports delivered."""
    queue.close()
    queue.join_thread()
    os._exit(code)


def _wait_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def _sender_proc(old: TransportConfig, new: TransportConfig, abort_at_once: bool, receiver_gone, queue):
    """The trainer's stage owner: a sync into a group whose receiver dies, the controller's recovery
    (abort), then a sync over a new group. Reports ("sender", step, info) for every step."""
    t0 = time.monotonic()

    def report(step: str, **info) -> None:
        queue.put(("sender", step, {**info, "t_s": round(time.monotonic() - t0, 2)}))

    try:
        _setup_child(SENDER_GPU)
        device = torch.device("cuda", SENDER_GPU)
        plan = _plan()
        source = [(n, t.to(device)) for n, t in _model(DEAD_VERSION)]
        before = [t.clone() for _, t in source]
        transport = make_transport("group", old, rank=0)
        sender = BucketSender(plan, transport, 0)
        transport.connect()
        report("joined", buckets=len(plan.buckets), mib=round(plan.total_bytes / 2**20),
               torch=torch.__version__, nccl=str(torch.cuda.nccl.version()),
               settings={k: os.environ.get(k) for k in NCCL_SETTINGS})

        # 1. the receiver dies after its first bucket; on a GPU `sync` only orders streams
        sync_start = time.monotonic()
        dead_sync = _InThread(lambda: sender.sync(iter(source), DEAD_VERSION))
        gone = receiver_gone.wait(RECEIVER_DEATH_LIMIT_S)  # the controller learns that the engine died
        dead_sync.wait(SYNC_GRACE_S)
        report("dead_sync", receiver_gone=gone, **dead_sync.outcome())

        if not abort_at_once:  # 1b. nobody aborts: the group's NCCL timeout passes
            _wait_until(sync_start + old.timeout_s + TIMEOUT_MARGIN_S)
            probe = _InThread(lambda: torch.cuda.synchronize(device))
            probe.wait(PROBE_S)
            report("after_timeout", alive=True, since_sync_s=round(time.monotonic() - sync_start, 1),
                   dead_sync=dead_sync.outcome(), synchronize=probe.outcome())

        # 2. the controller's recovery: leave the old group without waiting for the dead member
        abort = _InThread(lambda: transport.close(abort=True))
        abort.wait(STEP_LIMIT_S)
        report("abort", **abort.outcome())
        drained = _InThread(lambda: torch.cuda.synchronize(device))  # the hung broadcast let go of the stream
        drained.wait(STEP_LIMIT_S)
        report("synchronize", **drained.outcome())
        dead_sync.wait(STEP_LIMIT_S)
        report("dead_sync_final", **dead_sync.outcome())
        if not (abort.finished and drained.finished):
            report("stuck", reason="abort or synchronize did not return; nothing further can run")
            _exit_now(queue, 3)
        report("source", intact=all(torch.equal(t, b) for (_, t), b in zip(source, before)))
        del before

        # 3. a new group on a new port, a new transport and sender with the same plan, a new receiver
        fresh = [(n, t.to(device)) for n, t in _model(NEW_VERSION)]
        new_transport = make_transport("group", new, rank=0)
        new_sender = BucketSender(plan, new_transport, 0)
        new_sync = _InThread(lambda: new_sender.sync(iter(fresh), NEW_VERSION))
        new_sync.wait(NEW_SYNC_LIMIT_S)
        report("new_sync", **new_sync.outcome())
        landed = _InThread(lambda: torch.cuda.synchronize(device))
        landed.wait(STEP_LIMIT_S)
        report("new_synchronize", **landed.outcome())
        if not (new_sync.finished and landed.finished):
            report("stuck", reason="the sync over the new group did not finish")
            _exit_now(queue, 3)
        close = _InThread(new_transport.close)  # orderly: the new receiver closes too
        close.wait(STEP_LIMIT_S)
        report("new_close", **close.outcome())
        if abort_at_once:  # the aborted group's watchdog must not take the process down later
            _wait_until(sync_start + old.timeout_s + TIMEOUT_MARGIN_S)
            report("outlived_old_timeout", since_sync_s=round(time.monotonic() - sync_start, 1))
        if not close.finished:
            _exit_now(queue, 3)
        report("done")
    except BaseException:
        queue.put(("sender", "error", {"traceback": traceback.format_exc()}))


def _receiver_proc(group: TransportConfig, die_after_buckets: int, name: str, queue):
    """A stand-in engine worker on the receiver GPU; digests of CPU copies of what it received. The
    dying one reports nothing before it dies (it must not exit while writing to the shared queue)."""
    try:
        _setup_child(RECEIVER_GPU)
        receiver = BucketReceiver()
        receiver.join([group], rank=1)
        digests: dict[str, str] = {}
        loads = [0]

        def load(named):
            loads[0] += 1
            if loads[0] > die_after_buckets:
                os._exit(DEAD_RECEIVER_EXIT)  # dies mid-sync, without a goodbye
            digests.update({n: _digest(t.cpu()) for n, t in named})

        version = receiver.receive(load)
        queue.put((name, "received", {"version": version, "buckets": loads[0], "digests": digests}))
        receiver.close()
        queue.put((name, "closed", {}))
    except BaseException:
        queue.put((name, "error", {"traceback": traceback.format_exc()}))


# ---- the parent ------------------------------------------------------------------------------------

def _run_scenario(abort_at_once: bool, old_timeout_s: float) -> tuple[list[tuple[str, str, dict]], dict]:
    """Sender and dying receiver on the old group; once that receiver is gone, the sender is told and a
    healthy receiver joins the new group. Returns the reports and every process's exit code."""
    ctx = mp.get_context("spawn")
    queue, receiver_gone = ctx.Queue(), ctx.Event()
    port = free_port(2)
    old = TransportConfig(port=port, world_size=2, timeout_s=old_timeout_s, join_timeout_s=JOIN_S,
                          device="cuda")
    new = TransportConfig(port=port + 1, world_size=2, timeout_s=NEW_GROUP_TIMEOUT_S, join_timeout_s=JOIN_S,
                          device="cuda")
    procs: dict[str, mp.Process] = {}
    reports: list[tuple[str, str, dict]] = []
    try:
        procs["dying receiver"] = _start(_receiver_proc, old, 1, "dying receiver", queue)
        procs["sender"] = _start(_sender_proc, old, new, abort_at_once, receiver_gone, queue)
        deadline = time.monotonic() + SCENARIO_LIMIT_S
        while time.monotonic() < deadline:
            if not receiver_gone.is_set() and not procs["dying receiver"].is_alive():
                receiver_gone.set()  # as the controller learns of the death and restarts the engine
                procs["healthy receiver"] = _start(_receiver_proc, new, 10**6, "healthy receiver", queue)
            try:
                reports.append(queue.get(timeout=0.5))
                continue
            except queue_module.Empty:
                pass
            if not procs["sender"].is_alive():
                if not any(p.is_alive() for p in procs.values()):
                    break
                deadline = min(deadline, time.monotonic() + AFTER_SENDER_S)
    finally:
        for p in procs.values():
            p.join(timeout=10)
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return reports, {name: p.exitcode for name, p in procs.items()}


def _steps(reports, who: str) -> dict[str, dict]:
    return {step: info for w, step, info in reports if w == who}


def _story(reports, codes) -> str:
    lines = [f"exit codes: {codes}"]
    for who, step, info in reports:
        shown = {k: (f"<{len(v)} digests>" if k == "digests" else v) for k, v in info.items()}
        lines.append(f"  {who}: {step}: {shown}")
    return "\n".join(lines)


def _require_two_gpus() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs 2 CUDA devices, this machine has none")
    require_devices(2)


def _check_errors_and_dead_receiver(reports, codes, story: str) -> dict[str, dict]:
    errors = [f"{who}: {info['traceback']}" for who, step, info in reports if step == "error"]
    assert not errors, "\n".join(errors) + "\n" + story
    assert codes.get("dying receiver") == DEAD_RECEIVER_EXIT, story
    sender = _steps(reports, "sender")
    assert "dead_sync" in sender, story  # what `sync` did (returned / raised / blocked): in the story
    return sender


def _check_recovery(reports, codes, sender: dict[str, dict], story: str) -> None:
    """Abort, drain, weights intact, a new group that works, a clean exit."""
    abort = sender.get("abort", {})
    assert abort.get("outcome") == "returned" and abort["elapsed_s"] < STEP_LIMIT_S, \
        f"close(abort=True) of the old group did not return within {STEP_LIMIT_S:.0f} s\n{story}"
    assert sender.get("synchronize", {}).get("outcome") == "returned", \
        f"the device did not drain after the abort (torch.cuda.synchronize)\n{story}"
    assert sender.get("dead_sync_final", {}).get("outcome") in ("returned", "raised"), \
        f"the interrupted sync still blocks the trainer's thread after the abort\n{story}"
    assert sender.get("source", {}).get("intact") is True, f"the trainer's weights changed\n{story}"
    assert sender.get("new_sync", {}).get("outcome") == "returned", story
    assert sender.get("new_synchronize", {}).get("outcome") == "returned", story
    received = _steps(reports, "healthy receiver").get("received", {})
    assert received.get("version") == NEW_VERSION, story
    expected = {n: _digest(t) for n, t in _model(NEW_VERSION)}
    got = received.get("digests", {})
    wrong = sorted(n for n in expected if got.get(n) != expected[n])
    assert not wrong and set(got) == set(expected), f"new group: wrong bytes for {wrong[:5]}\n{story}"
    assert sender.get("new_close", {}).get("outcome") == "returned", story
    assert codes.get("healthy receiver") == 0, story


@pytest.mark.gpu
def test_sender_aborts_a_group_whose_receiver_died_and_syncs_over_a_new_one():
    """The controller's recovery, on the trainer's side: the receiver dies mid-sync, the sender
    aborts the old group (within 30 s), its device drains, its weights are untouched, and a new
    group to a new receiver delivers a new version bit for bit. The aborted group's NCCL timeout then
    passes without taking the process down, and the process exits cleanly."""
    _require_two_gpus()
    reports, codes = _run_scenario(abort_at_once=True, old_timeout_s=ABORTING_GROUP_TIMEOUT_S)
    story = _story(reports, codes)
    print(story)  # what `sync` did with a dead receiver is recorded there (pytest -s / -rP)
    sender = _check_errors_and_dead_receiver(reports, codes, story)
    _check_recovery(reports, codes, sender, story)
    assert "outlived_old_timeout" in sender, \
        f"the aborted group's timeout took the sender down (exit code {codes.get('sender')})\n{story}"
    assert "done" in sender and codes.get("sender") == 0, story


@pytest.mark.gpu
def test_hung_engine_cannot_take_the_trainer_down():
    """Checks that a hung engine cannot take the trainer down: the receiver dies mid-sync and nobody
    aborts, so the old group's transfer hangs until its NCCL timeout (15 s here). The desired outcome:
    the trainer (sender) process is still alive after the timeout (plus margin), a later
    `close(abort=True)` returns, the device drains, and a new group works.

    torch's NCCL watchdog reacts to a timed-out collective by TORCH_NCCL_ASYNC_ERROR_HANDLING, whose
    default tears the process down (this test failed that way, exit code -6, before the weight-sync
    groups were built with 2, abort the communicator only); it then also waited a minute for a
    flight-recorder dump while holding the group's work list. The "after_timeout" report records
    whether `sync` had ended (raised: the group takes no more transfers) and whether
    `torch.cuda.synchronize()` returned before the abort."""
    _require_two_gpus()
    reports, codes = _run_scenario(abort_at_once=False, old_timeout_s=WATCHDOG_GROUP_TIMEOUT_S)
    story = _story(reports, codes)
    print(story)
    sender = _check_errors_and_dead_receiver(reports, codes, story)
    assert "after_timeout" in sender, (
        f"the trainer process did not survive the weight-sync group's NCCL timeout of "
        f"{WATCHDOG_GROUP_TIMEOUT_S:.0f} s (sender exit code {codes.get('sender')})\n{story}")
    _check_recovery(reports, codes, sender, story)
    assert "done" in sender and codes.get("sender") == 0, story

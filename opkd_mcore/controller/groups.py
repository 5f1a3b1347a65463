"""The run's actors: trainer ranks, rollout engines and scoring teachers, and how they are wired.

Every multi-party step is started for all its members first and then awaited together, with one
deadline and an error naming whoever did not finish: the trainer ranks' process group (rank 0
listens on an OS-given port, then all ranks join), and the weight-sync groups (stage owners bind
their ports, then the stage owners and every rollout engine's workers join in one call). Nothing is
left un-awaited, so no member can try to join a group whose store is not listening yet.

Rollout and teacher actors restart on death (`controller.max_restarts`, Ray's actor restarts); the
driver re-queues their in-flight work and calls `recover_rollout`, which rebuilds the weight-sync
groups (a group with a dead member is unusable for everyone) and gives the restarted engine the
current weights. Trainer actors do not restart: their death stops the run (`TrainerDied`).
"""
from __future__ import annotations

import logging
import time

from opkd_mcore.config.placement_rules import teacher_actor_endpoints
from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.controller.engine_workers import RolloutEngineWorker, TeacherWorker
from opkd_mcore.controller.placement import Placement
from opkd_mcore.controller.trainer_worker import TrainerWorker
from opkd_mcore.platform import is_cpu
from opkd_mcore.train.components import student_vocab_size

logger = logging.getLogger(__name__)


CONTROL = "control"  # trainer actors' second thread (`WorkerGroups.abort_trainer_weight_sync`)


class TrainerDied(RuntimeError):
    """A trainer rank's actor died; the run stops, the last complete checkpoint is intact."""


class ActorLost(RuntimeError):
    """An actor died (`member` names it) and could not be brought back."""

    def __init__(self, message: str, member: str = ""):
        super().__init__(message)
        self.member = member


class StageFailed(RuntimeError):
    """A member's call raised; the message names the member and carries the cause's message."""


class Gather:
    """Results of named calls as they arrive; after a failure the rest get `grace_s` to finish
    (a member's death leaves its peers blocked in collectives: waiting out their deadline helps no one)."""

    def __init__(self, named: dict, what: str, timeout_s: float, grace_s: float = 10.0):
        self.named, self.what, self.grace_s = named, what, grace_s
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.pending = list(named.values())
        self.results: dict = {}
        self.failures: list[Exception] = []

    def take(self, ready: list) -> None:
        """Record the calls of `ready` (refs of this gather that have finished)."""
        import ray

        for name, ref in self.named.items():
            if ref not in ready or ref not in self.pending:
                continue
            self.pending.remove(ref)
            try:
                self.results[name] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                lost = ActorLost(f"{self.what}: {name}: its actor died ({type(err).__name__})", name)
                lost.__cause__ = err
                self.failures.insert(0, lost)  # a dead member first: its peers' errors are consequences
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if err.cause is not None else err
                failed = StageFailed(f"{self.what}: {name}: {type(cause).__name__}: {cause}")
                failed.__cause__ = err
                self.failures.append(failed)
            if self.failures:
                self.deadline = min(self.deadline, time.monotonic() + self.grace_s)

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def done(self) -> bool:
        """True when every call finished, or the deadline passed (then `result` raises)."""
        return not self.pending or self.remaining() == 0.0

    def result(self) -> dict:
        if self.failures:
            first = self.failures[0]
            if len(self.failures) > 1 and not isinstance(first, ActorLost):  # every member's own words
                order = list(self.named)
                def place(line: str) -> int:
                    return next((i for i, n in enumerate(order) if line.startswith(f"{n}: ")), 0)

                lines = sorted((str(f).removeprefix(f"{self.what}: ") for f in self.failures), key=place)
                combined = StageFailed(f"{self.what}: {len(lines)} members failed: " + " | ".join(lines))
                combined.__cause__ = first.__cause__
                raise combined
            raise first
        if self.pending:
            late = [n for n, r in self.named.items() if r in self.pending]
            raise TimeoutError(f"{self.what}: {late} did not finish within {self.timeout_s:.0f} s "
                               f"(finished: {sorted(self.results) or 'none'})")
        return self.results


def await_named(named: dict, timeout_s: float, what: str) -> dict:
    """Wait for named object refs together; errors name the member that failed or did not finish."""
    import ray

    gather = Gather(named, what, timeout_s)
    while not gather.done():
        ready, _ = ray.wait(gather.pending, num_returns=1, timeout=gather.remaining(), fetch_local=False)
        gather.take(ready)
    return gather.result()


StartCall = tuple  # (name, Slot, call: () -> ObjectRef)


def start_waves(engines: list[StartCall], trainers: list[StartCall], shared_device) -> list[list[StartCall]]:
    """The start-up calls in waves, each awaited before the next starts.

    vLLM sizes its KV cache from the device's free memory measured around a profiling run, and
    assumes nobody else allocates or frees on that device meanwhile (it asserts on memory freed; memory
    allocated by a neighbour is taken for its own and shrinks the cache, or leaves none). So actors
    that share a device (`shared_device(slot)` is not None) start one at a time: the k-th engine of each
    device in wave k, then the trainer ranks, all in one wave, as their setup is one collective. Actors
    on devices of their own (and every actor on CPU) start together in the first wave."""
    waves: list[list[StartCall]] = [[]]
    per_device: dict = {}
    for call in engines:
        key = shared_device(call[1])
        k = 0 if key is None else per_device.get(key, 0)
        if key is not None:
            per_device[key] = k + 1
        while len(waves) <= k:
            waves.append([])
        waves[k].append(call)
    if any(shared_device(call[1]) is not None for call in trainers):
        waves.append(list(trainers))
    else:
        waves[0] += trainers
    return [w for w in waves if w]


def is_actor_death(err: BaseException) -> bool:
    import ray

    return isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class WorkerGroups:
    """Creates and owns the actors of one run (reusable across runs of the same workload)."""

    def __init__(self, cfg: TrainConfig, world_size: int):
        import ray

        self.cfg, self.world_size = cfg, world_size
        ctl = cfg.controller
        self.placement = Placement(cfg, world_size, timeout_s=ctl.call_timeout_s)
        device = cfg.run.device
        # the control thread: leaving a weight-sync group must not queue behind a send blocked on it
        trainer_cls = ray.remote(max_restarts=0, concurrency_groups={CONTROL: 1})(TrainerWorker)
        self.trainers = [trainer_cls.options(**slot.actor_options(device)).remote(cfg, rank, world_size)
                         for rank, slot in enumerate(self.placement.trainer)]
        # engine actors build their engine in the constructor: `_start` creates them, in waves
        self.rollouts: list = [None] * len(self.placement.rollout)
        self.teachers: dict[str, list] = {}
        self._teacher_places: list[tuple[str, int, str | None]] = []  # (name, replica, url) per slot
        for endpoint, url in teacher_actor_endpoints(cfg):
            self.teachers.setdefault(endpoint.name, []).append(None)
            self._teacher_places.append((endpoint.name, len(self.teachers[endpoint.name]) - 1, url))
        self._vocab = student_vocab_size(cfg)
        # a few threads: a weight update arrives while a generate call runs (the worker's gate orders them)
        self._rollout_cls = ray.remote(max_restarts=ctl.max_restarts, max_concurrency=4)(RolloutEngineWorker)
        self._teacher_cls = ray.remote(max_restarts=ctl.max_restarts)(TeacherWorker)
        self.restarts = {"rollout": 0, "teacher": 0}
        self.sync_groups: list[dict] = []
        self._start()

    # ---- start-up ------------------------------------------------------------------------------
    def _start_calls(self, host: str, port: int) -> tuple[list[StartCall], list[StartCall]]:
        """(engine starts, trainer setups): each a (name, slot, call) whose call creates the actor
        if need be and returns the ref of its start."""
        device = self.cfg.run.device

        def rollout(e: int, slot):
            def call():
                self.rollouts[e] = self._rollout_cls.options(**slot.actor_options(device)).remote(self.cfg, e)
                return self.rollouts[e].ping.remote()
            return call

        def teacher(name: str, replica: int, url: str | None, slot):
            def call():
                actor = self._teacher_cls.options(**slot.actor_options(device)).remote(self.cfg, name, url,
                                                                                        self._vocab)
                self.teachers[name][replica] = actor
                return actor.ping.remote()
            return call

        engines = [(f"rollout engine {e} start", slot, rollout(e, slot))
                   for e, slot in enumerate(self.placement.rollout)]
        engines += [(f"teacher {name}[{replica}] start", slot, teacher(name, replica, url, slot))
                    for (name, replica, url), slot in zip(self._teacher_places, self.placement.teachers)]
        trainers = [(f"trainer rank {r} setup", slot, lambda t=t: t.setup.remote(host, port))
                    for r, (t, slot) in enumerate(zip(self.trainers, self.placement.trainer))]
        return engines, trainers

    def _start(self) -> None:
        import ray

        timeout = self.cfg.controller.call_timeout_s
        host, port = ray.get(self.trainers[0].listen.remote(self.rendezvous_host()), timeout=timeout)
        engines, trainers = self._start_calls(host, port)
        waves = start_waves(engines, trainers, self.placement.shared_device)
        for wave in waves:
            await_named({name: call() for name, _, call in wave}, timeout, "controller start-up")
        if len(waves) > 1:
            logger.info("controller: started in %d waves (actors sharing a device start one at a time)",
                        len(waves))
        self.connect_weight_sync()
        logger.info("controller: %d trainer ranks, %d rollout engines, teachers %s (%s placement)",
                    len(self.trainers), len(self.rollouts),
                    {n: len(a) for n, a in self.teachers.items()}, self.placement.kind)

    @property
    def workers_per_engine(self) -> int:
        return self.cfg.controller.rollout_tp

    def transport(self) -> str:
        """`weight_sync.transport` with "auto" resolved: device IPC when the engines share the
        trainer ranks' devices (colocated, accelerator); the stateless group everywhere else.

        Colocated engines on accelerators cannot join a group transport: engine e shares trainer rank
        e's device, and an accelerator collective refuses two members on one device (`transport:
        group` there is a config error, `config.validate`). Engines on the other ranks' devices map
        rank 0's buffers through peer access, which reaches one node only."""
        name = self.cfg.weight_sync.transport
        colocated = self.placement.kind == "colocated" and not is_cpu(self.cfg.run.device)
        if colocated and len(nodes := self.placement.nodes()) > 1:
            raise RuntimeError(f"controller.placement: colocated engines read trainer rank 0's buffers by "
                               f"device IPC, which stays on one node; the shared pool spans {len(nodes)} "
                               f"nodes ({sorted(nodes)}); use placement: disaggregated, or fewer trainer "
                               "ranks")
        if name != "auto":
            return name
        return "colocated_ipc" if colocated else "group"

    def rendezvous_host(self) -> str | None:
        """Where trainer rank 0 serves its stores (the trainer group's and the weight-sync groups'):
        `weight_sync.host`, or None (the serving rank's node address) for the default loopback when
        the cluster has several nodes. One key for both: each store must be reachable by its peers
        and by nothing else, and the run's peers are the same machines."""
        import ray

        host = self.cfg.weight_sync.host
        alive = [n for n in ray.nodes() if n.get("Alive")]
        return None if host == "127.0.0.1" and len(alive) > 1 else host  # None: the stage owner's node

    def connect_weight_sync(self) -> None:
        """(Re)build the weight-sync groups: bind on the trainer ranks, then every member joins at once."""
        ctl, tp = self.cfg.controller, self.workers_per_engine
        transport = self.transport()
        receivers, host = len(self.rollouts) * tp, self.rendezvous_host()
        bound = await_named({f"trainer rank {r} bind": t.bind_weight_sync.remote(host, receivers, transport)
                             for r, t in enumerate(self.trainers)}, ctl.sync_timeout_s, "weight-sync bind")
        self.sync_groups = bound["trainer rank 0 bind"]
        named = {f"trainer rank {r} joins": t.connect_weight_sync.remote()
                 for r, t in enumerate(self.trainers)}
        for e, r in enumerate(self.rollouts):
            named[f"rollout engine {e} joins (group ranks {1 + e * tp}..{(e + 1) * tp})"] = \
                r.join_weight_sync.remote(self.sync_groups, 1 + e * tp, transport)
        await_named(named, ctl.sync_timeout_s, f"weight-sync groups {self.describe_groups()}")

    def close_weight_sync(self) -> None:
        """Tear the groups down on every member at once. An accelerator group's teardown flushes and
        waits for its peers, so a trainer rank that closed alone (to rebuild its model) blocked until
        the engines closed too, which they did only on the next join: a hang on two GPUs."""
        named = {f"trainer rank {r} closes": t.close_weight_sync.remote()
                 for r, t in enumerate(self.trainers)}
        named.update({f"rollout engine {e} closes": r.close_weight_sync.remote()
                      for e, r in enumerate(self.rollouts)})
        await_named(named, self.cfg.controller.sync_timeout_s, "weight-sync groups close")

    def abort_trainer_weight_sync(self) -> None:
        """Trainer ranks leave a group that lost a member, now: on the actors' control thread, beside
        a `sync_weights` still blocked on that group, whose wait the abort ends where the backend can
        (an accelerator communicator's abort does; a CPU group's wait runs to its timeout: see
        `platform.stateless_group.destroy_stateless_group`). ActorLost names a rank whose actor is gone."""
        named = {f"trainer rank {r} aborts its weight sync":
                 t.close_weight_sync.options(concurrency_group=CONTROL).remote(True)
                 for r, t in enumerate(self.trainers)}
        await_named(named, self.cfg.controller.sync_timeout_s, "weight-sync abort")

    def describe_groups(self) -> str:
        return ", ".join(f"stage {s} at {g['host']}:{g['port']}" for s, g in enumerate(self.sync_groups))

    # ---- weight sync ---------------------------------------------------------------------------
    def start_sync(self, version: int, abort_in_flight: bool = False) -> dict:
        """Every engine's receive and every trainer rank's send, started together (await them together)."""
        tp = self.workers_per_engine
        named = {f"rollout engine {e} (group ranks {1 + e * tp}..{(e + 1) * tp}) receives v{version}":
                 r.receive_weights.remote(version, abort_in_flight) for e, r in enumerate(self.rollouts)}
        named.update({f"trainer rank {r} sends v{version}": t.sync_weights.remote(version)
                      for r, t in enumerate(self.trainers)})
        return named

    def sync(self, version: int, abort_in_flight: bool = False) -> float:
        """Move the trainer's weights to every engine as `version`; returns the slowest sender's seconds."""
        timeout = 2 * self.cfg.controller.sync_timeout_s  # the transports time out first, with details
        done = await_named(self.start_sync(version, abort_in_flight), timeout,
                           f"weight sync v{version} over {self.describe_groups()}")
        return max(v for k, v in done.items() if k.startswith("trainer"))

    # ---- faults --------------------------------------------------------------------------------
    def wait_alive(self, actor, what: str) -> None:
        """Block until a (restarting) actor answers; ActorLost when its restarts are used up."""
        import ray

        limit = self.cfg.controller.call_timeout_s
        deadline = time.monotonic() + limit
        while True:
            try:
                ray.get(actor.ping.remote(), timeout=max(deadline - time.monotonic(), 0))
                return
            except ray.exceptions.ActorUnavailableError:  # restarting: its constructor runs again
                if time.monotonic() > deadline:
                    raise ActorLost(f"{what} did not restart within {limit:.0f} s", what) from None
                time.sleep(1.0)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                restarts = self.cfg.controller.max_restarts
                raise ActorLost(f"{what} did not come back (controller.max_restarts = {restarts}): "
                                f"{type(err).__name__}: {err}", what) from err

    def recover_rollout(self, engine: int, weights_ahead: bool, version: int) -> int:
        """After engine `engine` died: wait for its restart, rebuild the groups, sync the trainer's
        weights to every engine. Returns the version the engines now hold: `version`, or `version + 1`
        when the trainer has trained past it (`weights_ahead`), so that labels stay true."""
        self.restarts["rollout"] += 1
        start = time.perf_counter()
        new_version = version + 1 if weights_ahead else version
        self.rebuild_weight_sync(new_version)
        logger.warning("controller: rollout engine %d restarted and resynced to v%d in %.1f s", engine,
                       new_version, time.perf_counter() - start)
        return new_version

    def rebuild_weight_sync(self, version: int) -> None:
        """After an engine died: once every engine answers (a dead one has restarted), new groups,
        and `version` synced over them (a group with a dead member is unusable for everyone)."""
        for e, actor in enumerate(self.rollouts):
            self.wait_alive(actor, f"rollout engine {e}")
        self.connect_weight_sync()
        self.sync(version)

    def recover_teacher(self, name: str, replica: int) -> None:
        self.restarts["teacher"] += 1
        self.wait_alive(self.teachers[name][replica], f"teacher {name}[{replica}]")

    # ---- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release every actor and placement group (a second call does nothing)."""
        import ray

        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        actors = [a for a in (*self.trainers, *self.rollouts, *(a for v in self.teachers.values() for a in v))
                  if a is not None]  # None: start-up failed before creating it
        refs = []
        for actor in actors:
            try:
                refs.append(actor.shutdown.remote())
            except Exception as err:  # noqa: BLE001  (an actor already gone has nothing to release)
                logger.debug("shutdown of %s skipped: %s", actor, err)
        ray.wait(refs, num_returns=len(refs), timeout=60)
        for actor in actors:
            ray.kill(actor)
        self.placement.remove()

"""Several teachers, picked per sample by a data field, each with replicas balanced by load.

`TeacherRouter.score(sequences, data)` groups samples by `data[i][field]` (e.g. `data_source`),
cuts each group into chunks and sends every chunk to the replica of its teacher with the fewest
requests in flight (ties: the one that has served fewest). A replica that stays unreachable is
skipped for that chunk; when every replica of a teacher has failed, the step fails with an error
naming the teacher and the addresses tried -- it never trains on missing teacher data.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from opkd_mcore.teacher.base import (
    SampleScorer,
    Teacher,
    TeacherOutput,
    TeacherUnavailableError,
    check_outputs,
    check_sequences,
)

logger = logging.getLogger(__name__)


class _Replica:
    def __init__(self, teacher: Teacher):
        self.teacher = teacher
        self.in_flight = 0
        self.served = 0  # chunks sent here (for tests and metrics)
        self.peak_in_flight = 0  # most chunks this replica held at once


class TeacherPool:
    """Replicas of one teacher; `score` runs a chunk on the least-loaded healthy replica."""

    def __init__(self, name: str, replicas: Sequence[Teacher]):
        if not replicas:
            raise ValueError(f"teachers[{name!r}]: expected at least one replica")
        self.name = name
        self.replicas = [_Replica(t) for t in replicas]
        self._lock = threading.Lock()

    def _acquire(self, exclude: set[int]) -> int | None:
        with self._lock:
            free = [i for i in range(len(self.replicas)) if i not in exclude]
            if not free:
                return None
            best = min(free, key=lambda i: (self.replicas[i].in_flight, self.replicas[i].served))
            replica = self.replicas[best]
            replica.in_flight += 1
            replica.served += 1
            replica.peak_in_flight = max(replica.peak_in_flight, replica.in_flight)
            return best

    def _release(self, index: int) -> None:
        with self._lock:
            self.replicas[index].in_flight -= 1

    def score(self, sequences: list[list[int]]) -> list[TeacherOutput]:
        tried: set[int] = set()
        errors = []
        while (index := self._acquire(tried)) is not None:
            tried.add(index)
            replica = self.replicas[index].teacher
            try:
                return replica.score(sequences)
            except TeacherUnavailableError as err:
                errors.append(f"{err.address}: {err}")
                logger.warning("teacher %r: replica %s unreachable, trying another", self.name,
                               err.address)
            finally:
                self._release(index)
        addresses = ", ".join(self.replicas[i].teacher.address for i in sorted(tried))
        raise TeacherUnavailableError(
            f"teacher {self.name!r}: every replica unreachable ({addresses}); " + " | ".join(errors),
            addresses)

    @property
    def served(self) -> list[int]:
        return [r.served for r in self.replicas]

    @property
    def peak_in_flight(self) -> list[int]:
        return [r.peak_in_flight for r in self.replicas]


class TeacherRouter(SampleScorer):
    """Route each sample to the teacher named by `data[i][field]`.

    Args:
        teachers: name -> teacher, or name -> list of replicas of that teacher.
        field: data key that names the teacher of a sample.
        default: teacher for samples without the field (None: such a sample is an error).
        chunk_size: sequences per request to one replica (the unit of load balancing).
        max_workers: chunks scored concurrently.
    """

    def __init__(self, teachers: Mapping[str, Teacher | Sequence[Teacher]], *,
                 field: str = "data_source", default: str | None = None, chunk_size: int = 4,
                 max_workers: int = 8):
        if not teachers:
            raise ValueError("teachers: expected at least one teacher")
        if default is not None and default not in teachers:
            raise ValueError(f"default: {default!r} is not one of the teachers {sorted(teachers)}")
        if chunk_size < 1 or max_workers < 1:
            raise ValueError(f"chunk_size and max_workers: expected >= 1, got {chunk_size}, {max_workers}")
        self.pools = {name: TeacherPool(name, list(t) if isinstance(t, (list, tuple)) else [t])
                      for name, t in teachers.items()}
        self.field, self.default = field, default
        self.chunk_size, self.max_workers = chunk_size, max_workers

    def teacher_of(self, data: Sequence[Mapping]) -> list[str]:
        """Teacher name per sample; ValueError naming the sample and value when it has none."""
        names = []
        for i, d in enumerate(data):
            name = d.get(self.field, self.default)
            if name is None:
                raise ValueError(f"data[{i}]: no {self.field!r} field and no default teacher")
            if name not in self.pools:
                raise ValueError(f"data[{i}][{self.field!r}] = {name!r}: no such teacher; "
                                 f"expected one of {sorted(self.pools)}")
            names.append(name)
        return names

    def score(self, sequences: Sequence[Sequence[int]], data: Sequence[Mapping]) -> list[TeacherOutput]:
        seqs = check_sequences(sequences)
        if len(data) != len(seqs):
            raise ValueError(f"data: expected one dict per sequence ({len(seqs)}), got {len(data)}")
        names = self.teacher_of(data)
        jobs = []  # (teacher name, sample indices)
        for name in self.pools:
            idx = [i for i, n in enumerate(names) if n == name]
            jobs += [(name, idx[s:s + self.chunk_size]) for s in range(0, len(idx), self.chunk_size)]
        results: list[TeacherOutput | None] = [None] * len(seqs)
        with ThreadPoolExecutor(max_workers=min(self.max_workers, max(len(jobs), 1))) as pool:
            futures = [(idx, pool.submit(self.pools[name].score, [seqs[i] for i in idx]))
                       for name, idx in jobs]
            for idx, future in futures:
                for i, out in zip(idx, future.result()):
                    results[i] = out
        check_outputs(seqs, results, "teacher router")
        return results

    def score_samples(self, sequences: Sequence[Sequence[int]],
                      data: Sequence[Mapping]) -> list[TeacherOutput]:
        """`score`: each sample goes to the teacher its data names."""
        return self.score(sequences, data)

    def close(self) -> None:
        for pool in self.pools.values():
            for replica in pool.replicas:
                replica.teacher.close()

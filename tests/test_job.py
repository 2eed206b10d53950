"""core/launcher/job.py: what follows a failed round, by table, and that the job never asks which backend runs."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

import mpddp
from mpddp.core.launcher.job import Failed, Step, _final, next_step
from mpddp.errors import Outcome, RankFailure, RestartsExhausted, StoreLost, WorkerFailed

JOB = Path(mpddp.__file__).parent / "core" / "launcher" / "job.py"
NODE0_ONLY = "not restarted: no other node can take node 0's place"  # a RoundStore's lost: one store for all


def backend_names(source: str) -> list[str]:
    """Every place ``source`` names a rendezvous backend: a backend's name in a string or a comment, an
    identifier with one in it (``EtcdRendezvous``, ``c10d``), or the option or flag that picks one."""
    word = re.compile(r"(?i)\b(etcd|c10d|static)\b|rdzv[-_]backend")
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.STRING, tokenize.COMMENT) and word.search(token.string):
            found.append(token.string)
        elif token.type == tokenize.NAME and (re.search(r"(?i)etcd|c10d", token.string) or "static" in
                                              token.string.lower().split("_") or token.string in
                                              ("rdzv_backend", "hosts_round_store")):
            found.append(token.string)
    return found


def test_job_never_names_a_backend():
    """It asks the rendezvous (core/nodes/api.py) about the job, never which backend it is."""
    assert backend_names(JOB.read_text()) == []


@pytest.mark.parametrize("planted, named", [
    ('if config.rdzv_backend == "etcd":\n    pass\n', ["rdzv_backend", '"etcd"']),
    ("fixed = not job.link.hosts_round_store\n", ["hosts_round_store"]),
    ("from ..nodes.c10d import C10dRendezvous\n", ["c10d", "C10dRendezvous"]),
    ("here = isinstance(link, EtcdRendezvous)\n", ["EtcdRendezvous"]),
    ("port = 0  # under static, node 0 hosts the store\n", ["# under static, node 0 hosts the store"]),
    ('line = "with --rdzv-backend of the job"\n', ['"with --rdzv-backend of the job"']),
    ("@staticmethod\ndef f():\n    return 'a static picture'\n", ["'a static picture'"]),
])
def test_a_backend_named_in_the_job_would_be_found(planted, named):
    assert backend_names(JOB.read_text() + planted) == named


def _worker_failed(outcome: Outcome = Outcome.RAISED) -> WorkerFailed:
    return WorkerFailed("mpddp: rank 1 failed", 1, [RankFailure(1, 0, 1, outcome)])


@pytest.mark.parametrize("error, store_lost, lost, restarts, max_restarts, step", [
    (_worker_failed(), False, None, 0, 3, Step.RESTART),
    (_worker_failed(), False, None, 3, 3, Step.END),  # restarts used up
    (_worker_failed(), False, None, 0, 0, Step.END),
    (_worker_failed(), False, NODE0_ONLY, 0, 3, Step.RESTART),  # node 0's store still up: restart
    (_worker_failed(), True, NODE0_ONLY, 0, 3, Step.END),  # this node's store server lost, and none can replace it
    (_worker_failed(), True, None, 0, 3, Step.RESTART),  # the next round's first node hosts a fresh one
    (StoreLost("node 0's store is gone"), True, NODE0_ONLY, 0, 3, Step.END),
    (StoreLost("the round's store is gone"), True, None, 1, 3, Step.RESTART),
    (StoreLost("the round's store is gone"), True, None, 3, 3, Step.END),
    (_worker_failed(Outcome.RESIZED), False, None, 3, 3, Step.ADMIT),  # free, even with no restart left
    (_worker_failed(Outcome.RESIZED), True, NODE0_ONLY, 0, 0, Step.ADMIT),
    (WorkerFailed("mpddp: no rank named", -1, []), False, None, 0, 1, Step.RESTART),
])
def test_what_follows_a_failed_round(error, store_lost, lost, restarts, max_restarts, step):
    assert next_step(Failed(error, store_lost, lost), restarts, max_restarts) is step


def test_the_end_says_why():
    """A lost store none can replace says so (the backend's words); restarts used up say that, typed."""
    lost = _final(Failed(StoreLost("node 0's store is gone"), True, NODE0_ONLY), max_restarts=2)
    assert isinstance(lost, StoreLost) and str(lost) == f"node 0's store is gone\nmpddp: {NODE0_ONLY}"
    failed = _worker_failed()
    assert _final(Failed(failed, False, None), max_restarts=0) is failed
    exhausted = _final(Failed(failed, False, None), max_restarts=2)
    assert isinstance(exhausted, RestartsExhausted) and exhausted.rank == 1
    assert str(exhausted).endswith("gave up after 2 restart(s) (max_restarts=2); raise --max-restarts or fix the "
                                   "failure above")
    gave_up = _final(Failed(StoreLost("the round's store is gone"), True, None), max_restarts=2)
    assert type(gave_up) is StoreLost and "gave up after 2 restart(s)" in str(gave_up)

"""Which launch of a ``--rdzv-id`` a launcher belongs to under the etcd backend, and whose its ``--node-rank`` is.

Owns: the job's incarnations. Each launch of a job takes one: a fencing token, written create-if-absent as
``/mpddp/<rdzv-id>/incarnation`` (a transaction), and every key of that launch lies under ``i/<token>/``, so a
crashed launch's keys, and its leases still alive, are never read as the new one's. A launcher joins the standing
incarnation while one of its launchers is alive, and replaces it (a compare-and-set on the token) once every one
of them is gone. Alive is asked of the launchers themselves: each one listens on a port of its own
(:class:`Probe`) and puts where, with its lease, under ``launcher/``. A refused connection says its process is
gone; an answer (a frozen process's kernel answers too) or no answer at all (a machine lost, or out of reach)
never does: then the lease decides, within its TTL. So a live job is never taken over, and a crashed one is
replaced at once. The incarnation's :class:`~mpddp.core.wire.fingerprint.Fingerprint` (what its launchers run) is
written with it (``job``): a launcher whose own differs never joins it, refused in one line. The same reading
decides a ``--node-rank`` held by another launcher (``claim/<rank>``): refused in one line while it lives, taken
over once it is gone. Two launches of one script and arguments started together, without node ranks, are one job
with spares to etcd: nothing tells them apart (core/nodes/membership.py's spare says so).

Leaves the rounds under an incarnation to core/nodes/etcd.py and core/nodes/membership.py.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from ...errors import AddressError, ConfigError, OtherJob
from ...log import logger
from ..stores.etcd_kv import EtcdKV, absent, delete, equal, put
from ..wire.fingerprint import Fingerprint, refusal

_PROBE_WAIT = 1.0  # seconds a probe's connection may take: no answer by then is not a proof of death
_SAMPLE = 8  # launchers probed first: in a live job the first answers; all are probed only when these refused
_LOOK = 0.5  # seconds between two looks while the lease of a launcher that does not answer decides


class Liveness(enum.Enum):
    """What a launcher's probe says of it."""

    LIVE = "live"  # its port answered: the process lives (perhaps frozen: its kernel answers for it)
    GONE = "gone"  # refused: nothing listens there any more, its process is gone
    UNKNOWN = "unknown"  # no answer (a machine lost, or out of this one's reach): its lease decides


def standing(answers: Iterable[Liveness]) -> Liveness:
    """An incarnation from its launchers' answers: LIVE if one lives, GONE if every one is gone (or none is
    left: their leases ran out), else UNKNOWN."""
    seen = set(answers)
    if Liveness.LIVE in seen:
        return Liveness.LIVE
    return Liveness.UNKNOWN if Liveness.UNKNOWN in seen else Liveness.GONE


def reach(probe: str, host: str, here: str) -> Liveness:
    """A launcher on ``host`` that listens at ``probe`` (host:port), asked from the machine ``here``."""
    address, _, port = probe.rpartition(":")
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(address.strip("[]")).is_loopback and host != here:
            return Liveness.UNKNOWN  # another machine's loopback: a refusal here says nothing of it
    try:
        socket.create_connection((address.strip("[]"), int(port)), timeout=_PROBE_WAIT).close()
        return Liveness.LIVE
    except ConnectionRefusedError:
        return Liveness.GONE
    except (OSError, ValueError):
        return Liveness.UNKNOWN


class Probe:
    """A port this launcher listens on while it lives: its kernel refuses a connection there once it is gone."""

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((address, 0))
        except OSError as e:
            self._sock.close()
            raise AddressError(f"--local-addr {address} is not an address of this machine ({e.strerror}): the "
                               "other launchers reach this one there; pass one of its own addresses") from None
        self._sock.listen(128)
        self.where = f"{address}:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, name="mpddp-etcd-probe", daemon=True).start()

    def _serve(self) -> None:
        while True:  # a connection is answered by being accepted: nothing is read or written
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()


class Identity:
    """This launcher's incarnation of job ``rdzv_id`` and its claim on a ``--node-rank`` (of ``high``: MAX),
    through ``kv``, its keys put with this launcher's lease; it listens at ``address``, and runs ``job``."""

    def __init__(self, kv: EtcdKV, rdzv_id: str, me: str, address: str, high: int,
                 job: Fingerprint | None = None) -> None:
        self.kv, self.rdzv_id, self.me, self.ttl, self.high, self.job = kv, rdzv_id, me, kv.ttl, high, job
        self.base = f"/mpddp/{rdzv_id}/"
        self.probe = Probe(address)
        self.host = socket.gethostname()
        self.token: str | None = None
        self._card = json.dumps({"me": me, "host": self.host, "probe": self.probe.where})  # who and where

    def prefix(self, token: str) -> str:
        return f"{self.base}i/{token}/"

    # ---- the incarnation ----------------------------------------------------------------------------------------

    def take(self) -> str:
        """The prefix of the incarnation this launcher joins (the standing one while a launcher of it lives),
        once its ``launcher/<me>`` is put there, in the transaction that checks the token still stands."""
        pointer, deadline = self.base + "incarnation", time.monotonic() + self.ttl + 2 * _PROBE_WAIT
        told = False
        while True:
            found = self.kv.get(pointer)
            current = found.decode() if found is not None else None
            state = Liveness.GONE if current is None else self._standing(current)
            if state is Liveness.UNKNOWN and time.monotonic() < deadline:
                if not told:
                    told = True
                    logger.warning("mpddp: --rdzv-id %s: no launcher of its running launch answers this machine, and "
                                   "their leases hold: waiting up to %d s (the lease's TTL) to learn whether it "
                                   "lives", self.rdzv_id, self.ttl)
                time.sleep(_LOOK)  # its lease runs out (a machine lost), or it lives on (out of this one's reach)
                continue
            token = current if current is not None and state is not Liveness.GONE else uuid.uuid4().hex[:12]
            puts = [put(self.prefix(token) + "launcher/" + self.me, self._card, self.kv.lease())]
            if token == current:  # a live launch's: written with it, so there once its token is
                self._same_job(token)
            else:
                puts.append(put(pointer, token))
                if self.job:
                    puts.append(put(self.prefix(token) + "job", self.job.encode()))
                if current is not None:
                    puts.append(put(self.base + "old/" + current, ""))  # swept once its last lease is gone
            if self.kv.commit([absent(pointer) if current is None else equal(pointer, current)], puts)["succeeded"]:
                if current is not None and token != current:
                    logger.info("mpddp: --rdzv-id %s: the launchers of its last launch are gone (incarnation %s): "
                                "this launch is incarnation %s", self.rdzv_id, current, token)
                self.token = token
                self.sweep()
                return self.prefix(token)

    def _same_job(self, token: str) -> None:
        """:class:`OtherJob` when incarnation ``token`` runs another job than this launcher's (none written: an
        mpddp that wrote none made it, not compared)."""
        standing = Fingerprint.decode(self.kv.get(self.prefix(token) + "job"))
        if self.job and standing and (difference := self.job.differs(standing)):
            raise OtherJob(refusal(f"--rdzv-id {self.rdzv_id}", difference, "give this job a --rdzv-id of its own"))

    def _standing(self, token: str) -> Liveness:
        """Whether a launcher of incarnation ``token`` lives: the first few asked, all of them only when those
        are gone (one read, and one connection, for a live job)."""
        for limit in (_SAMPLE, 0):
            cards = self._cards(token, limit)
            seen = [reach(c.get("probe", ""), str(c.get("host")), self.host) for c in cards]
            if Liveness.LIVE in seen or len(cards) < _SAMPLE:
                break
        return standing(seen)

    def sweep(self) -> None:
        """The keys of earlier incarnations none of whose launchers holds a lease any more: removed."""
        for token in self.kv.under(self.base + "old/", keys_only=True):
            if not self._cards(token, 1):
                self.kv.commit([], [delete(self.prefix(token), under=True), delete(self.base + "old/" + token)])

    def forget(self) -> None:
        """The last launcher of this incarnation leaves: the job's token goes too, unless another replaced it."""
        if self.token is None:
            return
        pointer = self.base + "incarnation"
        self.kv.commit([equal(pointer, self.token)], [delete(pointer)])
        self.sweep()

    # ---- a node rank --------------------------------------------------------------------------------------------

    def claim(self, node_rank: int) -> None:
        """``--node-rank node_rank`` for this launcher, in this incarnation, for as long as it lives (not one
        round: a twin that comes after a restart is refused too); bad input when a live launcher holds it."""
        assert self.token is not None, "claim() before take()"
        key, deadline = self.prefix(self.token) + f"claim/{node_rank}", time.monotonic() + self.ttl + 2 * _PROBE_WAIT
        while True:
            held = self.kv.create(key, self._card, leased=True)
            if held is None:
                return
            if not held:
                continue  # its holder left meanwhile
            holder = json.loads(held)
            if holder.get("me") == self.me:
                return  # its own, from an earlier round (a spare claims again at each round it comes to)
            state = reach(holder.get("probe", ""), str(holder.get("host")), self.host)
            if state is Liveness.GONE:
                if self.kv.commit([equal(key, held)], [put(key, self._card, self.kv.lease())])["succeeded"]:
                    logger.info("mpddp: --node-rank %d: its launcher %s is gone; this one takes it", node_rank,
                                holder.get("me"))
                    return
            elif state is Liveness.UNKNOWN and time.monotonic() < deadline:
                time.sleep(_LOOK)  # its lease decides
            else:
                raise ConfigError(taken(self.rdzv_id, node_rank, holder, state, self.high, self.host))

    def _cards(self, token: str, limit: int) -> list[dict[str, Any]]:
        """What the launchers of incarnation ``token`` put: who and where, at most ``limit`` of them (0: all)."""
        cards = []
        for value in self.kv.under(self.prefix(token) + "launcher/", limit).values():
            with contextlib.suppress(ValueError):
                cards.append(json.loads(value))
        return cards

    def close(self) -> None:
        self.probe.close()


def taken(rdzv_id: str, node_rank: int, holder: dict[str, Any], state: Liveness, high: int, here: str) -> str:
    """The one line of a ``--node-rank`` that a live launcher of the job holds."""
    how = ("holds it and runs" if state is Liveness.LIVE else
           f"holds it and keeps its lease, though this machine cannot reach it at {holder.get('probe')}")
    return (f"--node-rank {node_rank} of --rdzv-id {rdzv_id} is taken: the launcher {holder.get('me')} on "
            f"{holder.get('host')} {how}; pass another --node-rank (0 to {high - 1}) on this machine ({here}), or "
            "give a second job a --rdzv-id of its own")

"""Failure reports: what the user is told, rendered from a :class:`~mpddp.core.launcher.classify.Verdict`.

Owns: the words of every report (a rank failed first, a hang, a mismatch,
a rank that left its peers waiting, another node's failure), down to the
plain :class:`~mpddp.errors.RankFailure` records the error carries, in the
order of the verdict (the cause first), and the exit code. It decides
nothing: which outcome each rank had and which rank is the cause is
core/launcher/classify.py's ``classify``, and nothing here changes a rank's state.
A rank's ``@record`` error file (core/wire/errorfile.py) adds the exception as
the rank saw it: its traceback where the worker's own report has none (the
script caught it and called ``sys.exit``), else its line and time.
Leaves watching to core/launcher/attempt.py and deciding which node's failure came first to core/nodes/settle.py.
"""

from __future__ import annotations

import time

from ...errors import CollectiveMismatch, HangError, Outcome, RankFailure, WorkerFailed
from ..nodes.api import is_lost_node
from ..procs import teardown
from ..wire import stacks
from ..wire.protocol import FailureRecord
from ..wire.stacks import ranks_named
from . import board
from .board import Mismatch
from .classify import Hang, RankState, Verdict, has_traceback, root_cause

_TAIL_LINES = 10


def _recorded(s: RankState) -> list[str]:
    """What rank ``s``'s @record error file adds: its traceback where the worker had none, else its line."""
    rec = s.error_file
    if rec is None:
        return []
    when = f", written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.timestamp))}" if rec.timestamp else ""
    source = f"its error file (torchelastic's @record{when})"
    if rec.traceback and not has_traceback(s):
        return [f"mpddp: traceback of rank {s.slot.rank}, from {source}:", rec.traceback.rstrip()]
    return [f"mpddp: rank {s.slot.rank}'s error file (torchelastic's @record{when}): {_short(rec.message)}"]


def _where(s: RankState) -> str:
    return f"rank {s.slot.rank} (node {s.slot.node_rank}, local rank {s.slot.local_rank})"


def _how(s: RankState) -> str:
    f = s.failure
    if f is not None and f.kind is Outcome.EXITED:
        return f"exited with code {f.exit_code} (sys.exit)"
    if f is not None:
        then = f", and while it was handled, {f.then}" if f.then else ""
        return f"raised {f.error_type}: {f.message}{then}"
    if s.lost_with is not None:
        return (f"was lost with mpddp's forkserver (pid {s.lost_with}), which starts every rank and reports its "
                "exit: it was killed from outside (a signal sent to it, or the out-of-memory killer); "
                "no rank of the job is left, and the next launch starts a new one")
    code = s.exitcode
    if code is not None and code < 0:
        name = teardown.signal_name(code)
        hint = " — the kernel's out-of-memory killer is a common cause (see `dmesg`; lower the batch size)" \
            if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code} without returning a result"


def _short(message: str, width: int = 160) -> str:
    """The first sentence (or line) of a long error message, cut at a word, never inside one."""
    line = message.splitlines()[0] if message else ""
    if len(line) <= width:
        return line
    cut = line.rfind(". ", 0, width)
    if cut > 40:
        return line[: cut + 1]
    space = line.rfind(" ", 0, width)
    return (line[:space] if space > 40 else line[:width]).rstrip(",;:") + "…"


def _others(states: list[RankState], verdict: Verdict, root: RankState | None, cause: int | None = None) -> list[str]:
    """A line for the ranks but ``root``, told against the rank that failed first (``cause``: on another node);
    ranks that ended alike share one line ("ranks 1-5, 9: ..."), so a hundred ranks stay a few lines."""
    first = root.slot.rank if root is not None else cause
    told: dict[object, tuple[list[int], str]] = {}  # how a rank ended (its structure, not its words) -> ranks, line
    for s in states:
        if s is root:
            continue
        outcome = verdict[s.slot.rank]
        key: object = outcome
        if outcome is Outcome.STOPPED:
            where = f", in {s.location.text}" if s.location is not None else ""
            key, line = (outcome, where), f"stopped by mpddp after rank {first} failed{where}"
        elif outcome is Outcome.COLLECTIVE and s.failure is not None:
            key = (outcome, s.failure.error_type, s.failure.where)  # the peers' messages differ by address alone
            line = (f"failed after rank {first} ({s.failure.error_type}: {_short(s.failure.message)}) — a "
                    "consequence, not the cause")
        elif outcome in (Outcome.RAISED, Outcome.EXITED, Outcome.DIED):
            said = f" (its error file: {_short(s.error_file.message)})" if s.error_file and not has_traceback(s) else ""
            line = f"also {_how(s)}{said}"
            key = line
        else:
            line = _ENDED.get(outcome, "finished")
        told.setdefault(key, ([], line))[0].append(s.slot.rank)
    return [f"  {ranks_named(ranks)}: {line}" for ranks, line in told.values()]


_ENDED = {Outcome.HUNG: "made no progress either", Outcome.MISMATCH: "called another collective than its peers",
          Outcome.EARLY_EXIT: "returned while its peers still waited for it"}  # how _others tells the rest


def exit_code(s: RankState) -> int:
    """What the CLI exits with for root cause ``s``: its own code, 128+signal when killed, else 1.

    Never 0 for a failure: ``sys.exit(256)`` would wrap around to 0 in the shell, so it becomes 1.
    """
    if s.lost_with is not None:
        return 1  # its 255 is multiprocessing's "no status", not the rank's
    code = s.failure.exit_code if s.failure is not None else s.exitcode
    if s.failure is None and code is not None and code < 0:
        return 128 - code  # a shell's convention: SIGKILL -> 137, what schedulers read as "killed"
    return code if code is not None and 0 < code < 256 else 1


def _records(states: list[RankState], verdict: Verdict, first: list[RankState]) -> list[RankFailure]:
    """``first``, then every other rank that did not end well, as plain records."""
    rest = [s for s in states if s not in first and verdict[s.slot.rank] is not Outcome.OK]
    return [s.record(verdict[s.slot.rank]) for s in (*first, *rest)]


def failure_error(states: list[RankState], verdict: Verdict) -> WorkerFailed:
    """The exception the parent raises, with the whole report as its message."""
    if verdict.case in ("returned", "left"):
        culprits = [s for s in states if s.slot.rank in verdict.culprits]
        render = _early_exit_error if verdict.case == "returned" else _left_error
        return render(states, verdict, culprits)
    root = root_cause(states, verdict)
    if verdict.case == "stuck":  # the others timed out in a collective, waiting for ranks that were still running
        stuck = [s for s in states if s.slot.rank in verdict.culprits]
        names = ", ".join(str(s.slot.rank) for s in stuck)
        waiting = ", ".join(str(s.slot.rank) for s in states if verdict[s.slot.rank] is Outcome.COLLECTIVE)
        first = _short(root.failure.message, 200) if root.failure and root.failure.message else ""
        failed = root.failure.where if root.failure and root.failure.where else "a collective"
        kind = root.failure.error_type if root.failure else "an error"
        lines = [f"mpddp: rank {names} had not arrived when rank {waiting}'s {failed} failed ({kind}: {first}); "
                 "every rank was stopped. Rank " + names + " is the one to look at: where it was is below."]
        lines += _tail_block(stuck[0])
        ordered = [*stuck, *[s for s in states if s not in stuck]]
        return HangError("\n".join(lines), stuck[0].slot.rank, [s.record(verdict[s.slot.rank]) for s in ordered])
    lines = [f"mpddp: {_where(root)} {_first(verdict[root.slot.rank])}: it {_how(root)}"]
    if root.failure is not None and root.failure.hint:
        lines.append(f"mpddp: {root.failure.hint}")
    lines += _tail_block(root)
    if root.failure is not None and root.failure.kind is not Outcome.EXITED and root.failure.traceback.strip():
        lines += [f"mpddp: traceback of rank {root.slot.rank}:", root.failure.traceback.rstrip()]
    lines += _recorded(root)
    others = _others(states, verdict, root)
    if others:
        lines += ["mpddp: the other ranks:", *others]
    rest = sorted((s for s in states if s is not root and verdict[s.slot.rank] is not Outcome.OK),
                  key=lambda s: s.failed_at or 0.0)
    error = WorkerFailed("\n".join(lines), root.slot.rank, [s.record(verdict[s.slot.rank]) for s in (root, *rest)],
                         exit_code=exit_code(root))
    error.exception = error.__cause__ = _exception(root)
    return error


def _first(outcome: Outcome) -> str:
    """How the root of this node's report failed, in its line: a rank whose collective failed only because a peer
    went away failed first nowhere (several nodes: every survivor of a lost node would name its own rank first)."""
    return "failed when a peer went away (no rank here failed by itself)" if outcome is Outcome.COLLECTIVE \
        else "failed first"


def _exception(s: RankState) -> BaseException | None:
    """The rank's own exception, loaded here when it can be (its classes importable in the launcher)."""
    if s.failure is None or s.failure.pickled is None:
        return None
    try:
        import cloudpickle

        loaded = cloudpickle.loads(s.failure.pickled)
    except Exception:  # noqa: BLE001 - a class only the worker had: the report's text stands alone
        return None
    return loaded if isinstance(loaded, BaseException) else None


def _left_error(states: list[RankState], verdict: Verdict, gone: list[RankState]) -> WorkerFailed:
    """A rank destroyed its process group (protocol.Left) while its peers still called collectives in it."""
    left = gone[0]
    assert left.left is not None
    waiting = [s for s in states if verdict[s.slot.rank] is Outcome.COLLECTIVE]
    where = "; ".join(f"rank {s.slot.rank} was in {s.failure.where or 'a collective'}" for s in waiting if s.failure)
    lines = [f"mpddp: {_where(left)} left the process group ({left.left.where}) while {where or 'its peers waited'}, "
             "which then failed; every rank was stopped. Every rank must call the same collectives before it leaves "
             "the group: look for a destroy_process_group (or a return) that only some ranks reach."]
    lines += _tail_block(left)
    others = _others(states, verdict, left)
    if others:
        lines += ["mpddp: the other ranks:", *others]
    return WorkerFailed("\n".join(lines), left.slot.rank, _records(states, verdict, gone), exit_code=1)


def _tail_block(s: RankState) -> list[str]:
    if not s.tail:
        return []
    return [f"mpddp: last lines of rank {s.slot.rank}:", *(f"  {line}" for line in s.tail[-_TAIL_LINES:])]


def _early_exit_error(states: list[RankState], verdict: Verdict, early: list[RankState]) -> WorkerFailed:
    """A rank returned (or exited 0) while its peers still waited for it in a collective: it is the cause."""
    waits = {s.slot.rank: s.failure.where if s.failure else None
             for s in states if verdict[s.slot.rank] is Outcome.COLLECTIVE}
    code = ", ".join(f"code {s.exitcode or 0}" for s in early[:1])
    where = "; ".join(f"rank {rank} still waited in {text}" if text else f"rank {rank} still waited for it"
                      for rank, text in waits.items())
    lines = [f"mpddp: {_where(early[0])} exited ({code}) while {where or 'its peers still waited for it'}; "
             "every rank was stopped. Every rank must reach the same collectives: look for a return, "
             "break or sys.exit that only some ranks take."]
    lines += _tail_block(early[0])
    others = _others(states, verdict, early[0])
    if others:
        lines += ["mpddp: the other ranks:", *others]
    return WorkerFailed("\n".join(lines), early[0].slot.rank, _records(states, verdict, early), exit_code=1)


def hang_error(states: list[RankState], verdict: Verdict, hang: Hang) -> HangError:
    """No rank made progress for ``hang.seconds`` (core/launcher/watchdog.py): who (``verdict.hang``), where each rank
    stands in its collectives (the flight recorder, when there is one), and where every rank's stack was."""
    judged = verdict.hang
    assert judged is not None
    locations, finished, standings = hang.locations, hang.finished, hang.standings
    by_rank = {s.slot.rank: s for s in states}
    seconds = f"{hang.seconds:.0f} s"
    culprits, waiting, idle = list(judged.culprits), judged.waiting, judged.idle
    wait_text = next((p.text for r in waiting if (p := locations[r]) is not None), "a collective")
    if judged.case == "behind" and judged.standing is not None:
        lagging = judged.standing
        line = next((p.line for r in lagging.ahead if (p := locations.get(r)) is not None and p.waiting), "")
        first = (f"mpddp: {ranks_named(culprits)} made no progress for {seconds} while {ranks_named(lagging.ahead)} "
                 f"waited for it in {board.render(lagging.top)}{f' at {line}' if line else ''}; every rank was stopped")
    elif judged.case == "returned":
        first = (f"mpddp: {ranks_named(culprits)} exited (code 0) while {ranks_named(list(waiting))} still waited in "
                 f"{wait_text}; every rank was stopped after {seconds} with no progress")
    elif judged.case == "stalled" and judged.standing is not None:
        stalled = judged.standing
        first = (f"mpddp: no rank made progress for {seconds}: {ranks_named(stalled.ahead)} entered "
                 f"{board.render(stalled.top)} and it did not complete on {ranks_named(stalled.open)}, although no "
                 "rank is missing from it (a backend or network stall); every rank was stopped")
    elif judged.case == "idle":
        first = (f"mpddp: {ranks_named(list(idle))} made no progress for {seconds} while {ranks_named(list(waiting))} "
                 f"waited for it in {wait_text}; every rank was stopped")
    else:
        what = ("every rank waits in torch.distributed" if waiting
                else "no rank uses the CPU and none waits in a collective")
        first = f"mpddp: no rank made progress for {seconds}: {what}; every rank was stopped"
    lines = [first + ". The watchdog (--timeout) saw no progress: no collective entered or completed, no output, "
             "no CPU use outside a wait; raise --timeout if a rank legitimately waits this long (slow storage, "
             "a lock)."]
    if standings:
        lines.append("mpddp: the collectives each rank reached (torch's flight recorder):")
        lines += [f"  {row}" for row in board.standing_rows(list(standings), time.time_ns())]
    lines.append("mpddp: where each rank was:")
    lines += [f"  {row}" for row in stacks.grouped(locations, finished=finished)]
    if culprits[0] in by_rank:
        lines += _tail_block(by_rank[culprits[0]])
    ordered = [by_rank[r] for r in culprits if r in by_rank]
    return HangError("\n".join(lines), culprits[0], _records(states, verdict, ordered), exit_code=1)


def mismatch_error(states: list[RankState], verdict: Verdict, mismatch: Mismatch) -> CollectiveMismatch:
    """Ranks called different collectives at the same number (core/launcher/board.py): told as soon as it was seen."""
    odd = next((s for s in states if s.slot.rank == mismatch.odd), None)
    stopped = f"after {mismatch.after:.0f} s with no progress" if mismatch.after else "at once"
    lines = [f"mpddp: {board.mismatch_line(mismatch)}; every rank was stopped {stopped}. Every rank must call "
             "the same collectives in the same order, with the same shapes: look for a branch that only some ranks "
             "take (if rank == 0: ...) or inputs of different sizes on different ranks."]
    locations: dict[int, stacks.Location | None] = {s.slot.rank: s.location for s in states if s.location is not None}
    if locations:
        lines += ["mpddp: where each rank was:", *(f"  {row}" for row in stacks.grouped(locations))]
    if odd is not None:
        lines += _tail_block(odd)
    records = _records(states, verdict, [odd] if odd is not None else [])
    return CollectiveMismatch("\n".join(lines), mismatch.odd, records, exit_code=1)



def remote_error(record: FailureRecord, states: list[RankState], verdict: Verdict, node_rank: int) -> WorkerFailed:
    """This node's report when the round's first failure was told by another node (core/nodes/settle.py).

    It starts with the very line that node's report starts with, and exits with the failing rank's code;
    that node's report has the traceback and the last lines. A record that names a rank of this node was
    written by a node that saw it through the collectives the nodes share (it returned too early, or it hung
    while this node saw only its own ranks stop): here is where its last lines are.
    """
    ranks = [s.slot.rank for s in states]
    named = next((s for s in states if s.slot.rank == record.rank), None)
    if named is not None and is_lost_node(record):  # the others found this node lost: cut off or frozen, now
        # back. Its own side first (the line every node tells, second): a restart says the first line only
        lines = [f"mpddp: this node (node {node_rank}) was found lost by node {record.writer}: its launcher did not "
                 "beat for seconds (its machine frozen, or cut off from the others); the job went on without it, and "
                 f"its rank(s) {', '.join(map(str, ranks))} were stopped before another step", record.line]
    elif named is None:  # a lost node's report, if any, is on a machine that went
        rest = "" if is_lost_node(record) else \
            f" (node {record.node_rank}'s own report has the rest: traceback, last lines)"
        lines = [record.line, f"mpddp: node {node_rank} stopped its rank(s) {', '.join(map(str, ranks))} because "
                 f"of it{rest}"]
    else:
        lines = [record.line, f"mpddp: node {record.writer} saw it through the collectives the nodes share; "
                 f"rank {record.rank} is this node's, and the one to look at"]
        if named.location is not None:  # taken as it was stopped (watch.locate): only this node can show it
            lines += [f"mpddp: where rank {record.rank} was:", *(f"  {row}" for row in
                                                                 stacks.grouped({record.rank: named.location}))]
        lines += _tail_block(named)
    others = _others(states, verdict, named, record.rank)
    if others:
        lines += [f"mpddp: the {'other ' if named else ''}ranks on node {node_rank}:", *others]
    cause = RankFailure(rank=record.rank, node_rank=record.node_rank, local_rank=record.local_rank,
                        outcome=record.outcome, exit_code=record.exit_code, message=record.line)
    local = _records(states, verdict, [])
    kind = {Outcome.HUNG: HangError, Outcome.MISMATCH: CollectiveMismatch}.get(record.outcome, WorkerFailed)
    return kind("\n".join(lines), record.rank, [cause, *local], exit_code=record.exit_code)


def early_exit_line(states: list[RankState], verdict: Verdict, rank: int) -> str:
    """The first line of every node's report when ``rank``, on another node, returned while this node's ranks
    still waited for it (core/nodes/settle.py writes it into the round's record)."""
    nprocs = states[0].slot.nprocs_per_node
    waits = []
    for s in states:
        if verdict[s.slot.rank] is Outcome.COLLECTIVE and s.failure is not None and s.failure.where:
            waits.append(f"rank {s.slot.rank} still waited in {s.failure.where}")
        elif s.location is not None and s.location.waiting:
            waits.append(f"rank {s.slot.rank} still waited in {s.location.text}")
    return (f"mpddp: rank {rank} (node {rank // nprocs}, local rank {rank % nprocs}) exited (code 0) while "
            f"{'; '.join(waits) or 'the ranks of other nodes still waited for it'}; every rank was stopped. Every "
            "rank must reach the same collectives: look for a return, break or sys.exit that only some ranks take.")

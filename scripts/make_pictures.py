"""Make the manual's pictures again: ``python scripts/make_pictures.py`` writes them into docs/_static/.

Each picture comes from mpddp itself, never drawn by hand:

- ``ranks.png``: two nodes of four GPUs, every worker's local rank and global
  rank, from :func:`mpddp.rank_math.layout` (the same table ``mpddp ranks`` prints);
- ``stragglers.png``: the ``--timeline`` picture of a real 2-rank ``mpddp run``
  whose rank 1 turns slow on purpose at step 150 (it sleeps 30 ms more than
  rank 0 before each all_reduce from there on);
- ``curves.png``: the curves of a real ``mpddp train`` run on the digits, where
  this mpddp draws them (``mpddp.trainer.curves``); otherwise it is skipped
  with a line saying so;
- ``states.png``: a node's life in a round, every arrow a move that
  :func:`mpddp.core.nodes.rules.move` allows, labelled with the counters it
  enters the node in (asked of the function itself, state by state).
- ``dashboard.png``: the ``--dashboard`` page of a real 2-rank ``mpddp run``
  whose rank 1 is slow, once the launcher names it, taken by headless chromium
  (skipped with a line where there is none), and beside it ``top.txt``, what
  ``mpddp top --once`` prints of the same job at the same moment.

The runs take a temporary directory and this checkout's mpddp. The docs build
(``python -m sphinx ...``) only shows the PNGs committed here: it runs nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpddp.rank_math import layout  # noqa: E402

OUT = ROOT / "docs" / "_static"
PICTURES = ("ranks", "stragglers", "curves", "states", "dashboard")

# A torchrun-style script: steps of 10 ms on every rank, and from step 150 on rank 1 reaches every
# all_reduce 30 ms after rank 0.
SLOW_RANK = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(300):
    time.sleep(0.01)  # the step's work, the same on every rank
    if dist.get_rank() == 1 and step >= 150:
        time.sleep(0.03)  # from step 150 on, rank 1 reads its data from a slow disk
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def draw_ranks(path: Path, nnodes: int = 2, nprocs: int = 4, highlight: tuple[int, int] = (1, 2)) -> None:
    """Each node a box, each GPU a cell with its local rank and its global rank; one rank's formula worked out."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    slots = layout(nnodes, nprocs, list(range(nprocs)))
    cell, height, gap, pad, between = 1.5, 1.8, 0.15, 0.25, 0.8
    node_w = nprocs * cell + (nprocs - 1) * gap + 2 * pad
    width = nnodes * node_w + (nnodes - 1) * between
    fig, ax = plt.subplots(figsize=(width * 0.78, 4.0), dpi=110)
    for node in range(nnodes):
        x0 = node * (node_w + between)
        ax.add_patch(FancyBboxPatch((x0, 0), node_w, height + 2 * pad, boxstyle="round,pad=0.02",
                                    facecolor="#f3f3f3", edgecolor="#555555"))
        ax.text(x0 + node_w / 2, height + 2 * pad + 0.2, f"node {node} (node_rank {node})", ha="center",
                fontsize=12, weight="bold")
        for slot in (s for s in slots if s.node_rank == node):
            x = x0 + pad + slot.local_rank * (cell + gap)
            marked = (slot.node_rank, slot.local_rank) == highlight
            ax.add_patch(Rectangle((x, pad), cell, height, facecolor="#ffd27f" if marked else "#cfe2f3",
                                   edgecolor="#c47f00" if marked else "#3d6fa5", linewidth=2 if marked else 1))
            ax.text(x + cell / 2, pad + 1.4, f"GPU {slot.gpu}", ha="center", fontsize=10)
            ax.text(x + cell / 2, pad + 0.95, f"local rank {slot.local_rank}", ha="center", fontsize=10)
            ax.text(x + cell / 2, pad + 0.35, f"rank {slot.rank}", ha="center", fontsize=13, weight="bold")
    node, local = highlight
    rank = next(s for s in slots if (s.node_rank, s.local_rank) == highlight)
    ax.text(width / 2, -0.45, "rank = node_rank × nprocs_per_node + local_rank", ha="center", fontsize=12)
    ax.text(width / 2, -0.95, f"GPU {rank.gpu} of node {node}: {node} × {nprocs} + {local} = {rank.rank}     "
            f"world_size = nnodes × nprocs_per_node = {nnodes} × {nprocs} = {rank.world_size}", ha="center",
            fontsize=11, color="#8a5a00")
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-1.2, height + 2 * pad + 0.6)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_states(path: Path) -> None:
    """A node's states in a round and the moves between them, as core/nodes/rules.py's ``move`` allows them."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from mpddp.core.nodes.rules import NodeState, move

    where = {NodeState.RUNNING: (0.0, 1.5), NodeState.WAITING: (4.0, 3.0), NodeState.RETURNED: (4.0, 0.0),
             NodeState.ENDED: (8.0, 3.0), NodeState.LOST: (8.0, 0.0)}
    said = {NodeState.RUNNING: "joined: its ranks run", NodeState.WAITING: "its ranks stopped:\nwaits for the record",
            NodeState.RETURNED: "its ranks all returned:\nwaits for the others", NodeState.ENDED: "done with the round",
            NodeState.LOST: "lease ran out (etcd), or its beat\nstood still (c10d): another's word"}
    fig, ax = plt.subplots(figsize=(10, 4.6))
    for a in NodeState:
        for b in NodeState:
            if (counters := move(a, b)) is None:
                continue
            (x0, y0), (x1, y1) = where[a], where[b]
            ax.annotate("", xy=(x1 - 1.0, y1), xytext=(x0 + 1.0, y0),
                        arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 1.2, "shrinkA": 2, "shrinkB": 2})
            t = 0.22 if abs(y1 - y0) > 2 else 0.5  # long diagonals: near their start, where they do not cross
            lx, ly = x0 + 1.0 + t * (x1 - x0 - 2.0), y0 + t * (y1 - y0)
            ax.text(lx, ly + 0.12, "+" + ", ".join(counters), fontsize=7.5, color="#205080", ha="center",
                    bbox={"fc": "white", "ec": "none", "pad": 0.5})
    for state, (x, y) in where.items():
        ax.add_patch(plt.Rectangle((x - 1.0, y - 0.45), 2.0, 0.9, fc="#f3f3f3", ec="#333333", lw=1.2))
        ax.text(x, y + 0.2, state.name, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x, y - 0.12, said[state], ha="center", va="center", fontsize=7, color="#444444")
    ax.set_xlim(-1.1, 9.1)
    ax.set_ylim(-0.6, 3.6)
    ax.axis("off")
    ax.set_title("A node's record in a round: one compare-and-set a move, then the counters it newly enters "
                 "(each node once)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _env() -> dict[str, str]:
    """This checkout's mpddp for the runs; a job's SLURM variables would make them a multi-node launch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run(argv: list[str], cwd: str) -> None:
    print("$ " + " ".join(argv[1:] if argv[0] == sys.executable else argv), flush=True)
    done = subprocess.run(argv, cwd=cwd, env=_env(), timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"make_pictures: {' '.join(argv)} exited with {done.returncode}")


# A job to watch: steps of 50 ms, rank 1 30 ms late to each all_reduce, until a file STOP appears (every rank sees
# it at the same step: the flag is reduced)
WATCHED = """\
import os
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
step = 0
while True:
    stop = torch.tensor([float(os.path.exists("STOP"))])
    dist.all_reduce(stop)
    if stop.item() or step == 6000:
        break
    step += 1
    time.sleep(0.05 + (0.03 if dist.get_rank() == 1 else 0.0))  # rank 1 reads its data from a slow disk
    if step % 10 == 0:
        print(f"step {step}  loss {1 / (1 + step / 400):.3f}", flush=True)
dist.destroy_process_group()
"""


def draw_dashboard(path: Path) -> bool:
    """The --dashboard page of a real job once its straggler is named, and ``mpddp top --once`` of it beside it
    (top.txt); False without chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("make_pictures: skipping dashboard.png: no chromium here (apt-get install chromium)", flush=True)
        return False
    with tempfile.TemporaryDirectory(prefix="mpddp-pictures-") as tmp:
        Path(tmp, "watched.py").write_text(WATCHED)
        xdg = Path(tmp, "xdg")
        xdg.mkdir(mode=0o700)  # mpddp top finds this job alone
        env = {**_env(), "XDG_RUNTIME_DIR": str(xdg)}
        argv = [sys.executable, "-m", "mpddp", "run", "--nprocs", "2", "--dashboard", "auto", "watched.py"]
        print("$ " + " ".join(argv[1:]), flush=True)
        with Path(tmp, "launcher.err").open("w") as err:
            job = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            url = _named(Path(tmp, "launcher.err"), job)
            sandbox = ["--no-sandbox"] if os.getuid() == 0 else []  # chromium's sandbox refuses root
            subprocess.run([chromium, "--headless", "--disable-gpu", *sandbox, f"--user-data-dir={tmp}/chromium",
                            "--window-size=1100,700", "--hide-scrollbars", "--virtual-time-budget=2000",
                            f"--screenshot={path}", url], capture_output=True, timeout=120, check=True)
            top = subprocess.run([sys.executable, "-m", "mpddp", "top", "--once"], env=env, capture_output=True,
                                 text=True, timeout=60, check=True)
            path.with_name("top.txt").write_text("$ mpddp top --once\n" + top.stdout)
        finally:
            Path(tmp, "STOP").write_text("")
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait(10)
    return True


def _named(err: Path, job: subprocess.Popen, timeout: float = 180, age: float = 75) -> str:
    """The page's URL, once the launcher names the straggler, has every rank's rates, and the job has run ``age``
    seconds (the page's timeline then spans more than a minute)."""
    deadline, url = time.monotonic() + timeout, None
    while time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.5)
        said = [line for line in err.read_text().splitlines() if "the dashboard of this job: " in line]
        url = url or (said[0].rsplit(" ", 1)[1] if said else None)
        if url is None:
            continue
        with urllib.request.urlopen(url + "snapshot.json", timeout=10) as answer:
            seen = json.loads(answer.read())
        ranks = seen["ranks"]
        if (any(r["straggler"] for r in ranks) and all(r["per_second"] is not None for r in ranks)
                and seen["header"]["elapsed"] >= age):
            return url
    raise SystemExit(f"make_pictures: the job named no straggler within {timeout:g} s:\n{err.read_text()}")


def draw_stragglers(path: Path) -> None:
    """A real 2-rank run whose rank 1 turns slow, drawn by mpddp's own ``--timeline``."""
    with tempfile.TemporaryDirectory(prefix="mpddp-pictures-") as tmp:
        Path(tmp, "slow.py").write_text(SLOW_RANK)
        _run([sys.executable, "-m", "mpddp", "run", "--nprocs", "2", "--timeline", "timeline.png", "slow.py"], tmp)
        shutil.copyfile(Path(tmp, "timeline.png"), path)


def draw_curves(path: Path) -> bool:
    """The curves of a real digits run, drawn by ``mpddp train`` itself; False where this mpddp cannot."""
    if importlib.util.find_spec("mpddp.trainer.curves") is None:
        print("make_pictures: skipping curves.png: this mpddp has no mpddp.trainer.curves (mpddp train draws "
              "no curves yet)", flush=True)
        return False
    with tempfile.TemporaryDirectory(prefix="mpddp-pictures-") as tmp:
        _run([sys.executable, "-m", "mpddp", "train", "--nprocs", "2", "--epochs", "10", "--run-dir", "run"], tmp)
        shutil.copyfile(Path(tmp, "run", "curves.png"), path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PICTURES), help=f"comma-separated, of {', '.join(PICTURES)}")
    parser.add_argument("--out", type=Path, default=OUT, help="where the PNGs go [default: docs/_static]")
    args = parser.parse_args(argv)
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(PICTURES))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: the pictures are {', '.join(PICTURES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    drawers = {"ranks": lambda p: draw_ranks(p) or True, "stragglers": lambda p: draw_stragglers(p) or True,
               "curves": draw_curves, "states": lambda p: draw_states(p) or True, "dashboard": draw_dashboard}
    for name in wanted:
        target = args.out / f"{name}.png"
        if drawers[name](target):
            print(f"make_pictures: wrote {target}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CLI skeleton: help, version, `mpddp ranks`, one-line errors."""

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

import mpddp
from mpddp.cli import main


def test_help_lists_commands_and_launch_options():
    out = CliRunner().invoke(main, ["--help"])
    assert out.exit_code == 0
    for command in ("ranks", "run", "train", "info"):
        assert command in out.output
    run_help = CliRunner().invoke(main, ["run", "--help"]).output
    for option in ("--nprocs", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--backend",
                   "--start-method", "--gpus", "--timeout", "--max-restarts", "--output-ranks", "--log-dir"):
        assert option in run_help


def test_version():
    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"mpddp, version {mpddp.__version__}"


def test_ranks_shows_the_formula_filled_in():
    out = CliRunner().invoke(main, ["ranks", "--nnodes", "2", "--nprocs", "4", "--gpus", "0,1,2,5"], env={})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "world_size = nnodes × nprocs_per_node = 2 × 4 = 8"
    row6 = [line for line in lines if "1×4+2 = 6" in line]
    assert len(row6) == 1
    assert row6[0].split() == ["1", "2", "1×4+2", "=", "6", "cuda:2", "2"]
    assert any("1×4+3 = 7" in line and line.rstrip().endswith("5") for line in lines)
    assert "local_rank is not rank" in out.output


def test_ranks_as_a_real_subprocess():
    out = subprocess.run([sys.executable, "-m", "mpddp", "ranks", "--nnodes", "2", "--nprocs", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    row = [line for line in out.stdout.splitlines() if "= 6" in line][0]
    assert row.split()[:2] == ["1", "2"] and "cpu" in row


@pytest.mark.parametrize("args,message", [
    (["ranks", "--nprocs", "0"], "mpddp: error: nprocs=0 is out of range: it must be an integer >= 1"),
    (["ranks", "--nprocs", "abc"],
     "mpddp: error: Invalid value for '--nprocs' / '--nproc-per-node' / '--nproc_per_node': nprocs='abc' is not a "
     "number of workers: pass an integer such as 2, or gpu or auto"),
    (["ranks", "--nnodes", "2:x"], "mpddp: error: Invalid value for '--nnodes': nnodes='2:x' is not a number of "
                                   "machines: pass an integer such as 2, or MIN:MAX such as 2:4"),
    (["ranks", "--nnodes", "3:2"], "mpddp: error: nnodes=3:2: the smallest size must be from 1 to the largest; "
                                   "pass e.g. --nnodes 2:3"),
    (["ranks", "--gpus", "0,0"], "mpddp: error: gpus=0,0 names GPU 0 twice"),
    (["nosuch"], "mpddp: error: No such command 'nosuch'."),
])
def test_bad_input_is_one_line_exit_2(args, message):
    out = subprocess.run([sys.executable, "-m", "mpddp", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(message)
    assert "Traceback" not in out.stderr


def _examples(help_text: str) -> dict[str, list[str]]:
    """``mpddp --help``'s example lines, by command: the words of each command line (before its comment)."""
    found: dict[str, list[str]] = {}
    for line in help_text.splitlines():
        if (m := re.match(r"^ +mpddp (\w+)((?: \S+)*) {2,}\S", line)) is not None:
            found[m.group(1)] = m.group(2).split()
    return found


def test_top_level_help_shows_an_example_of_each_first_command(cli):
    code, out, _ = cli("--help")
    assert code == 0
    examples = _examples(out)
    assert {"train", "run", "ranks", "top"} <= examples.keys(), out
    assert "train.py" in examples["run"]  # a script of the user's, under torchrun's flags
    for name in ("train", "run", "ranks", "top"):  # each one parses as written: no stale flag in the help
        main.commands[name].make_context(name, list(examples[name]))
    assert all(len(line) < 80 for line in out.splitlines() if line.lstrip().startswith("mpddp ")), out


NPROCS_FORMS = {"N": "2", "gpu": "gpu", "cpu": "cpu", "auto": "auto"}
NNODES_FORMS = {"N": "2", "MIN:MAX": "2:3"}


@pytest.mark.parametrize("command", ["run", "train", "ranks"])
def test_nprocs_and_nnodes_show_the_forms_they_take(cli, command):
    """Help shows each form the option takes, not INTEGER, and each form shown is taken."""
    code, out, _ = cli(command, "--help")
    assert code == 0
    params = {p.name: p for p in main.commands[command].params}
    ctx = main.commands[command].make_context(command, [], resilient_parsing=True)
    for name, forms in (("nprocs", NPROCS_FORMS), ("nnodes", NNODES_FORMS)):
        shown = params[name].get_help_record(ctx)[0]  # what help prints left of the text: "--nnodes N|MIN:MAX"
        assert shown in out and "INTEGER" not in shown
        assert shown.rsplit(" ", 1)[1].split("|") == list(forms)
        for form in forms.values():
            params[name].type_cast_value(ctx, form)  # raises on a form the option does not take


def test_ranks_of_an_elastic_size_shows_max_and_says_a_smaller_round_renumbers(cli):
    code, out, err = cli("ranks", "--nnodes", "2:3", "--nprocs", "2")
    assert (code, err) == (0, "")
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +\d+ +\d+×", line)]
    assert [(int(r[0]), int(r[1]), int(r[4])) for r in rows] == [
        (n, lr, n * 2 + lr) for n in range(3) for lr in range(2)]
    assert out.startswith(cli("ranks", "--nnodes", "3", "--nprocs", "2")[1])  # the table is MAX's
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == ["note: nnodes=2:3 is elastic: the table is for 3 nodes. A round with fewer (down to 2) numbers "
                     "its nodes 0, 1, ... anew, and every rank follows the same formula: with 2 nodes, ranks 0 to 3."]


@pytest.mark.parametrize("argv, note", [
    (["--nprocs", "2", "--gpus", "0"], "note: local ranks 0 and 1 share GPU 0: NCCL refuses two ranks on one GPU. "
                                       "Pass --nprocs 1, list 2 GPUs in --gpus, or share GPUs with --backend gloo."),
    (["--nprocs", "3", "--gpus", "4,7", "--nnodes", "2"],
     "note: local ranks 0 and 2 share GPU 4 on every node: NCCL refuses two ranks on one GPU. Pass --nprocs 2, "
     "list 3 GPUs in --gpus, or share GPUs with --backend gloo."),
    (["--nprocs", "2", "--gpus", "0,1"], None),
    (["--nprocs", "2"], None),
])
def test_ranks_notes_local_ranks_that_share_a_gpu(cli, argv, note):
    code, out, _ = cli("ranks", *argv)
    assert code == 0
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +\d+ +\d+×", line)]
    devices = [(row[0], row[5]) for row in rows if row[5] != "cpu"]  # the table's own devices, by node
    shared = len(devices) != len(set(devices))
    assert [line for line in out.splitlines() if line.startswith("note:")] == ([note] if note else [])
    assert shared == (note is not None)


OPTIONS = [["--nprocs", "--nproc-per-node", "--nproc_per_node"], ["--nnodes"], ["--node-rank", "--node_rank"],
           ["--num-workers"], ["--epochs"], ["--checkpoint-dir"], ["--checkpoint-every"], ["--batch-size"],
           ["--seed"], ["-h", "--help"]]


@pytest.mark.parametrize("typed, meant", [
    ("--nproc", ("--nprocs",)),  # begun: not --epochs, which only shares letters (click named it first)
    ("--nproc-per", ("--nproc-per-node",)),  # the spelling it begins, as written
    ("--nproc_per", ("--nproc_per_node",)),
    ("--epoch", ("--epochs",)),
    ("--check", ("--checkpoint-dir", "--checkpoint-every")),  # two options begun: both
    ("--n", ()),  # four options begun: too little to name one
    ("--batch_size", ("--batch-size",)),  # the same option in another spelling
    ("--seeds", ("--seed",)),  # an option's name and more
    ("--nprocs-per-node", ("--nprocs",)),
    ("--nprcs", ("--nprocs",)),  # a letter off
    ("--nnode", ("--nnodes",)),
    ("--pochs", ("--epochs",)),
    ("--bogus-option", ()),
    ("--nodes-rank", ("--node-rank",)),
    ("-x", ()),  # a short option: nothing to go on
])
def test_the_option_suggested_is_the_one_begun_or_a_letter_off(typed, meant):
    from mpddp.cli.usage import closest

    assert closest(typed, OPTIONS) == meant


@pytest.mark.parametrize("command", ["train", "run", "ranks"])
def test_an_unknown_option_is_one_line_in_the_same_words_under_every_command(cli, command):
    script = ["x.py"] if command == "run" else []
    assert cli(command, "--nproc", "2", *script) == (
        2, "", f"mpddp: error: mpddp {command} has no option --nproc: did you mean --nprocs? "
               f"See `mpddp {command} --help`.\n")
    assert cli(command, "--bogus-option", "2", *script) == (
        2, "", f"mpddp: error: mpddp {command} has no option --bogus-option: see `mpddp {command} --help` for its "
               "options.\n")


def test_a_commands_option_before_the_command_is_told_where_it_goes(cli):
    assert cli("--nprocs", "2", "train") == (
        2, "", "mpddp: error: mpddp has no option --nprocs, but train, run, ranks and info have it: it goes after "
               "the command, as in `mpddp train --nprocs ...`.\n")

"""The Task contract, the built-in tasks and loading users' tasks (no processes started)."""

import sys
import textwrap

import pytest
import torch
from tiny_task import TINY

from mpddp.errors import ConfigError
from mpddp.trainer.config import task_name
from mpddp.trainer.tasks import (
    DigitsCNN,
    Task,
    build_task,
    build_task_before_launch,
    digits_task,
    load_factory,
    synthetic_task,
)


def test_digits_loads_from_scikit_learn_with_a_split_fixed_by_the_seed():
    a, b, c = digits_task(seed=0), digits_task(seed=0), digits_task(seed=1)
    assert (len(a.train_set), len(a.test_set)) == (1438, 359)  # 1,797 digits, 20% of each class held out
    x, y = a.train_set[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert y.dtype == torch.int64
    assert torch.equal(a.test_set.tensors[0], b.test_set.tensors[0])
    assert not torch.equal(a.test_set.tensors[0], c.test_set.tensors[0])
    assert sorted(set(a.test_set.tensors[1].tolist())) == list(range(10))  # stratified: every class tested
    assert DigitsCNN()(x.unsqueeze(0)).shape == (1, 10)


def test_digits_are_scikit_learns_own():
    from sklearn.datasets import load_digits

    from mpddp.trainer.tasks import load_digits_arrays

    images, labels = load_digits_arrays()
    reference = load_digits()
    assert torch.equal(images.squeeze(1), torch.tensor(reference.images / 16.0, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(reference.target))


def test_synthetic_is_deterministic_and_sized_by_its_options():
    a, b = synthetic_task(seed=3, samples=100, features=7), synthetic_task(seed=3, samples=100, features=7)
    assert (len(a.train_set), len(a.test_set)) == (80, 20)
    assert a.train_set[0][0].shape == (7,)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.train_set.tensors[1], b.train_set.tensors[1])
    assert len(set(a.train_set.tensors[1].tolist())) > 1


def test_a_task_file_with_the_default_and_a_named_factory():
    assert isinstance(build_task(TINY, seed=0), Task)
    task = build_task(TINY + ":make_dropout_task", seed=0)
    assert isinstance(task.model[1], torch.nn.Dropout)
    assert task_name(TINY + ":make_task") == "tiny_task"


def test_a_task_from_an_importable_module(tmp_path, monkeypatch):
    pkg = tmp_path / "mytasks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "problem.py").write_text(textwrap.dedent("""
        from tiny_task import make_task as build
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(build_task("mytasks.problem:build", seed=0), Task)
    assert task_name("mytasks.problem:build") == "problem"
    sys.modules.pop("mytasks.problem", None)
    sys.modules.pop("mytasks", None)


def test_a_factory_function_passed_directly():
    from tiny_task import make_task

    assert isinstance(build_task(make_task, seed=0), Task)
    assert task_name(make_task) == "make_task"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuch.py", "task='nosuch.py': the file .*nosuch.py does not exist; check the path"),
        ("digitz", "task='digitz' is unknown: use digits, synthetic, package.module:factory or path/to/file.py"),
        ("nosuchpkg.mod:make", "task='nosuchpkg.mod:make': cannot import module 'nosuchpkg.mod' .*PYTHONPATH"),
        (TINY + ":nothing", "has no function 'nothing'; define `def nothing\\(seed: int\\) -> mpddp.Task`"),
    ],
)
def test_a_task_that_cannot_be_found_is_one_line(spec, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_factory(spec)
    assert "\n" not in str(e.value)


def test_a_factory_that_returns_the_wrong_thing(tmp_path):
    with pytest.raises(ConfigError, match="the factory returned dict, not mpddp.Task; return Task"):
        build_task(TINY + ":make_wrong", seed=0)
    bad = tmp_path / "bad_task.py"
    bad.write_text(textwrap.dedent("""
        import torch
        from mpddp import Task
        def make_task(seed):
            return Task(model="not a module", train_set=[1], test_set=[1], loss_fn=torch.nn.MSELoss())
    """))
    with pytest.raises(ConfigError, match="the factory's Task is wrong: model must be a torch.nn.Module"):
        build_task(str(bad), seed=0)


def test_a_task_file_that_does_not_load_is_one_line_naming_the_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as outside this environment: a loader would write .pyc
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\ndef make_task(seed:\n")
    raises = tmp_path / "raises.py"
    raises.write_text("x = 1\nraise ValueError('no data here')\n")
    cases = [
        (broken, f"task='{broken}': loading {broken} raised SyntaxError: '(' was never closed ({broken}, line 3); "
                 f"fix the file (`python {broken}` shows the whole traceback)"),
        (raises, f"task='{raises}': loading {raises} raised ValueError: no data here ({raises}, line 2); fix the file"),
    ]
    for path, message in cases:
        with pytest.raises(ConfigError) as e:
            load_factory(str(path))
        assert str(e.value).startswith(message), str(e.value)
        assert "\n" not in str(e.value) and "mpddp_task_" + path.stem not in sys.modules
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.py", "raises.py"]  # no __pycache__


def test_a_module_that_raises_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "badmod.py").write_text("import os\nos.environ['MPDDP_NO_SUCH_VARIABLE']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        load_factory("badmod:make_task")
    sys.modules.pop("badmod", None)
    assert str(e.value).startswith("task='badmod:make_task': importing badmod raised KeyError: "
                                   "'MPDDP_NO_SUCH_VARIABLE' (")
    assert ", line " in str(e.value) and "\n" not in str(e.value)


def test_a_callable_that_is_not_a_task_factory_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_task("os:getcwd", seed=0)
    assert str(e.value) == (
        "task='os:getcwd': getcwd is not a task factory: getcwd(seed=0) fails (posix.getcwd() takes "
        "no keyword arguments); point --task at a function `def make_task(seed: int) -> "
        "mpddp.Task`")

    def no_seed() -> Task:
        raise AssertionError("never called")

    with pytest.raises(ConfigError, match="task='no_seed': no_seed is not a task factory: no_seed\\(seed=0\\) fails"):
        build_task(no_seed, seed=0)
    with pytest.raises(ConfigError, match="task='builtins:dict': the factory returned dict, not mpddp.Task"):
        build_task("builtins:dict", seed=0)  # takes seed=, returns something else


def test_a_factory_that_raises_is_one_line_before_launch_and_its_own_error_on_a_rank(tmp_path):
    task = tmp_path / "raising.py"
    task.write_text("def make_task(seed):\n    return {}['train_set']\n")
    with pytest.raises(ConfigError) as e:
        build_task_before_launch(str(task), seed=0)
    assert str(e.value) == (f"task='{task}': the factory raised KeyError: 'train_set' ({task}, line 2); fix it "
                            "(it is called once here, before any worker starts)")
    with pytest.raises(KeyError):  # on a rank the user's own exception, with its traceback
        build_task(str(task), seed=0)

    def wrong_type(seed):
        raise TypeError("a TypeError of the factory's own")

    with pytest.raises(ConfigError, match="task='wrong_type': the factory raised TypeError: a TypeError of the "):
        build_task_before_launch(wrong_type, seed=0)

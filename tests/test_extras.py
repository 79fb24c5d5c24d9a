"""The optional features outside the base install: without the `serve` extra (uvicorn, starlette,
h11) every module but the servers imports, and `lit-interventions serve` / `serve-judge` fail with
one `error:` line naming the extra; pyproject's extra, the check and the servers' imports agree.

A package is made missing in a subprocess by a `sys.modules` entry set to None, which makes its
import fail as an uninstalled one does."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from lit_interventions.core.extras import MissingExtra, install_line, require

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "lit_interventions" / "serving"
SERVE_LINE = 'pip install "lit-interventions[serve]" (in a clone: pip install -e ".[serve]")'


def _run(code: str, hidden: list[str]) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter in which each of `hidden` does not import."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hidden)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT, timeout=600)


def _serve_extra() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["optional-dependencies"]["serve"]]


def _required_by_serving() -> tuple[str, ...]:
    """The module names `lit_interventions/serving/__init__.py` passes to `extras.require`."""
    tree = ast.parse((SERVING / "__init__.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "require"]
    extra, _, modules = (ast.literal_eval(argument) for argument in call.args)
    assert extra == "serve"
    return modules


def _third_party_imports(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports that are neither the standard library's
    nor this project's."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name != "lit_interventions"}


@pytest.mark.parametrize(
    ("command", "hidden", "line"),
    [
        (
            ["serve", "--artifact", "checkpoints/axbench/builtin-diffmean"],
            ["uvicorn"],
            f"error: uvicorn is not installed, and lit-interventions serve / serve-judge cannot run without it: {SERVE_LINE}",
        ),
        (
            ["serve-judge", "--lm", "smollm2-135m-instruct"],
            ["uvicorn", "starlette"],
            "error: uvicorn and starlette are not installed, and lit-interventions serve / serve-judge cannot run "
            f"without them: {SERVE_LINE}",
        ),
    ],
)
def test_a_server_without_the_serve_extra_is_one_error_line_naming_it(command, hidden, line):
    result = _run(f"from lit_interventions.cli.commands import main\nmain({command!r})", hidden)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [line]
    assert result.stdout == ""


def test_importing_a_server_without_the_extra_raises_the_import_error_naming_it():
    code = (
        "from lit_interventions.core.extras import MissingExtra\n"
        "try:\n"
        "    import lit_interventions.serving.steered_server\n"
        "except MissingExtra as error:\n"
        "    print(isinstance(error, ImportError), error.extra, error.missing)\n"
    )
    result = _run(code, ["starlette"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True serve ('starlette',)"]


def _project_modules() -> list[str]:
    """The dotted names of every module the package installs (`datamodules/` as
    `lit_interventions.datamodules`, pyproject's package-dir), its data folders left out."""
    names = []
    for prefix, folder in (
        ("lit_interventions", ROOT / "lit_interventions"),
        ("lit_interventions.datamodules", ROOT / "datamodules"),
    ):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "data" not in parts[:-1]:
                names.append(".".join([prefix, *parts]).removesuffix(".__init__"))
    return names


def test_every_module_but_the_servers_imports_without_the_serve_extra():
    """What the base install has: uvicorn and starlette absent (h11 stays, a dependency of the
    hub client's HTTP library). Every other module of the package, every other command's entry
    point and train.py import."""
    others = [name for name in _project_modules() if not name.startswith("lit_interventions.serving")]
    code = (
        "import importlib\n"
        "from lit_interventions.cli.commands import COMMANDS, resolve\n"
        f"for name in {others!r}:\n"
        "    importlib.import_module(name)\n"
        "targets = {t for t, _ in COMMANDS.values() if not t.startswith('lit_interventions.serving.')}\n"
        "for target in sorted(targets):\n"
        "    resolve(target)\n"
        "import train\n"
        "print(len(targets), len(set(t for t, _ in COMMANDS.values())))\n"
    )
    result = _run(code, ["uvicorn", "starlette"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(others) > 130 and any(".datamodules." in name for name in others)
    resolved, targets = map(int, result.stdout.split())
    assert resolved == targets - 2  # every command but serve and serve-judge


def test_the_serve_extra_the_check_and_the_servers_imports_name_the_same_packages():
    """pyproject's `serve` extra is what `serving/__init__.py` checks, is in the `test` extra with
    the same bounds (the README's test command runs the server tests), is not in the base
    dependencies, and is every third-party package that only the servers import."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serve = {r.name: str(r.specifier) for r in _serve_extra()}
    assert set(serve) == set(_required_by_serving()) == {"uvicorn", "starlette", "h11"}
    test = {r.name: str(r.specifier) for r in map(Requirement, pyproject["optional-dependencies"]["test"])}
    assert {name: test.get(name) for name in serve} == serve
    assert not set(serve) & {Requirement(text).name for text in pyproject["dependencies"]}
    inside = set().union(*(_third_party_imports(path) for path in SERVING.glob("*.py")))
    outside = set().union(
        *(
            _third_party_imports(path)
            for folder in (ROOT / "lit_interventions", ROOT / "datamodules")
            for path in folder.rglob("*.py")
            if SERVING not in path.parents
        ),
        _third_party_imports(ROOT / "train.py"),
    )
    assert inside - outside == set(serve)


def test_require_names_every_missing_module_and_passes_present_ones():
    require("serve", "x", ("json", "math"))  # present: no error
    with pytest.raises(MissingExtra) as raised:
        require("serve", "the thing", ("json", "no_such_module_a", "math", "no_such_module_b"))
    assert raised.value.missing == ("no_such_module_a", "no_such_module_b")
    assert str(raised.value) == (
        "no_such_module_a and no_such_module_b are not installed, and the thing cannot run without them: "
        + install_line("serve")
    )
    assert install_line("quant") == 'pip install "lit-interventions[quant]" (in a clone: pip install -e ".[quant]")'

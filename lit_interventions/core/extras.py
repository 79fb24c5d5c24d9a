"""Optional features and the extras of pyproject.toml that install them.

A feature whose packages are not in the base install checks them where it starts, before any of
its modules imports them: `require("serve", "lit-interventions serve / serve-judge", ("uvicorn", ...))`
raises `MissingExtra`, an ImportError whose message is one line naming the extra to install. The
`lit-interventions` command prints that line as its `error:` line (exit code 2).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

__all__ = ["MissingExtra", "install_line", "require"]


def install_line(extra: str) -> str:
    """The command that installs `extra`: from the package index, or in a clone of the repository."""
    return f'pip install "lit-interventions[{extra}]" (in a clone: pip install -e ".[{extra}]")'


class MissingExtra(ImportError):
    """A feature's optional packages are not installed; the message is one line naming them and
    the extra that installs them."""

    def __init__(self, extra: str, feature: str, missing: Sequence[str]):
        self.extra, self.missing = extra, tuple(missing)
        packages = " and ".join(self.missing)
        verb, them = ("is", "it") if len(self.missing) == 1 else ("are", "them")
        super().__init__(
            f"{packages} {verb} not installed, and {feature} cannot run without {them}: {install_line(extra)}"
        )


def require(extra: str, feature: str, modules: Sequence[str]) -> None:
    """Import each of `modules` (third-party packages of the `extra`); raise `MissingExtra`
    naming every one that does not import."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingExtra(extra, feature, missing)

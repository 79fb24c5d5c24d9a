"""A resumable output directory that loses nothing and says so when something is damaged.

- `DIR/.lock`: an exclusive `flock` held for the whole run, with the holder's pid in it: a second
  run on the same directory is refused at once instead of doubling the work.
- `DIR/meta.json`: the configuration the directory belongs to, written (atomically) only after
  the lock is held and the configuration matches; callers validate their inputs first, so a
  rejected run leaves nothing behind.
- `DIR/results.sqlite`: the finished units (SQLite in WAL mode, one transaction per unit): a crash
  at any byte loses at most the unit being written. A file there that is not such a database
  (random bytes, text, another program's tables) is refused with one line naming it, before
  meta.json is written (`check_database`).
- `DIR/<table>.csv`: exported from the database after each unit (`core.files.write_atomically`),
  so it is always whole. A CSV from before the database is imported once: its complete rows are
  kept, each damaged line is reported (file and line number) and its unit recomputed.
- `DIR/ranks/rank-R/`: under torchrun or srun, rank R's own store (the same files); rank 0 merges
  them into DIR's (`ResultsStore.absorb`) at the start of a run (what an interrupted run left) and
  at its end, then removes them.

Each database has one process (the run that holds DIR/.lock, or the rank that owns it): SQLite's
exclusive locking mode, which keeps WAL mode working on a network filesystem (no shared memory).
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import shutil
import sqlite3
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lit_interventions.core.files import write_atomically
from lit_interventions.core.signals import deferred

DB_NAME = "results.sqlite"
LOCK_NAME = ".lock"
RANKS_DIR = "ranks"


class OutDirBusy(ValueError):
    """Another process holds the output directory."""


@dataclass(frozen=True)
class Table:
    """One kind of row: written to DIR/<name>.csv with `columns`; a row replaces the row with the
    same `key`. `numeric` columns must parse as numbers, `optional` ones may be empty; a table
    with `export=False` is kept in the database only (bookkeeping, e.g. which units finished)."""

    name: str
    columns: tuple[str, ...]
    key: tuple[str, ...]
    numeric: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    export: bool = True


# --- the lock ---


class OutDirLock:
    """An exclusive, non-blocking `flock` on DIR/.lock; the file holds the holder's pid."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> OutDirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutDirBusy(
                f"{self.path.parent} is in use by another run (pid {holder}); wait for it to end or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# --- meta.json ---


def claim_out_dir(out: Path, meta: dict, what: str = "results", ignore: tuple = ()) -> None:
    """Make `out` hold the results of this configuration only: a directory written by another
    (a different model, data file or size) is refused before any work. Call it once the inputs
    are validated: it writes meta.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "meta.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path} is damaged ({err}); delete it if {out} holds nothing you need, or choose another --out"
            ) from None
        changed = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v and k not in ignore}
        if changed:
            raise ValueError(
                f"{out} holds {what} for lm={old.get('lm')!r}; this run differs in "
                f"{', '.join(f'{k} ({a!r} there, {b!r} here)' for k, (a, b) in changed.items())}. Choose another --out."
            )
    write_atomically(path, json.dumps(meta, indent=2) + "\n")


def check_recorded(out: Path, settings: dict, defaults: dict, what: str = "results") -> None:
    """Refuse to resume `out` at other `settings` than its meta.json records, before it is claimed;
    meta.json records a setting only where it differs from `defaults`, so an absent one reads as its
    default. An absent or damaged meta.json refuses nothing (`claim_out_dir` reports a damaged one)."""
    try:
        old = json.loads((Path(out) / "meta.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(old, dict):
        return
    for key, value in settings.items():
        recorded = old.get(key, defaults[key])
        if recorded != value:
            raise ValueError(
                f"{out} holds {what} with --{key}={json.dumps(recorded)}, this run has --{key}={json.dumps(value)}; "
                f"rerun with --{key}={json.dumps(recorded)} to resume it, or choose another --out"
            )


# --- the store ---


def _text(value) -> str:
    """A value as the csv module writes it."""
    return "" if value is None else str(value)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class ResultsStore:
    """Finished units in `directory`/results.sqlite, one table per `Table`, each exported to its
    CSV there. `out` (default: `directory`) is the run's output directory, where callers put
    their other files (`store.out`): a rank's store lives in DIR/ranks/rank-R with `out` DIR."""

    def __init__(self, directory: Path, tables: list[Table], out: Path | None = None):
        self.directory, self.tables = Path(directory), {t.name: t for t in tables}
        self.out = Path(out) if out is not None else self.directory
        self.directory.mkdir(parents=True, exist_ok=True)
        check_database(self.directory / DB_NAME, tables)
        self.db = sqlite3.connect(self.directory / DB_NAME, isolation_level=None)  # transactions are ours
        self.db.execute("PRAGMA locking_mode=EXCLUSIVE")  # before WAL: no shared-memory index
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS imported (name TEXT PRIMARY KEY)")
        for table in tables:
            columns = ", ".join(f"{_quote(c)} TEXT NOT NULL" for c in table.columns)
            key = ", ".join(_quote(c) for c in table.key)
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {_quote(table.name)} ({columns}, PRIMARY KEY ({key}))")
            self._import_once(table)
            self._export(table)

    def rows(self, name: str) -> list[dict]:
        """The rows of one table, as strings (as `csv.DictReader` reads them), oldest first."""
        table = self.tables[name]
        cursor = self.db.execute(f"SELECT {', '.join(map(_quote, table.columns))} FROM {_quote(name)} ORDER BY rowid")
        return [dict(zip(table.columns, values)) for values in cursor]

    def add(self, unit: dict[str, list[dict]]) -> None:
        """One finished unit ({table: rows}) in one transaction, then its tables' CSVs re-exported:
        a crash anywhere leaves the unit either wholly in or wholly out, and a signal (SIGTERM,
        SIGINT) stops the run once both are done (`core.signals.deferred`)."""
        with deferred():
            with self._transaction():
                for name, rows in unit.items():
                    self._insert(self.tables[name], rows)
            for name in unit:
                self._export(self.tables[name])

    def absorb(self, directories: list[Path], position: Callable[[str, dict], int] | None = None) -> None:
        """Merge the stores in `directories` (the ranks' DIR/ranks/rank-R) into this one, in one
        transaction, then remove them. Each table's new rows are inserted in the order of
        `position(table, row)` (stable; default: as found), so the merged CSV lists them as one
        process would have; a row equal to the one already here is left where it is."""
        found = {name: [] for name in self.tables}
        for directory in directories:
            source = ResultsStore(directory, list(self.tables.values()))
            try:
                for name in self.tables:
                    found[name] += source.rows(name)
            finally:
                source.close()
        with self._transaction():
            for name, rows in found.items():
                table = self.tables[name]
                have = {tuple(r[c] for c in table.key): r for r in self.rows(name)}
                new = [r for r in rows if have.get(tuple(r[c] for c in table.key)) != r]
                if position is not None:
                    new.sort(key=lambda row: position(name, row))
                self._insert(table, new)
        for table in self.tables.values():
            self._export(table)
        for directory in directories:
            shutil.rmtree(directory)  # only once their rows are committed here
        ranks = self.directory / RANKS_DIR
        if ranks.is_dir() and not any(ranks.iterdir()):
            ranks.rmdir()

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _insert(self, table: Table, rows: list[dict]) -> None:
        unknown = {k for row in rows for k in row} - set(table.columns)
        if unknown:
            raise ValueError(
                f"rows for {table.name} have unknown columns {sorted(unknown)}; expected {list(table.columns)}"
            )
        marks = ", ".join("?" * len(table.columns))
        for row in rows:
            self.db.execute(
                f"INSERT OR REPLACE INTO {_quote(table.name)} VALUES ({marks})",
                [_text(row.get(c)) for c in table.columns],
            )

    def _export(self, table: Table) -> None:
        if not table.export:
            return
        path = self.directory / f"{table.name}.csv"
        rows = self.rows(table.name)
        if not rows and not path.exists():
            return  # nothing finished yet: no file, as before
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=list(table.columns))
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(path, text.getvalue())

    def _import_once(self, table: Table) -> None:
        """Rows of a CSV written before the database (or by an older version): once, in one
        transaction with the mark that says it is done."""
        if self.db.execute("SELECT 1 FROM imported WHERE name = ?", (table.name,)).fetchone():
            return
        path = self.directory / f"{table.name}.csv"
        with self._transaction():
            if table.export and path.is_file():
                self._insert(table, complete_rows(path, table))
            self.db.execute("INSERT INTO imported VALUES (?)", (table.name,))


def check_database(path: Path, tables: list[Table]) -> None:
    """Refuse (one ValueError naming `path` and what to do) a file at `path` that is not a results
    database: not SQLite (random bytes, text), damaged (SQLite's quick check), or holding one of
    `tables` with other columns. No file, or an empty one, is a new database."""
    path = Path(path)
    if not path.exists():
        return
    try:
        db = sqlite3.connect(path, isolation_level=None)
        try:
            db.execute("PRAGMA locking_mode=EXCLUSIVE")  # as the store opens it: no shared-memory index
            names = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            found = {name: tuple(c[1] for c in db.execute(f"PRAGMA table_info({_quote(name)})")) for name in names}
            (verdict,) = db.execute("PRAGMA quick_check(1)").fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as err:
        verdict = str(err)
    if verdict != "ok":
        raise ValueError(f"{path} is not a results database ({verdict}); {_WHAT_TO_DO}")
    for table in tables:
        if table.name in found and found[table.name] != table.columns:
            raise ValueError(
                f"{path} holds a table {table.name!r} with columns {list(found[table.name])}, not "
                f"{list(table.columns)}: it is another program's database; {_WHAT_TO_DO}"
            )


_WHAT_TO_DO = (
    "delete it (a rerun imports the rows of the CSV files beside it and redoes the rest) or choose another --out"
)


def complete_rows(path: Path, table: Table) -> list[dict]:
    """The complete rows of a CSV: every column present, numbers that parse, the line ended by a
    newline. Each other line is reported (a warning naming the file and line) and dropped, so its
    unit is recomputed; a file without the expected header yields nothing."""
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    header = next(csv.reader(lines[:1]), []) if lines and lines[0].endswith("\n") else []
    required = [c for c in table.columns if c not in table.optional]
    if not set(required) <= set(header) or not set(header) <= set(table.columns):
        if any(line.strip() for line in lines):
            warnings.warn(
                f"{path}: line 1 is not the header {','.join(table.columns)}; nothing in it is kept, "
                "every unit is recomputed",
                stacklevel=2,
            )
        else:
            warnings.warn(f"{path} is empty; every unit is recomputed", stacklevel=2)
        return []
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        row = _complete(line, header, table)
        if row is None:
            warnings.warn(
                f"{path}: line {number} is incomplete or damaged ({line.rstrip()!r}); "
                "it is dropped and its unit recomputed",
                stacklevel=2,
            )
        else:
            rows.append(row)
    return rows


def _complete(line: str, header: list[str], table: Table) -> dict | None:
    if not line.endswith("\n"):
        return None
    fields = next(csv.reader([line]), [])
    if len(fields) != len(header):
        return None
    row = dict(zip(header, fields))
    for column in table.columns:
        value = row.get(column, "")
        if value == "":
            if column not in table.optional:
                return None
        elif column in table.numeric and not _is_number(value):
            return None
    return row


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def rank_dirs(out: Path) -> list[Path]:
    """The ranks' stores in DIR/ranks (of this run, or left by an interrupted one), by rank."""
    found = [p for p in (Path(out) / RANKS_DIR).glob("rank-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def rank_store(out: Path, rank: int, tables: list[Table]) -> ResultsStore:
    """Rank `rank`'s own store, DIR/ranks/rank-R (its `out` is DIR); rank 0 merges it."""
    return ResultsStore(Path(out) / RANKS_DIR / f"rank-{rank}", tables, out=out)


@contextmanager
def open_results(
    out: Path, meta: dict, tables: list[Table], what: str = "results", ignore: tuple = ()
) -> Iterator[ResultsStore]:
    """Lock `out`, claim it for `meta` (see `claim_out_dir`) and open its store; the lock is held
    until the block ends, however it ends."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = OutDirLock(out).acquire()
    try:
        check_database(out / DB_NAME, tables)  # before meta.json is written: a refused run leaves nothing
        claim_out_dir(out, meta, what, ignore)
        store = ResultsStore(out, tables)
        try:
            yield store
        finally:
            store.close()
    finally:
        lock.release()

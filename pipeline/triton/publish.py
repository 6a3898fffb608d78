"""Publishing one recipe's models into a model repository, as one unit.

The unit is the recipe's model folders plus their ``repository.json`` entries.
A publish is a small transaction with a journal (``.publish-journal.json`` in the
repository) written before anything live changes:

1. every model folder is complete in a staging folder on the repository's own file
   system (:func:`new_staging`), and the new ``repository.json`` content is computed;
2. the journal records the staging folder, each staged folder's inode and the new index;
3. each model folder is swapped in (``renameat2(RENAME_EXCHANGE)`` where possible,
   so a polling Triton never sees a missing model), stale ones are moved out;
4. ``repository.json`` is replaced atomically, then the journal is removed.

Builds of several recipes may share one repository: every recovery, publish and
verification holds ``<repo>/.publish.lock`` (``flock``: exclusive to write, shared to
verify), so there is one journal at a time and ``repository.json`` is re-read under the
lock before the new one is computed from it.

A crash anywhere in 3-4 leaves the journal; the next publish or build into that
repository (:func:`recover`) rolls the transaction forward from it: a folder
whose inode equals the staged one is already in place, any other is swapped in.
A failed write (a full disk, a read-only mount) undoes 3-4 instead and exits 4
(:class:`~pipeline.errors.StorageFault`).
:func:`verify_repository` (``python -m pipeline verify-repo DIR``) reports a
pending journal and re-hashes every file against ``repository.json``.
SIGINT / SIGTERM are held back during steps 3-4, so Ctrl-C never splits them.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipeline.errors import PipelineError, RepositoryCorrupt, StorageFault, TritonConfigError, storage_fault
from pipeline.faults import fault_point
from pipeline.fsutil import exchange, file_sha256, remove_scratch, write_text_atomic

INDEX_FILE = "repository.json"
JOURNAL_FILE = ".publish-journal.json"
LOCK_FILE = ".publish.lock"


@contextlib.contextmanager
def repository_lock(repo: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold ``flock`` on ``repo/.publish.lock`` (created, with ``repo``, if missing): exclusive
    for a recovery or publish, ``shared`` for a verification; blocks until it is free.
    A shared lock never creates the file: where it is missing (nothing ever published
    there) or cannot be opened, verification goes on without it.

    Raises:
        OSError: the exclusive lock file cannot be created (e.g. EROFS, ENOSPC).
    """
    try:
        if not shared:
            repo.mkdir(parents=True, exist_ok=True)
        fh = open(repo / LOCK_FILE, "a" if not shared else "r")  # a verification writes nothing
    except OSError:
        if not shared:
            raise
        yield
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield


#: a model name an index may hold: the recipe's ``triton.model_name`` pattern (one folder, never
#: a path: ``..`` or ``/`` would reach outside the repository)
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


def read_index(repo: Path) -> dict[str, dict]:
    """model name -> entry of ``repo/repository.json`` ({} when there is none).

    Raises:
        RepositoryCorrupt: (exit 4) the file exists but is not a JSON object whose ``models``
            maps model names (``[A-Za-z0-9_-]+``: a folder of the repository) to objects;
            names the file and what is wrong. Nothing is written or deleted on its word then.
    """
    path = repo / INDEX_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RepositoryCorrupt(f"{path}: unreadable ({e}); restore it from a published copy, or remove it "
                                f"together with the model folders in {repo} and rebuild every recipe that "
                                "publishes into this repository") from None
    models = data.get("models") if isinstance(data, dict) else None
    bad = ("its top level is not an object with a \"models\" object" if not isinstance(models, dict) else
           next(filter(None, (_entry_problem(k, v) for k, v in models.items())), None))
    if bad:
        raise RepositoryCorrupt(f"{path}: not a model repository index: {bad}; valid: "
                                "{\"models\": {\"<name [A-Za-z0-9_-]+>\": {\"recipe\": ..., \"files\": {...}}}} "
                                f"(restore it, or remove it together with the model folders in {repo}, then rebuild)")
    return models


def _entry_problem(name: str, entry) -> str | None:
    """What is wrong with one ``models`` entry of an index (None: nothing)."""
    if not _MODEL_NAME.match(name):
        return f"entry {name!r} is not a model folder name"
    if not isinstance(entry, dict):
        return f"entry {name!r} is not an object"
    files = entry.get("files", {})
    if not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
        return f"entry {name!r}: \"files\" is not an object of relative path -> sha256"
    return None


def unlisted_folders(repo: Path, index: dict[str, dict]) -> list[str]:
    """Model folders in ``repo`` that ``index`` does not list (dot-folders, the publish's own
    staging and journal, are not models)."""
    if not repo.is_dir():
        return []
    return sorted(p.name for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in index)


def published_models(repo: Path, recipe_name: str) -> list[str]:
    """Models that recipe ``recipe_name`` published into ``repo``."""
    return [k for k, v in read_index(repo).items() if v.get("recipe") == recipe_name]


class ModelOwnedElsewhere(PipelineError):
    """A recipe would publish a model name that ``repository.json`` assigns to another recipe (exit 2)."""


def foreign_owners(repo: Path, recipe_name: str, names: Sequence[str]) -> dict[str, str | None]:
    """model name -> owning recipe, for each of ``names`` that ``repo/repository.json``
    assigns to a recipe other than ``recipe_name`` (a folder with no entry is nobody's)."""
    index = read_index(Path(repo))
    owners = {n: str(index[n].get("recipe")) for n in names if n in index}
    return {n: owner for n, owner in owners.items() if owner != recipe_name}


def describe_publish(repo: Path, recipe_name: str) -> str:
    """One sentence on what ``repo`` holds of recipe ``recipe_name``, from its ``repository.json``:
    the models, the recipe hash and time of their publish (``recipe_hash``, ``published_at``;
    an older index lacks them) and whether they still re-hash to it (:func:`verify_repository`)."""
    models = sorted(published_models(Path(repo), recipe_name))
    if not models:
        return f"{repo}/ holds no model of recipe {recipe_name}"
    index = read_index(Path(repo))
    hashes = sorted({str(index[m].get("recipe_hash", "not recorded"))[:12] for m in models})
    times = sorted({str(index[m].get("published_at", "not recorded")) for m in models})
    problems = verify_repository(Path(repo), models, recipe=recipe_name)
    state = ("last verified publish" if not problems
             else f"last publish, which FAILS verification ({problems[0]}{'; ...' if len(problems) > 1 else ''})")
    return (f"{repo}/ still holds recipe {recipe_name}'s {state}: {', '.join(models)} (recipe hash "
            f"{', '.join(hashes)}, published {', '.join(times)})")


def check_ownership(repo: Path, recipe_name: str, names: Sequence[str] | dict[str, str]) -> None:
    """Refuse to publish a model name that another recipe owns in ``repo``; writes nothing.

    Args:
        names: the model names the recipe publishes, or name -> the recipe field that
            sets it (e.g. ``"triton.model_name"``), which the message then names.

    Raises:
        ModelOwnedElsewhere: one line per taken name: the model, its owning recipe, and
            the two ways on (rename the recipe's model, or remove the owner's model).
    """
    repo = Path(repo)
    taken = foreign_owners(repo, recipe_name, list(names))
    if pending(repo) is None:  # an interrupted publish's own folders are not indexed yet; recovery lists them
        index = read_index(repo)
        taken.update({n: None for n in names if n not in index and ((repo / n).exists() or (repo / n).is_symlink())})
    if not taken:
        return
    fields = names if isinstance(names, dict) else {}
    lines = [f"model {n!r} ({repo / n}) " + (f"belongs to recipe {owner!r}" if owner else
                                             f"is a {'folder' if (repo / n).is_dir() else 'file'} no recipe published (not in {INDEX_FILE})")
             + (f"; it is this recipe's {fields[n]}" if n in fields else "") for n, owner in taken.items()]
    raise ModelOwnedElsewhere(
        f"{repo}: recipe {recipe_name!r} would replace model folders that are not its own; "
        "nothing was published:\n  " + "\n  ".join(lines) + "\n"
        "Give this recipe's model another name (triton.model_name, or triton.generate_model_name for the "
        "generation model), or, if that model should go, delete its folder (and its entry under "
        f"\"models\" in {repo / INDEX_FILE}, if any; no pipeline command removes models it did not publish)"
    )


def tree_hashes(model_dir: Path) -> dict[str, str]:
    """relative posix path -> sha256 hex of every file under ``model_dir`` but Python's bytecode
    caches (:func:`bytecode_cache`)."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    return {rel: file_sha256(p) for p in files if not bytecode_cache(rel := p.relative_to(model_dir).as_posix())}


def bytecode_cache(rel: str) -> bool:
    """``rel`` (a posix path inside a model folder) is a ``.pyc`` file in a ``__pycache__`` folder: the
    bytecode Python writes beside a source it imports. The python backend's stub writes one into
    each version folder whose ``model.py`` it loads, whoever serves the repository in place (``serve``,
    a tritonserver container with it mounted): the stub runs its Python isolated (``sys.flags.isolated``:
    PYTHONDONTWRITEBYTECODE and the rest of the environment are ignored), so nothing outside it can
    stop the write. Python reads such a file only as the cache of ``<name>.py`` in the folder above,
    while its header matches that source's size and time stamp; the source is checked. So no publish
    records or uploads one, and verify-repo skips them; a ``.pyc`` anywhere else (importable on its
    own) and any other file in ``__pycache__`` are checked as every file is."""
    parts = rel.split("/")
    return len(parts) >= 2 and parts[-2] == "__pycache__" and parts[-1].endswith(".pyc")


def _published_at(prev: dict | None, entry: dict) -> str:
    """The entry's publish time (UTC, ISO 8601): the recorded one when ``entry`` is what is
    already published (republishing the same files is no new publish), else now."""
    if prev and "published_at" in prev and {k: v for k, v in prev.items() if k != "published_at"} == entry:
        return str(prev["published_at"])
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def publish(staging: Path, repo: Path, entries: dict[str, dict], recipe_name: str) -> None:
    """Publish the staged folders ``staging/<name>`` (name -> index entry in ``entries``)
    into ``repo`` as one unit; other recipes' models and entries stay. Holds the repository
    lock (:func:`repository_lock`) throughout, so builds sharing ``repo`` publish one at a time.

    Raises:
        StorageFault: a write failed on a full, over-quota, read-only or cross-device file
            system (exit 4, names ``repo``); every step done so far was undone.
        RepositoryCorrupt: an earlier interrupted publish cannot be completed.
        ModelOwnedElsewhere: ``repository.json`` assigns one of ``entries`` to another
            recipe; nothing was changed.
        TritonConfigError: a file-system step failed; every step done so far
            was undone, so the repository holds the previous set.
    """
    with repository_lock(repo):
        _recover(repo)
        remove_scratch(repo)  # a killed write of repository.json or the journal (the lock is held)
        check_ownership(repo, recipe_name, list(entries))
        before = read_index(repo)  # read under the lock
        index = {k: v for k, v in before.items() if v.get("recipe") != recipe_name}
        index.update({name: {**entry, "published_at": _published_at(before.get(name), entry)}
                      for name, entry in entries.items()})
        journal = {
            "recipe": recipe_name,
            "staging": str(staging.resolve()),
            "models": {name: os.stat(staging / name).st_ino for name in entries},
            "stale": [n for n in published_models(repo, recipe_name) if n not in entries],
            "index": {"models": index},
        }
        with _signals_held():
            try:
                _write_json(repo / JOURNAL_FILE, journal)
            except OSError as e:  # nothing live changed yet
                raise _failed(repo, e, "nothing was changed") from e
            fault_point("publish:journal")
            try:
                _swap_models(repo, journal)
                _write_index(repo, journal)
            except OSError as e:
                _rollback(repo, journal)
                raise _failed(repo, e, "the previous repository was restored") from e
            _cleanup(repo, journal)


def _failed(repo: Path, exc: OSError, state: str) -> PipelineError:
    """The error for a failed publish step: a StorageFault (exit 4) for a full, read-only or
    cross-device file system, else a TritonConfigError."""
    fault = storage_fault(exc, repo)
    if fault is not None:
        return StorageFault(f"publishing into {repo} failed, {state}: {fault}")
    return TritonConfigError(f"{repo}: publishing failed ({exc}); {state}")


def pending(repo: Path) -> dict | None:
    """The journal of an interrupted publish into ``repo``, or None.

    Raises:
        RepositoryCorrupt: (exit 4) the journal is unreadable, or is not one a publish into
            ``repo`` wrote (:func:`_journal_problem`): recovery would move or delete what it
            names, so nothing is done on its word.
    """
    path = repo / JOURNAL_FILE
    try:
        journal = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RepositoryCorrupt(f"{path}: unreadable publish journal ({e})") from e
    problem = _journal_problem(repo, journal)
    if problem:
        raise RepositoryCorrupt(f"{path}: not a publish journal of {repo} ({problem}); nothing was done on its word. "
                                "Remove it once no build publishes here, then run verify-repo")
    return journal


def _journal_problem(repo: Path, journal) -> str | None:
    """What makes ``journal`` one no publish into ``repo`` wrote (None: nothing)."""
    if not isinstance(journal, dict) or not isinstance(journal.get("recipe"), str):
        return "no recipe"
    staging = Path(str(journal.get("staging", "")))
    real = repo.resolve()
    if staging.parent not in (real.parent, real) or not staging.name.startswith(staging_prefix(repo, journal["recipe"])):
        return f"its staging folder {staging} is not one of this repository's"
    models, stale, index = journal.get("models"), journal.get("stale"), journal.get("index")
    if not (isinstance(models, dict) and all(_MODEL_NAME.match(k) and isinstance(v, int) for k, v in models.items())):
        return "its models are not model folder name -> inode"
    if not (isinstance(stale, list) and all(isinstance(n, str) and _MODEL_NAME.match(n) for n in stale)):
        return "its stale models are not model folder names"
    entries = index.get("models") if isinstance(index, dict) else None
    if not isinstance(entries, dict):
        return "no index"
    return next(filter(None, (_entry_problem(k, v) for k, v in entries.items())), None)


def recover(repo: Path) -> str | None:
    """Complete an interrupted publish into ``repo`` (roll forward); returns a note, or None
    when there was nothing to do.

    Raises:
        RepositoryCorrupt: the journal's staged folders are gone, so the
            transaction can neither complete nor be told apart from the old set.
    """
    if not repo.is_dir():  # no repository yet: nothing to recover, and nothing is created
        return None
    with repository_lock(repo):
        return _recover(repo)


def _recover(repo: Path) -> str | None:
    """:func:`recover`, with the repository lock held."""
    journal = pending(repo)
    if journal is None:
        return None
    with _signals_held():
        _swap_models(repo, journal)
        _write_index(repo, journal)
        _cleanup(repo, journal)
    return f"{repo}: completed the interrupted publish of recipe {journal['recipe']!r}"


def staging_prefix(repo: Path, recipe_name: str) -> str:
    """Name prefix of a recipe's staging folders (a dot-folder, see :func:`staging_parent`)."""
    return f".{repo.resolve().name}.staging-{recipe_name}-"


def staging_parent(repo: Path) -> Path:
    """Where a publish into ``repo`` stages, so that every rename into it stays on one
    file system: beside the resolved repository (outside Triton's model namespace)
    when that folder is writable and on the repository's device (``st_dev``); else,
    as for a volume mounted at the repository itself (a Kubernetes PVC or Docker
    volume at ``/models``, or a symlink to one), inside the repository. There it is
    a dot-folder that ``verify-repo`` never lists (it reads ``repository.json``);
    Triton's poll mode does try to load every sub-folder (core
    ``ModelRepositoryManager::Poll`` lists all of them), so the servers this project
    starts use ``--model-control-mode=explicit`` and load the published models by name.
    Creates the repository if missing."""
    real = repo.resolve()
    real.mkdir(parents=True, exist_ok=True)
    parent = real.parent
    if os.stat(parent).st_dev == os.stat(real).st_dev and os.access(parent, os.W_OK | os.X_OK):
        return parent
    return real


def new_staging(repo: Path, recipe_name: str) -> Path:
    """A new, empty staging folder for ``recipe_name``'s models (:func:`staging_parent`).

    Raises:
        StorageFault: it landed on another file system than the repository, so no
            atomic rename could publish from it (exit 4, names both folders).
        OSError: it cannot be created (a full or read-only file system: the CLI exits 4).
    """
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(repo, recipe_name), dir=staging_parent(repo)))
    if os.stat(staging).st_dev != os.stat(repo.resolve()).st_dev:
        shutil.rmtree(staging, ignore_errors=True)
        raise StorageFault(f"{repo.resolve()}: no folder on its file system can hold the staging folder "
                           f"({staging} is on another one), so publishing cannot be an atomic rename; "
                           "make the repository folder writable")
    return staging


def remove_leftovers(repo: Path, recipe_name: str) -> list[Path]:
    """Remove staging folders a killed publish of ``recipe_name`` left beside or inside
    ``repo`` (call with the recipe's run lock held, after :func:`recover`); returns them."""
    if not repo.is_dir():
        return []
    with repository_lock(repo):
        journal = pending(repo)
        keep = Path(journal["staging"]) if journal else None
        real = repo.resolve()
        gone = [p for folder in dict.fromkeys([real.parent, real]) if folder.is_dir()
                for p in folder.glob(staging_prefix(repo, recipe_name) + "*") if p.resolve() != keep]
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
    return gone


def _swap_models(repo: Path, journal: dict) -> None:
    """Step 3: swap each staged folder in, move stale ones out. Idempotent, so a
    crash in it is resumed by running it again."""
    staging = Path(journal["staging"])
    aside = staging / ".replaced"
    aside.mkdir(parents=True, exist_ok=True)
    for i, (name, ino) in enumerate(journal["models"].items()):
        _place(staging / name, repo / name, aside / name, ino)
        fault_point(f"publish:model:{i}")
    for name in journal["stale"]:
        if (repo / name).exists() and not (aside / name).exists():
            os.rename(repo / name, aside / name)
    fault_point("publish:stale")


def _write_index(repo: Path, journal: dict) -> None:
    """Step 4a: the new index (atomic: a failed write leaves the old one)."""
    _write_json(repo / INDEX_FILE, journal["index"], indent=2)
    fault_point("publish:index")


def _cleanup(repo: Path, journal: dict) -> None:
    """Step 4b: the journal goes, then the staging folder."""
    (repo / JOURNAL_FILE).unlink()
    fault_point("publish:cleanup")
    shutil.rmtree(journal["staging"], ignore_errors=True)


def _rollback(repo: Path, journal: dict) -> None:
    """Undo :func:`_swap_models` after an in-process failure, then drop the journal.

    Raises:
        RepositoryCorrupt: the undo failed too; the journal stays for the next run.
    """
    staging = Path(journal["staging"])
    aside = staging / ".replaced"
    try:
        for name in journal["stale"]:
            if (aside / name).exists() and not (repo / name).exists():
                os.rename(aside / name, repo / name)
        for name, ino in reversed(journal["models"].items()):
            dest = repo / name
            if _inode(dest) != ino:  # not swapped in; its old folder may be aside already
                if not dest.exists() and (aside / name).exists():
                    os.rename(aside / name, dest)
                continue
            old = next((p for p in (aside / name, staging / name) if p.exists()), None)
            if old is not None and exchange(old, dest):
                continue
            os.rename(dest, staging / f".{name}.undone")
            if old is not None:
                os.rename(old, dest)
    except OSError as e:
        raise RepositoryCorrupt(f"{repo}: publishing failed and so did the undo ({e}); "
                                "the next build of the recipe completes the publish") from e
    (repo / JOURNAL_FILE).unlink()


def _place(new: Path, dest: Path, aside: Path, ino: int) -> None:
    """Put the staged folder ``new`` (inode ``ino``) at ``dest`` unless it is there already."""
    if _inode(dest) == ino:
        return
    if _inode(new) != ino:
        raise RepositoryCorrupt(
            f"{dest}: an interrupted publish cannot be completed: its staged folder {new} is gone. "
            f"Remove {dest.parent / JOURNAL_FILE} and rebuild the recipe"
        )
    if dest.exists() and exchange(new, dest):
        return
    if dest.exists():
        os.rename(dest, aside)
    os.rename(new, dest)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _write_json(path: Path, data: dict, indent: int | None = None) -> None:
    """Write ``path`` atomically and durably (:func:`pipeline.fsutil.write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=True, allow_nan=False) + "\n", durable=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back (delivered on exit), so Ctrl-C cannot split a publish."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def verify_repository(repo: Path, models: Sequence[str] | None = None, recipe: str | None = None) -> list[str]:
    """Re-hash a published repository against its ``repository.json``.

    ``models``: check only these (default: every indexed model). ``recipe``: these
    models must also be assigned to this recipe. Returns one line per problem
    (empty: the repository is exactly what was published): a pending publish
    journal, a missing or unreadable index, a missing model folder (or, for the whole
    repository, one the index does not list), a model another recipe owns, and
    every file that is missing, differs from its recorded sha256, or is not recorded.
    """
    repo = Path(repo)
    with repository_lock(repo, shared=True):  # not mid-way through another build's publish
        return _verify_locked(repo, models, recipe)


def _verify_locked(repo: Path, models: Sequence[str] | None, recipe: str | None) -> list[str]:
    problems = []
    journal = pending(repo)
    if journal is not None:
        problems.append(f"{repo}: half-published: the publish of recipe {journal['recipe']!r} was interrupted "
                        f"({JOURNAL_FILE} present); the next build of that recipe completes it")
    if not (repo / INDEX_FILE).is_file():
        return problems + [f"{repo / INDEX_FILE}: missing; {repo} is not a published repository"]
    try:
        index = read_index(repo)
    except RepositoryCorrupt as e:
        return problems + [str(e)]
    if models is None:
        problems += [f"{repo / n}: a model folder not listed in {INDEX_FILE}" for n in unlisted_folders(repo, index)]
    for name in models if models is not None else sorted(index):
        owner = index.get(name, {}).get("recipe")
        if recipe is not None and name in index and owner != recipe:
            problems.append(f"{repo / name}: {INDEX_FILE} assigns it to recipe {owner!r}, not {recipe!r}")
            continue
        problems += _verify_model(repo, name, index.get(name))
    return problems


def _verify_model(repo: Path, name: str, entry: dict | None) -> list[str]:
    if entry is None:
        return [f"{repo / name}: not listed in {INDEX_FILE}"]
    if not (repo / name).is_dir():
        return [f"{repo / name}: model folder missing"]
    recorded = entry.get("files", {})
    actual = tree_hashes(repo / name)
    out = [f"{repo / name / f}: missing" for f in sorted(set(recorded) - set(actual))]
    out += [f"{repo / name / f}: sha256 {actual[f][:12]} differs from the published {recorded[f][:12]}"
            for f in sorted(set(recorded) & set(actual)) if recorded[f] != actual[f]]
    out += [f"{repo / name / f}: not part of the published model" for f in sorted(set(actual) - set(recorded))]
    return out

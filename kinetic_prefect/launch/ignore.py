"""Which files of the package root go into the code archive.

Three layers decide, strongest first:

1. **Never shipped**, whatever any ignore file says: `.git`, `.prefect/`
   (Prefect's local SQLite database), `.kinetic/` (the local jobs store),
   `__pycache__/`, virtualenvs (any directory holding `pyvenv.cfg`), `.env` and
   `.env.*`, `*.pem`, `*.key`, `*.p12`, SQLite files (`*.db`, `*.sqlite*`,
   `*-wal`, `*-shm`) and Google credential JSON files (decided by content: a
   JSON object of at most 64 KiB with `"type": "service_account"` or
   `"authorized_user"`, or a `private_key` field).
2. **`.gitignore` and `.kineticignore`** files, in the root and in any
   subdirectory, in gitignore syntax: `#` comments, `!` negation, a trailing
   `/` for directories only, a leading or inner `/` anchoring the pattern to
   the file's directory, `*`, `?`, `[...]`, and `**` (leading `**/`, inner
   `/**/`, trailing `/**`). Deeper files override shallower ones, and in one
   directory `.kineticignore` overrides `.gitignore` (so `!data/` there ships
   a directory git ignores). As in git, a file inside an excluded directory
   cannot be re-included. Not supported: `core.excludesFile` and
   `.git/info/exclude`.
3. **Defaults** such as `.venv`, `node_modules` and tool caches, which an
   ignore file can re-include with `!`.

Every file or directory left out is named in a DEBUG line of the
`kinetic_prefect.launch.packaging` logger, with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from prefect.logging import get_logger

logger = get_logger("kinetic_prefect.launch.packaging")

IGNORE_FILE = ".kineticignore"
IGNORE_FILES = (".gitignore", IGNORE_FILE)
DEFAULT_EXCLUDES = (
    ".hg/",
    ".svn/",
    ".venv/",
    "venv/",
    ".tools/",
    "*.pyc",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ruff_cache/",
    "node_modules/",
    ".ipynb_checkpoints/",
    "*.egg-info/",
    ".DS_Store",
)
CREDENTIAL_SCAN_BYTES = 64 * 1024
_NEVER_DIRS = {
    ".git": "version control data is never shipped",
    ".prefect": "Prefect's local state (its SQLite database, profiles) is never shipped",
    ".kinetic": "the local kinetic-prefect jobs store is never shipped",
    "__pycache__": "bytecode caches are never shipped",
}
_SECRET_SUFFIXES = (".pem", ".key", ".p12")
_DATABASE = re.compile(r".*(\.db|\.sqlite[^/]*|-wal|-shm)")
_CREDENTIAL_TYPES = {"service_account", "authorized_user"}
_LISTED_NAMES = 10


@dataclass(frozen=True)
class Rule:
    """One gitignore-syntax pattern, relative to the directory `base` (`""` or `"a/b/"`)."""

    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    base: str
    source: str

    def matches(self, relative: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if not relative.startswith(self.base):
            return False
        return self.regex.fullmatch(relative[len(self.base) :]) is not None


def _translate_segment(segment: str) -> str:
    out, i = [], 0
    while i < len(segment):
        char = segment[i]
        if char == "\\" and i + 1 < len(segment):
            out.append(re.escape(segment[i + 1]))
            i += 2
            continue
        if char == "*":
            while i + 1 < len(segment) and segment[i + 1] == "*":
                i += 1
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and "]" in segment[i + 2 :]:
            end = segment.index("]", i + 2)
            body = segment[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def _translate(pattern: str) -> str:
    segments = pattern.split("/")
    parts: list[str] = []
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "**":
            parts.append(".*" if last else "(?:.*/)?")
        else:
            parts.append(_translate_segment(segment) + ("" if last else "/"))
    return "".join(parts)


def parse_rule(line: str, base: str = "", source: str = "") -> Rule | None:
    """A rule from one line of an ignore file, or None for blanks and comments."""
    text = re.sub(r"(?<!\\) +$", "", line.rstrip("\r\n"))
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    if negate or text.startswith(("\\!", "\\#")):
        text = text[1:]
    dir_only = text.endswith("/")
    text = text.rstrip("/")
    if not text:
        return None
    anchored = "/" in text
    body = _translate(text.lstrip("/"))
    regex = re.compile(body if anchored else "(?:.*/)?" + body)
    return Rule(regex, negate, dir_only, base, f"{source}: {line.strip()}" if source else line)


def _rules_in(directory: Path, base: str) -> list[Rule]:
    rules = []
    for name in IGNORE_FILES:
        path = directory / name
        if path.is_file():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                rule = parse_rule(line, base, f"{base}{name}:{number}")
                if rule:
                    rules.append(rule)
    return rules


def _looks_like_credentials(path: Path) -> bool:
    try:
        if path.stat().st_size > CREDENTIAL_SCAN_BYTES:
            return False
        content = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and (
        content.get("type") in _CREDENTIAL_TYPES or "private_key" in content
    )


def never_shipped(path: Path, is_dir: bool) -> str | None:
    """Why `path` is never shipped, or None when the ignore files decide."""
    name = path.name
    if name in _NEVER_DIRS and (is_dir or name == ".git"):
        return _NEVER_DIRS[name]
    if is_dir:
        if (path / "pyvenv.cfg").is_file():
            return "a virtualenv (it holds pyvenv.cfg) is never shipped; the image has the packages"
        return None
    lower = name.lower()
    if lower == ".env" or lower.startswith(".env."):
        return "environment files can hold secrets and are never shipped"
    if lower.endswith(_SECRET_SUFFIXES):
        return "key and certificate files are never shipped"
    if _DATABASE.fullmatch(lower):
        return "database files (SQLite and its -wal/-shm journals) are never shipped"
    if lower.endswith(".json") and _looks_like_credentials(path):
        return (
            "a Google credentials file is never shipped; pods authenticate with their "
            "service account (Workload Identity) or the cluster block's credentials"
        )
    return None


def _ignored_by(rules: list[Rule], relative: str, is_dir: bool) -> Rule | None:
    decided = None
    for rule in rules:
        if rule.matches(relative, is_dir):
            decided = rule
    return None if decided is None or decided.negate else decided


def _log_left_out(path: Path, relative: str, is_dir: bool, reason: str) -> None:
    if not logger.isEnabledFor(logging.DEBUG):
        return
    if not is_dir:
        logger.debug("Not shipping %s: %s.", relative, reason)
        return
    names = sorted(
        Path(dirpath, f).relative_to(path).as_posix()
        for dirpath, _, files in os.walk(path)
        for f in files
    )
    listed = ", ".join(names[:_LISTED_NAMES]) + (", ..." if len(names) > _LISTED_NAMES else "")
    logger.debug(
        "Not shipping %s/ (%d file(s): %s): %s.", relative, len(names), listed or "none", reason
    )


def iter_package_files(root: Path, extra_excludes: Collection[str] = ()) -> Iterator[Path]:
    """Files under `root` that go into the code archive, sorted by relative path.

    `extra_excludes` are root-relative paths (files or directories) left out too,
    such as local `Data` that travels through the data cache instead.
    """
    defaults = [r for r in (parse_rule(p, source="default") for p in DEFAULT_EXCLUDES) if r]
    stack: list[tuple[Path, str, list[Rule]]] = [(root, "", defaults)]
    found: list[tuple[str, Path]] = []
    while stack:
        directory, base, inherited = stack.pop()
        rules = inherited + _rules_in(directory, base)
        with os.scandir(directory) as entries:
            children = sorted(entries, key=lambda e: e.name)
        for entry in children:
            path = Path(entry.path)
            relative = base + entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            reason = never_shipped(path, is_dir)
            if reason is None and any(
                relative == p or relative.startswith(p + "/") for p in extra_excludes
            ):
                reason = (
                    "it is passed as kinetic_prefect.Data, which travels through the data cache"
                )
            if reason is None:
                rule = _ignored_by(rules, relative, is_dir)
                reason = f"ignored by {rule.source}" if rule else None
            if reason is not None:
                _log_left_out(path, relative, is_dir, reason)
            elif is_dir:
                stack.append((path, relative + "/", rules))
            elif path.is_file():
                found.append((relative, path))
    for _, path in sorted(found):
        yield path

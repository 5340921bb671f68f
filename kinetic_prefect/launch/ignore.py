"""Which files of the package root go into the code archive.

The candidates come from git when the root is in a git checkout (`git ls-files
--cached --others --exclude-standard`: tracked files and untracked ones git
does not ignore, so git's own ignore rules, global ones included, apply and an
ignored file is never even looked at); otherwise from walking the root. Then
three layers decide, strongest first:

1. **Never shipped**, whatever any ignore file says: `.git`, `.prefect/`
   (Prefect's local SQLite database), `.kinetic/` (the local jobs store),
   `__pycache__/`, virtualenvs (any directory holding `pyvenv.cfg`), SQLite
   files (`*.db`, `*.sqlite*`, `*-wal`, `*-shm`), and credentials: `.env` and
   `.env.*`, `*.pem`, `*.key`, `*.p12`, `*.ppk`, SSH keys (`id_*` without an
   extension, so `id_rsa.pub` ships), anything under `.ssh/`, `.gnupg/`,
   `.aws/` or `.kube/`, `.netrc`, `.envrc`, `.pypirc`, `.npmrc`,
   `.git-credentials`, `.docker/config.json`, kubeconfig files by name, and,
   by content (`credential_content`), any file that starts with a PEM or
   OpenSSH private-key header, a kubeconfig holding a token or a client key,
   and Google credential JSON (a JSON object of at most 64 KiB with `"type":
   "service_account"` or `"authorized_user"`, or a `private_key` field). A
   symlink is shipped only when its target is a file inside the root (as the
   target's content, under the link's name); one pointing outside is skipped,
   so no byte from outside the root enters the archive.
2. **`.kineticignore` files** (and, when walking, `.gitignore` files), in the
   root and in any subdirectory, in gitignore syntax: `#` comments, `!`
   negation, a trailing `/` for directories only, a leading or inner `/`
   anchoring the pattern to the file's directory, `*`, `?`, `[...]`, and `**`
   (leading `**/`, inner `/**/`, trailing `/**`). Deeper files override
   shallower ones, and in one directory `.kineticignore` overrides
   `.gitignore` (so, when walking, `!data/` there ships a directory git
   ignores; in a checkout, git's list is the most that ships). As in git, a
   file inside an excluded directory cannot be re-included.
3. **Defaults** such as `.venv`, `node_modules` and tool caches, which an
   ignore file can re-include with `!`.

Only names and `stat` results decide here, so the archive's size and file
count are known before any file is read. Every file or directory left out is
named in a DEBUG line of the `kinetic_prefect.launch.packaging` logger, with
the reason.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
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
    ".ssh": "SSH keys and settings are never shipped",
    ".gnupg": "GnuPG keyrings are never shipped",
    ".aws": "AWS credentials are never shipped",
    ".kube": "Kubernetes credentials (kubeconfig) are never shipped",
}
_CREDENTIAL_FILES = {
    ".netrc": "a .netrc holds passwords and is never shipped",
    "_netrc": "a .netrc holds passwords and is never shipped",
    ".envrc": "an .envrc exports environment (often tokens) and is never shipped",
    ".pypirc": "a .pypirc holds package index credentials and is never shipped",
    ".npmrc": "an .npmrc holds registry tokens and is never shipped",
    ".git-credentials": "git's stored credentials are never shipped",
}
_SECRET_SUFFIXES = (".pem", ".key", ".p12", ".ppk")
# ssh-keygen's names (id_rsa, id_ed25519, id_ecdsa_sk, ...); `id_rsa.pub` and `id_map.py` ship.
_SSH_KEY = re.compile(r"id_[^.]+")
_KUBECONFIG_NAME = re.compile(r"kubeconfig(\.(ya?ml|json|conf))?|.+\.kubeconfig")
_DATABASE = re.compile(r".*(\.db|\.sqlite[^/]*|-wal|-shm)")
_CREDENTIAL_TYPES = {"service_account", "authorized_user"}
# PEM (PKCS#1/#8, EC, DSA, encrypted), OpenSSH and PGP private keys, after an optional BOM.
_PRIVATE_KEY = re.compile(
    rb"\A(?:\xef\xbb\xbf)?\s*-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
)
_KUBECONFIG_KIND = re.compile(rb"""(?m)^\s*["']?kind["']?\s*:\s*["']?Config["']?\s*,?\s*$""")
_KUBECONFIG_SECRET = re.compile(
    rb"""(?m)^[\s-]*["']?(?:token|client-key-data|client-key)["']?\s*:\s*\S"""
)
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


def _rules_in(directory: Path, base: str, names: tuple[str, ...]) -> list[Rule]:
    rules = []
    for name in names:
        path = directory / name
        if path.is_file():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                rule = parse_rule(line, base, f"{base}{name}:{number}")
                if rule:
                    rules.append(rule)
    return rules


def ignore_line(relative: str, is_dir: bool) -> str:
    """The `.kineticignore` line (in the root) that leaves out exactly `relative`.

    Example:
        ```python
        ignore_line("data/big run.bin", is_dir=False)  # "/data/big run.bin"
        ```
    """
    escaped = re.sub(r"([*?\[\\])", r"\\\1", relative)
    escaped = re.sub(r" $", r"\\ ", escaped)
    return "/" + escaped + ("/" if is_dir else "")


def never_shipped_name(relative: str, is_dir: bool) -> str | None:
    """Why the file or directory at root-relative `relative` is never shipped, by its name alone.

    Pure: the virtualenv and content rules are `never_shipped` and `credential_content`.
    """
    parts = relative.split("/")
    name = parts[-1]
    if name in _NEVER_DIRS and (is_dir or name == ".git"):
        return _NEVER_DIRS[name]
    if is_dir:
        return None
    lower = name.lower()
    if lower == ".env" or lower.startswith(".env."):
        return "environment files can hold secrets and are never shipped"
    if lower in _CREDENTIAL_FILES:
        return _CREDENTIAL_FILES[lower]
    if lower.endswith(_SECRET_SUFFIXES):
        return "key and certificate files are never shipped"
    if _SSH_KEY.fullmatch(lower):
        return "SSH private keys (id_* without .pub) are never shipped"
    if lower == "config.json" and parts[-2:-1] == [".docker"]:
        return "Docker's config.json holds registry credentials and is never shipped"
    if _KUBECONFIG_NAME.fullmatch(lower):
        return "kubeconfig files hold cluster credentials and are never shipped"
    if _DATABASE.fullmatch(lower):
        return "database files (SQLite and its -wal/-shm journals) are never shipped"
    return None


def credential_content(relative: str, head: bytes, complete: bool) -> str | None:
    """Why a file is never shipped, judged by its first bytes (`complete`: `head` is all of it).

    Decides private keys (a PEM or OpenSSH private-key header first), kubeconfigs
    holding a token or client key, and Google credential JSON.
    """
    if _PRIVATE_KEY.match(head):
        return "it starts with a private-key header (PEM or OpenSSH); keys are never shipped"
    if _KUBECONFIG_KIND.search(head) and _KUBECONFIG_SECRET.search(head):
        return "a kubeconfig holding a token or a client key is never shipped"
    if complete and relative.lower().endswith(".json") and _google_credentials(head):
        return (
            "a Google credentials file is never shipped; pods authenticate with their "
            "service account (Workload Identity) or the cluster block's credentials"
        )
    return None


def _google_credentials(content: bytes) -> bool:
    try:
        parsed = json.loads(content)
    except ValueError:
        return False
    return isinstance(parsed, dict) and (
        parsed.get("type") in _CREDENTIAL_TYPES or "private_key" in parsed
    )


def never_shipped(path: str, relative: str, is_dir: bool) -> str | None:
    """Why `path` is never shipped by its name or, for a directory, by being a virtualenv."""
    reason = never_shipped_name(relative, is_dir)
    if reason is None and is_dir and os.path.isfile(os.path.join(path, "pyvenv.cfg")):
        return "a virtualenv (it holds pyvenv.cfg) is never shipped; the image has the packages"
    return reason


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


@dataclass(frozen=True)
class PackageFile:
    """A file the code archive holds: its name there, where its bytes are read, its stat.

    `path` is the file itself or, for a symlink, its target (always inside the root).
    """

    relative: str
    path: Path
    size: int
    executable: bool
    # Its mtime and ctime (ns) when listed: any write since changes the ctime.
    stamp: tuple[int, int] = (0, 0)


def git_listing(root: Path) -> list[str] | None:
    """The root-relative paths git lists under `root`: tracked files and untracked ones it
    does not ignore (a nested repository as `name/`). None when git is not installed, `root`
    is not in a checkout, or git lists nothing (`root` itself is ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root,
            capture_output=True,
            check=False,
        )
    except OSError:
        return None
    if listed.returncode != 0:
        logger.debug("Walking %s: git ls-files: %s", root, listed.stderr.decode(errors="replace"))
        return None
    names = sorted({os.fsdecode(name) for name in listed.stdout.split(b"\0") if name})
    return names or None


def _listed_tree(names: list[str]) -> dict[str, set[str]]:
    """Directory (`""` or `"a/b/"`) to the names git lists in it; a directory git lists whole
    (a nested repository) is not a key, so it is walked."""
    tree: dict[str, set[str]] = {"": set()}
    for name in names:
        parts = name.rstrip("/").split("/")
        base = ""
        for part in parts[:-1]:
            tree.setdefault(base, set()).add(part)
            base += part + "/"
        tree.setdefault(base, set()).add(parts[-1])
    return tree


_Child = tuple[str, os.stat_result]


def _children(directory: str, base: str, tree: dict[str, set[str]] | None) -> list[_Child]:
    """(name, lstat) of a directory's entries, from git's list or the disk, sorted."""
    if tree is not None and base in tree:
        children = []
        for name in sorted(tree[base]):
            try:
                children.append((name, os.lstat(os.path.join(directory, name))))
            except OSError:  # in git's index, deleted from the working tree
                continue
        return children
    with os.scandir(directory) as entries:
        found = []
        for entry in entries:
            try:
                found.append((entry.name, entry.stat(follow_symlinks=False)))
            except OSError:  # gone since the directory was read
                continue
    return sorted(found, key=lambda child: child[0])


def _symlink_target(real_root: Path, path: str) -> tuple[Path, str | None]:
    """Where a symlink leads, and why it is not shipped (None: a file inside the root)."""
    target = Path(os.path.realpath(path))
    if not target.is_relative_to(real_root):
        return target, "a symlink leading outside the package root is never followed"
    if target.is_dir():
        return target, "symlinks to directories are not followed (the directory ships itself)"
    inside = target.relative_to(real_root).as_posix()
    parents = inside.split("/")[:-1]
    for depth in range(len(parents)):
        reason = never_shipped_name("/".join(parents[: depth + 1]), True)
        if reason:
            return target, f"its target {inside}: {reason}"
    reason = never_shipped_name(inside, False)
    return target, f"its target {inside}: {reason}" if reason else None


def iter_package_files(root: Path, extra_excludes: Collection[str] = ()) -> Iterator[PackageFile]:
    """Files under `root` that go into the code archive, sorted by relative path.

    Decided from names and `stat` alone (no file is read but ignore files);
    `credential_content` is the reader's check. `extra_excludes` are root-relative
    paths (files or directories) left out too, such as local `Data` that travels
    through the data cache instead.
    """
    listing = git_listing(root)
    tree = None if listing is None else _listed_tree(listing)
    # In a checkout git has applied every .gitignore (and the global excludes) already.
    rule_files = IGNORE_FILES if tree is None else (IGNORE_FILE,)
    real_root = root.resolve()
    defaults = [r for r in (parse_rule(p, source="default") for p in DEFAULT_EXCLUDES) if r]
    stack: list[tuple[str, list[Rule]]] = [("", defaults)]
    found: list[PackageFile] = []
    while stack:
        base, inherited = stack.pop()
        directory = os.path.join(root, base)
        rules = inherited + _rules_in(Path(directory), base, rule_files)
        for name, status in _children(directory, base, tree):
            path = os.path.join(directory, name)
            relative = base + name
            is_dir, is_link = stat.S_ISDIR(status.st_mode), stat.S_ISLNK(status.st_mode)
            reason = never_shipped(path, relative, is_dir)
            source = None
            if reason is None and is_link:
                source, reason = _symlink_target(real_root, path)
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
                _log_left_out(Path(path), relative, is_dir, reason)
            elif is_dir:
                stack.append((relative + "/", rules))
            else:
                if source is not None:
                    try:
                        status = os.stat(source)
                    except OSError:
                        continue
                if stat.S_ISREG(status.st_mode):
                    executable = bool(status.st_mode & 0o111)
                    where = source or Path(path)
                    stamp = (status.st_mtime_ns, status.st_ctime_ns)
                    found.append(PackageFile(relative, where, status.st_size, executable, stamp))
    found.sort(key=lambda f: f.relative)
    yield from found

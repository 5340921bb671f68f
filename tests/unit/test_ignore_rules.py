"""Which files the code archive ships: gitignore-syntax rules and the never-shipped set."""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

import pytest

from kinetic_prefect.launch.packaging import build_context_zip

SERVICE_ACCOUNT = {
    "type": "service_account",
    "project_id": "p",
    "private_key_id": "k",
    "private_key": "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    "client_email": "sa@p.iam.gserviceaccount.com",
}


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


def _shipped(root: Path) -> set[str]:
    archive = build_context_zip(root)
    return set(zipfile.ZipFile(archive.path).namelist())


def _case(name: str, files: dict[str, str], shipped: set[str]) -> object:
    return pytest.param(files, shipped, id=name)


GITIGNORE_SYNTAX = [
    _case(
        "unanchored pattern matches at any depth",
        {".gitignore": "*.log\n", "a.log": "", "sub/b.log": "", "m.py": ""},
        {".gitignore", "m.py"},
    ),
    _case(
        "negation re-includes a file an earlier pattern excluded",
        {".gitignore": "*.csv\n!keep.csv\n", "keep.csv": "", "drop.csv": ""},
        {".gitignore", "keep.csv"},
    ),
    _case(
        "trailing slash matches directories only",
        {".gitignore": "out/\n", "out/a": "", "sub/out/b": "", "x/out": ""},
        {".gitignore", "x/out"},
    ),
    _case(
        "leading slash anchors to the ignore file's directory",
        {".gitignore": "/data\n", "data/a": "", "pkg/data/b": ""},
        {".gitignore", "pkg/data/b"},
    ),
    _case(
        "inner slash anchors too",
        {".gitignore": "pkg/gen\n", "pkg/gen": "", "x/pkg/gen": ""},
        {".gitignore", "x/pkg/gen"},
    ),
    _case(
        "double star matches any number of directories",
        {
            ".gitignore": "**/tmp\nlogs/**\na/**/z.txt\n",
            "tmp/1": "",
            "deep/er/tmp": "",
            "logs/today/x": "",
            "a/z.txt": "",
            "a/b/c/z.txt": "",
            "a/b/y.txt": "",
            "logs.txt": "",
        },
        {".gitignore", "a/b/y.txt", "logs.txt"},
    ),
    _case(
        "question mark and character class",
        {".gitignore": "run?.txt\nckpt_[0-8]\n", "run1.txt": "", "run10.txt": "", "ckpt_3": ""}
        | {"ckpt_9": ""},
        {".gitignore", "run10.txt", "ckpt_9"},
    ),
    _case(
        "comments, blank lines and escaped leading characters",
        {".gitignore": "# a comment\n\n\\#hash\n\\!bang\n", "#hash": "", "!bang": "", "ok": ""},
        {".gitignore", "ok"},
    ),
    _case(
        "nested gitignore applies only below its directory",
        {"sub/.gitignore": "*.txt\n/only\n", "sub/a.txt": "", "sub/only": "", "sub/x/only": ""}
        | {"b.txt": ""},
        {"sub/.gitignore", "sub/x/only", "b.txt"},
    ),
    _case(
        "deeper ignore file overrides a shallower one",
        {".gitignore": "*.txt\n", "sub/.gitignore": "!keep.txt\n", "sub/keep.txt": "", "a.txt": ""},
        {".gitignore", "sub/.gitignore", "sub/keep.txt"},
    ),
    _case(
        "kineticignore excludes and re-includes what gitignore leaves out",
        {".gitignore": "data/\n", ".kineticignore": "!data/\nnotes.md\n", "data/d.csv": ""}
        | {"notes.md": ""},
        {".gitignore", ".kineticignore", "data/d.csv"},
    ),
    _case(
        "a file inside an excluded directory cannot be re-included",
        {".gitignore": "build/\n!build/keep.py\n", "build/keep.py": ""},
        {".gitignore"},
    ),
    _case(
        "default exclusions can be re-included",
        {".kineticignore": "!node_modules/\n", "node_modules/m.js": "", "x.pyc": ""},
        {".kineticignore", "node_modules/m.js"},
    ),
]


@pytest.mark.parametrize(("files", "shipped"), GITIGNORE_SYNTAX)
def test_ignore_files_follow_gitignore_syntax(tmp_path: Path, files, shipped):
    root = _files(tmp_path, files)

    assert _shipped(root) == shipped


NEVER_SHIPPED = [
    ".prefect/prefect.db",
    ".prefect/prefect.db-wal",
    ".kinetic/code-cache/x.zip",
    ".git/HEAD",
    "sub/.git",
    ".env",
    ".env.production",
    "certs/server.pem",
    "tls.key",
    "store.p12",
    "app.db",
    "cache.sqlite",
    "cache.sqlite3",
    "journal-wal",
    "journal-shm",
    "pkg/__pycache__/m.cpython-311.pyc",
    "myenv/pyvenv.cfg",
    "myenv/lib/site.py",
]


def test_never_shipped_files_stay_out_even_when_an_ignore_file_reincludes_them(tmp_path: Path):
    reinclude = "\n".join(f"!{name}" for name in NEVER_SHIPPED) + "\n!.prefect/\n!*.db\n!.env\n"
    root = _files(tmp_path, {name: "x" for name in NEVER_SHIPPED} | {"main.py": ""})
    (root / ".kineticignore").write_text(reinclude)

    assert _shipped(root) == {".kineticignore", "main.py"}


@pytest.mark.parametrize(
    "content",
    [
        SERVICE_ACCOUNT,
        {"type": "authorized_user", "client_id": "c", "refresh_token": "r"},
        {"private_key": "-----BEGIN RSA PRIVATE KEY-----"},
    ],
    ids=["service_account", "authorized_user", "private_key"],
)
def test_credential_json_is_recognised_by_content_whatever_its_name(tmp_path: Path, content):
    root = _files(tmp_path, {"config/settings.json": json.dumps(content), "main.py": ""})

    assert _shipped(root) == {"main.py"}


def test_ordinary_json_files_are_shipped(tmp_path: Path):
    root = _files(
        tmp_path,
        {
            "cfg.json": json.dumps({"type": "model", "lr": 0.1}),
            "list.json": "[1, 2]",
            "broken.json": "{not json",
        },
    )

    assert _shipped(root) == {"cfg.json", "list.json", "broken.json"}


def test_demo_state_and_a_service_account_key_never_reach_the_archive_and_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    root = _files(
        tmp_path,
        {
            "pyproject.toml": "[project]\nname = 'demo'\n",
            ".prefect/prefect.db": "SQLite format 3",
            ".prefect/prefect.db-wal": "wal",
            "sa-key.json": json.dumps(SERVICE_ACCOUNT),
            "flows/train.py": "",
        },
    )
    caplog.set_level(logging.DEBUG, logger="prefect.kinetic_prefect.launch.packaging")

    shipped = _shipped(root)

    assert shipped == {"pyproject.toml", "flows/train.py"}
    left_out = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(".prefect/" in m and "prefect.db-wal" in m and "SQLite" in m for m in left_out)
    assert any("sa-key.json" in m and "credentials" in m for m in left_out)


def test_same_content_gives_the_same_bytes_whatever_the_creation_order_and_times(
    tmp_path: Path,
):
    files = {"b/2.py": "two", "a/1.py": "one", "c.txt": "three"}
    first = _files(tmp_path / "first", files)
    second = _files(tmp_path / "second", dict(reversed(files.items())))
    for path in second.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))

    archive = build_context_zip(first)

    assert build_context_zip(second).path.read_bytes() == archive.path.read_bytes()
    assert zipfile.ZipFile(archive.path).namelist() == ["a/1.py", "b/2.py", "c.txt"]


def test_local_data_passed_to_a_task_is_left_out_of_the_archive(tmp_path: Path):
    root = _files(tmp_path, {"datasets/big.bin": "x", "datasets2/keep": "", "m.py": ""})

    archive = build_context_zip(root, ("datasets",))

    assert set(zipfile.ZipFile(archive.path).namelist()) == {"datasets2/keep", "m.py"}

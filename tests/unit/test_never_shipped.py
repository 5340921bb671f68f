"""Decision tables: what never ships, which roots are refused, what an oversize archive says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kinetic_prefect.launch.ignore import (
    PackageFile,
    credential_content,
    ignore_line,
    never_shipped_name,
    parse_rule,
)
from kinetic_prefect.launch.packaging import ArchiveLimits, oversize_report, refused_root

OPENSSH_KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n"
KUBECONFIG = b"""apiVersion: v1
kind: Config
clusters:
- name: prod
  cluster: {server: "https://1.2.3.4"}
users:
- name: admin
  user:
    %s
"""

# (root-relative path, is a directory, never shipped?)
NAMES = [
    ("id_rsa", False, True),
    ("keys/id_ed25519", False, True),
    ("id_ecdsa_sk", False, True),
    ("ID_RSA", False, True),
    ("id_rsa.pub", False, False),
    ("id_map.py", False, False),
    ("putty.ppk", False, True),
    (".ssh", True, True),
    ("home/.ssh", True, True),
    (".netrc", False, True),
    ("_netrc", False, True),
    (".envrc", False, True),
    (".pypirc", False, True),
    (".npmrc", False, True),
    (".git-credentials", False, True),
    (".aws", True, True),
    (".kube", True, True),
    (".gnupg", True, True),
    (".docker/config.json", False, True),
    ("conf/config.json", False, False),
    (".docker/daemon.json", False, False),
    ("kubeconfig", False, True),
    ("deploy/kubeconfig.yaml", False, True),
    ("prod.kubeconfig", False, True),
    ("kubeconfig_helpers.py", False, False),
    (".env", False, True),
    (".env.local", False, True),
    ("environment.py", False, False),
    ("tls.pem", False, True),
    ("server.key", False, True),
    ("store.p12", False, True),
    ("app.db", False, True),
    (".git", False, True),
    (".git", True, True),
    (".prefect", True, True),
    ("__pycache__", True, True),
    ("aws", True, False),
    ("pkg/model.py", False, False),
    ("README.md", False, False),
]


@pytest.mark.parametrize(("relative", "is_dir", "never"), NAMES, ids=[n[0] for n in NAMES])
def test_never_shipped_by_name(relative: str, is_dir: bool, never: bool):
    assert (never_shipped_name(relative, is_dir) is not None) is never


# (name, first bytes, whole file?, never shipped?)
CONTENTS = [
    ("notes.txt", OPENSSH_KEY, True, True),
    ("deploy/key", b"-----BEGIN RSA PRIVATE KEY-----\nMIIE\n", True, True),
    ("k", b"\xef\xbb\xbf\n  -----BEGIN ENCRYPTED PRIVATE KEY-----\n", True, True),
    ("k.asc", b"-----BEGIN PGP PRIVATE KEY BLOCK-----\n", False, True),
    ("cert.crt", b"-----BEGIN CERTIFICATE-----\nMIIB\n", True, False),
    ("doc.md", b"# Keys\n\n-----BEGIN RSA PRIVATE KEY-----\n", True, False),
    ("cluster.yaml", KUBECONFIG % b"token: abc123", True, True),
    ("cluster.yaml", KUBECONFIG % b"client-key-data: LS0tLS1CRUdJTg==", True, True),
    ("cluster.yaml", KUBECONFIG % b"exec: {command: gke-gcloud-auth-plugin}", True, False),
    ("manifest.yaml", b"kind: Deployment\nspec:\n  token: x\n", True, False),
    ("sa.json", json.dumps({"type": "service_account"}).encode(), True, True),
    ("sa.json", json.dumps({"type": "service_account"}).encode(), False, False),
    ("cfg.json", json.dumps({"type": "model"}).encode(), True, False),
    ("m.py", b"print('hello')\n", True, False),
]


@pytest.mark.parametrize(
    ("relative", "head", "complete", "never"),
    CONTENTS,
    ids=[f"{n[0]}-{i}" for i, n in enumerate(CONTENTS)],
)
def test_never_shipped_by_content(relative: str, head: bytes, complete: bool, never: bool):
    assert (credential_content(relative, head, complete) is not None) is never


HOME, TEMP = Path("/home/ada"), Path("/tmp")
# (root, refused as)
ROOTS = [
    (Path("/"), "filesystem root"),
    (HOME, "home directory"),
    (Path("/home"), "holds your home directory"),
    (TEMP, "temporary directory"),
    (HOME / "projects" / "sweep", None),
    (TEMP / "pytest-1" / "proj", None),
    (Path("/srv/code"), None),
]


@pytest.mark.parametrize(("root", "refused"), ROOTS, ids=[str(r[0]) for r in ROOTS])
def test_roots_too_broad_to_ship(root: Path, refused: str | None):
    what = refused_root(root, HOME, TEMP)

    assert what is None if refused is None else refused in (what or "")


@pytest.mark.parametrize(
    ("relative", "is_dir"),
    [("data/big.bin", False), ("ckpt", True), ("odd [1]*?.bin", False), ("trail ", False)],
)
def test_the_suggested_ignore_line_leaves_out_exactly_that_path(relative: str, is_dir: bool):
    rule = parse_rule(ignore_line(relative, is_dir))

    assert rule is not None
    assert rule.matches(relative, is_dir)
    assert not rule.matches("other/" + relative, is_dir)


def _files(*sizes: tuple[str, int]) -> list[PackageFile]:
    return [PackageFile(name, Path(name), size, False) for name, size in sizes]


def test_an_archive_within_its_limits_has_no_report():
    files = _files(("a.py", 10), ("data/b.csv", 90))

    assert oversize_report(Path("/p"), files, ArchiveLimits(100, 2)) is None


def test_an_archive_over_its_size_names_the_largest_files_and_directories_with_their_lines():
    files = _files(("m.py", 1_000), ("data/run/weights.bin", 300_000_000), ("data/x.csv", 5))

    report = oversize_report(Path("/p"), files, ArchiveLimits(200_000_000, 100)) or ""

    assert "300.0 MB, over the 200 MB limit (code_archive_max_mb)" in report
    assert re.search(r"300\.0 MB  data/ \(2 files\)  ->  /data/\n", report)
    assert re.search(r"300\.0 MB  data/run/weights\.bin  ->  /data/run/weights\.bin\n", report)
    assert "/p/.kineticignore" in report


def test_an_archive_over_its_file_count_names_the_fullest_directories():
    files = _files(*[(f"cache/{i}.json", 1) for i in range(5)], ("m.py", 1))

    report = oversize_report(Path("/p"), files, ArchiveLimits(10**9, 3)) or ""

    assert "6 files, over the 3 file limit (code_archive_max_files)" in report
    assert "cache/ (5 files)  ->  /cache/" in report

"""`kubectl` and `gcloud` for the emulated cluster and GCS: the commands the docs tell users to run.

The walk-through tests run the docs' command lines as written; `kubectl` is not
installed here, so `install_kubectl(bin_dir)` puts this stand-in on the PATH. It
reads the kubeconfig kubectl would (`$KUBECONFIG`, its current context's server
and bearer token) and makes the requests kubectl makes:

- `kubectl apply -n NS -f FILE` (`-f -`: standard input): each document is
  created, or updated when it exists (client-side apply without the
  last-applied annotation);
- `kubectl create rolebinding NAME -n NS --role ROLE (--user U | --serviceaccount NS:SA)`;
- `kubectl annotate serviceaccount NAME -n NS KEY=VALUE [--overwrite]`.

`gcloud` (`install_gcloud(bin_dir)`) knows `container clusters get-credentials`
(writes the kubeconfig `$KUBECONFIG` names, for the cluster at
`$KP_CLUSTER_SERVER` with the token `$KP_USER_TOKEN`, as gcloud writes one for
your Google account), `iam service-accounts create`, and the IAM bindings
`storage buckets add-iam-policy-binding` and `iam service-accounts
add-iam-policy-binding`: these are appended as JSON lines to `$KP_GCLOUD_LOG`,
which the test applies to its IAM proxy (tests/support/gcs_iam.py).

Anything else fails, so a doc that starts using another command fails its test
until the stand-in learns it. The test cluster's own set-up (an admin applying
rbac.yaml) goes through the same functions, with a `Target` of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# kind -> (API path prefix, plural, namespaced)
_KINDS = {
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Secret": ("/api/v1", "secrets", True),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "ResourceFlavor": ("/apis/kueue.x-k8s.io/v1beta2", "resourceflavors", False),
    "ClusterQueue": ("/apis/kueue.x-k8s.io/v1beta2", "clusterqueues", False),
    "LocalQueue": ("/apis/kueue.x-k8s.io/v1beta2", "localqueues", True),
}


class KubectlError(Exception):
    pass


def kubeconfig(server: str, user: str, token: str, context: str = "kmock") -> dict[str, Any]:
    """A kubeconfig with one cluster, user and context: `user` reaches `server` with `token`."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
    }


@dataclass(frozen=True)
class Target:
    """An API server and the bearer token to reach it with."""

    server: str
    token: str

    @classmethod
    def from_kubeconfig(cls) -> Target:
        """The current context's server and token, from the kubeconfig kubectl would read."""
        path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(
            Path.home() / ".kube" / "config"
        )
        config = json.loads(Path(path).read_text())
        context = next(c for c in config["contexts"] if c["name"] == config["current-context"])
        cluster = next(c for c in config["clusters"] if c["name"] == context["context"]["cluster"])
        user = next(u for u in config["users"] if u["name"] == context["context"]["user"])
        return cls(cluster["cluster"]["server"].rstrip("/"), user["user"].get("token", ""))

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header(
            "Content-Type",
            "application/merge-patch+json" if method == "PATCH" else "application/json",
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


def _collection(kind: str, namespace: str, api_version: str | None = None) -> str:
    """The collection of `kind`; at the document's `apiVersion` when given, as kubectl asks."""
    if kind not in _KINDS:
        raise KubectlError(f'error: the stand-in kubectl cannot apply kind "{kind}"')
    prefix, plural, namespaced = _KINDS[kind]
    if api_version is not None:
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"


def _check(status: int, answer: Any, what: str) -> None:
    if status >= 400:
        message = answer.get("message", answer) if isinstance(answer, dict) else answer
        raise KubectlError(f"Error from server ({what}): {message}")


def manifests(text: str) -> list[dict[str, Any]]:
    """The documents of a YAML file, as `kubectl apply -f` reads them."""
    import yaml

    return [doc for doc in yaml.safe_load_all(text) if doc]


def apply(target: Target, namespace: str, docs: list[dict[str, Any]]) -> list[str]:
    """`kubectl apply -n namespace -f -` of `docs`: created, or updated when they exist."""
    done = []
    for doc in docs:
        doc = json.loads(json.dumps(doc))  # the caller's copy stays as it was
        kind, name = doc["kind"], doc["metadata"]["name"]
        collection = _collection(kind, namespace, doc.get("apiVersion"))
        if _KINDS[kind][2]:
            doc["metadata"]["namespace"] = namespace
        status, answer = target.request("POST", collection, doc)
        verb = "created"
        if status == 409:
            status, answer = target.request("PATCH", f"{collection}/{name}", doc)
            verb = "configured"
        _check(status, answer, f"{kind} {name}")
        done.append(f"{kind.lower()}/{name} {verb}")
    return done


def create_rolebinding(
    target: Target, namespace: str, name: str, role: str, users: list[str], accounts: list[str]
) -> str:
    subjects = [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": u} for u in users]
    for account in accounts:
        account_namespace, _, account_name = account.partition(":")
        subjects.append(
            {"kind": "ServiceAccount", "name": account_name, "namespace": account_namespace}
        )
    body = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
        "subjects": subjects,
    }
    status, answer = target.request("POST", _collection("RoleBinding", namespace), body)
    _check(status, answer, f"RoleBinding {name}")
    return f"rolebinding.rbac.authorization.k8s.io/{name} created"


def annotate(
    target: Target, namespace: str, kind: str, name: str, pairs: list[str], overwrite: bool
) -> str:
    if kind not in {"serviceaccount", "sa"}:
        raise KubectlError(f"error: the stand-in kubectl cannot annotate {kind}")
    path = f"{_collection('ServiceAccount', namespace)}/{name}"
    status, current = target.request("GET", path)
    _check(status, current, f"ServiceAccount {name}")
    existing = (current.get("metadata") or {}).get("annotations") or {}
    annotations = dict(pair.split("=", 1) for pair in pairs)
    clash = [k for k in annotations if k in existing and existing[k] != annotations[k]]
    if clash and not overwrite:
        raise KubectlError(f"error: --overwrite is false but found the annotation {clash[0]}")
    status, answer = target.request("PATCH", path, {"metadata": {"annotations": annotations}})
    _check(status, answer, f"ServiceAccount {name}")
    return f"serviceaccount/{name} annotated"


def kubectl(argv: list[str], target: Target | None = None) -> int:
    """Run one kubectl command line against `target` (default: the kubeconfig's)."""
    parser = argparse.ArgumentParser(prog="kubectl")
    parser.add_argument("-n", "--namespace", default="default")
    sub = parser.add_subparsers(dest="command", required=True)
    apply_parser = sub.add_parser("apply")
    apply_parser.add_argument("-n", "--namespace", dest="sub_namespace")
    apply_parser.add_argument("-f", "--filename", required=True)
    create = sub.add_parser("create").add_subparsers(dest="what", required=True)
    binding = create.add_parser("rolebinding")
    binding.add_argument("name")
    binding.add_argument("-n", "--namespace", dest="sub_namespace")
    binding.add_argument("--role", required=True)
    binding.add_argument("--user", action="append", default=[])
    binding.add_argument("--serviceaccount", action="append", default=[])
    annotate_parser = sub.add_parser("annotate")
    annotate_parser.add_argument("kind")
    annotate_parser.add_argument("name")
    annotate_parser.add_argument("pairs", nargs="+")
    annotate_parser.add_argument("-n", "--namespace", dest="sub_namespace")
    annotate_parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    namespace = getattr(args, "sub_namespace", None) or args.namespace
    target = target or Target.from_kubeconfig()
    try:
        if args.command == "apply":
            text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
            lines = apply(target, namespace, manifests(text))
        elif args.command == "create":
            lines = [
                create_rolebinding(
                    target, namespace, args.name, args.role, args.user, args.serviceaccount
                )
            ]
        else:
            lines = [annotate(target, namespace, args.kind, args.name, args.pairs, args.overwrite)]
    except KubectlError as exc:
        print(exc, file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def _gcloud_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gcloud")
    groups = parser.add_subparsers(dest="group", required=True)
    container = groups.add_parser("container").add_subparsers(dest="what", required=True)
    clusters = container.add_parser("clusters").add_subparsers(dest="verb", required=True)
    credentials = clusters.add_parser("get-credentials")
    credentials.add_argument("cluster")
    credentials.add_argument("--zone")
    credentials.add_argument("--region")
    credentials.add_argument("--project", required=True)
    storage = groups.add_parser("storage").add_subparsers(dest="what", required=True)
    buckets = storage.add_parser("buckets").add_subparsers(dest="verb", required=True)
    bucket_binding = buckets.add_parser("add-iam-policy-binding")
    bucket_binding.add_argument("bucket")
    bucket_binding.add_argument("--member", required=True)
    bucket_binding.add_argument("--role", required=True)
    iam = groups.add_parser("iam").add_subparsers(dest="what", required=True)
    accounts = iam.add_parser("service-accounts").add_subparsers(dest="verb", required=True)
    create = accounts.add_parser("create")
    create.add_argument("name")
    create.add_argument("--project", required=True)
    account_binding = accounts.add_parser("add-iam-policy-binding")
    account_binding.add_argument("account")
    account_binding.add_argument("--member", required=True)
    account_binding.add_argument("--role", required=True)
    return parser


def gcloud(argv: list[str]) -> int:
    args = _gcloud_parser().parse_args(argv)
    if args.group == "container":
        name = f"gke_{args.project}_{args.zone or args.region}_{args.cluster}"
        config = kubeconfig(
            os.environ["KP_CLUSTER_SERVER"], name, os.environ["KP_USER_TOKEN"], context=name
        )
        Path(os.environ["KUBECONFIG"]).write_text(json.dumps(config))
        print(f"kubeconfig entry generated for {args.cluster}.")
        return 0
    if args.group == "storage":
        if not args.bucket.startswith("gs://"):
            print(f"ERROR: {args.bucket} is not a gs:// URL", file=sys.stderr)
            return 1
        record = {"grant": [args.bucket.removeprefix("gs://"), args.member, args.role]}
    elif args.verb == "create":
        record = {"service_account": f"{args.name}@{args.project}.iam.gserviceaccount.com"}
    else:
        record = {"account_binding": [args.account, args.member, args.role]}
    with open(os.environ["KP_GCLOUD_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")
    print("Created service account." if "service_account" in record else "Updated IAM policy.")
    return 0


def _install(bin_dir: Path, command: str) -> Path:
    """Put a stand-in on a PATH directory, run by this interpreter; returns its path."""
    root = Path(__file__).resolve().parents[2]
    script = bin_dir / command
    bin_dir.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        f"from tests.support.standins import {command}\n"
        f"sys.exit({command}(sys.argv[1:]))\n"
    )
    script.chmod(0o755)
    return script


def install_kubectl(bin_dir: Path) -> Path:
    return _install(bin_dir, "kubectl")


def install_gcloud(bin_dir: Path) -> Path:
    return _install(bin_dir, "gcloud")

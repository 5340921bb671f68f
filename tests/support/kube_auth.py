"""Authentication, RBAC authorization and ServiceAccount admission, as kube-apiserver does them.

`ClusterEmulator` (tests/support/kube_emulator.py) asks this module who sent a
request and whether RBAC lets them do it, and answers as the API server would:

- **Authentication** from the bearer token: a service account's token
  (`tests.support.pod_env.service_account_token`, valid while the account exists)
  is `system:serviceaccount:NS:NAME` in the groups `system:serviceaccounts`,
  `system:serviceaccounts:NS` and `system:authenticated`; each token in `Tokens`
  is a named user (the tests' kubeconfig user, an admin in `system:masters`).
  The cluster's own controllers are in `system:masters`. Anything else is 401.
- **Authorization**: `system:masters` may do anything; everyone else gets what the
  stored Roles, ClusterRoles, RoleBindings and ClusterRoleBindings grant, matched
  as the RBAC authorizer does (apiGroups, resources and `resource/subresource`,
  resourceNames, verbs, `*`, nonResourceURLs; subjects User, Group and
  ServiceAccount). The bootstrap policy that lets any authenticated user create
  SelfSubjectAccessReviews and read discovery (`BOOTSTRAP_POLICY`) is stored
  with the rest. A denial is the API server's 403 Status, word for word.
- **SelfSubjectAccessReview**: answered by the same authorizer, with the
  `status.allowed` / `status.reason` the API writes.
- **ServiceAccount admission**: a pod whose `serviceAccountName` does not exist
  in its namespace is refused with the admission plugin's 403 (`default` exists
  in every namespace, as Kubernetes creates it).

Not emulated: aggregated ClusterRoles, escalation checks on writing RBAC
objects, impersonation, and every other authorizer and admission plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVICE_ACCOUNT_PREFIX = "serviceaccount:"
MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
RBAC_GROUP = "rbac.authorization.k8s.io"
# The stored objects RBAC decides from, and the service accounts, by plural.
POLICY_PLURALS = frozenset(
    {"roles", "rolebindings", "clusterroles", "clusterrolebindings", "serviceaccounts"}
)
_WATCH_VALUES = {"true", "1"}

# Part of Kubernetes' bootstrap policy (plugin/pkg/auth/authorizer/rbac/bootstrappolicy):
# what every authenticated user may do.
BOOTSTRAP_POLICY: list[dict[str, Any]] = [
    {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "system:basic-user"},
        "rules": [
            {
                "apiGroups": ["authorization.k8s.io"],
                "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                "verbs": ["create"],
            },
            {
                "apiGroups": ["authentication.k8s.io"],
                "resources": ["selfsubjectreviews"],
                "verbs": ["create"],
            },
        ],
    },
    {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "system:discovery"},
        "rules": [
            {
                "nonResourceURLs": [
                    "/api",
                    "/api/*",
                    "/apis",
                    "/apis/*",
                    "/healthz",
                    "/livez",
                    "/openapi",
                    "/openapi/*",
                    "/readyz",
                    "/version",
                    "/version/",
                ],
                "verbs": ["get"],
            }
        ],
    },
    *(
        {
            "apiVersion": f"{RBAC_GROUP}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": AUTHENTICATED}],
        }
        for name in ("system:basic-user", "system:discovery")
    ),
]


@dataclass(frozen=True)
class User:
    """Who sent a request, as the authenticator says."""

    name: str
    groups: tuple[str, ...] = (AUTHENTICATED,)


CONTROLLERS = User("system:kube-controller-manager", (MASTERS, AUTHENTICATED))


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do, as the authorizer sees it (authorizer.Attributes)."""

    user: User
    verb: str
    path: str = ""
    resource_request: bool = True
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def qualified_resource(self) -> str:
        """`jobs.batch`, or `pods` in the core group (schema.GroupResource.String())."""
        return f"{self.resource}.{self.api_group}" if self.api_group else self.resource


def request_verb(method: str, name: str | None, params: dict[str, str]) -> str:
    """The authorizer's verb for an HTTP method on a collection (no name) or an object."""
    method = method.upper()
    if method in {"GET", "HEAD"}:
        if params.get("watch", "").lower() in _WATCH_VALUES:
            return "watch"
        return "get" if name else "list"
    if method == "DELETE":
        return "delete" if name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def authenticate(token: str | None, tokens: dict[str, User], account_exists: Any) -> User | None:
    """The user a bearer token stands for; None is 401 (no, unknown or orphaned token)."""
    if not token:
        return None
    if token in tokens:
        return tokens[token]
    if token.startswith(SERVICE_ACCOUNT_PREFIX):
        namespace, _, account = token.removeprefix(SERVICE_ACCOUNT_PREFIX).partition(":")
        if namespace and account and account_exists(namespace, account):
            return User(
                f"system:serviceaccount:{namespace}:{account}",
                ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
            )
    return None


# -- RBAC ---------------------------------------------------------------------------------


def _has(values: list[str] | None, wanted: str) -> bool:
    return any(v == "*" or v == wanted for v in values or [])


def _resource_matches(rule: dict[str, Any], attrs: Attributes) -> bool:
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    for resource in rule.get("resources") or []:
        if resource == "*" or resource == combined:
            return True
        # "*/scale" means the scale subresource of every resource.
        if attrs.subresource and resource == f"*/{attrs.subresource}":
            return True
    return False


def rule_allows(rule: dict[str, Any], attrs: Attributes) -> bool:
    """rbac.RuleAllows: whether one PolicyRule grants the request."""
    if not _has(rule.get("verbs"), attrs.verb):
        return False
    if not attrs.resource_request:
        return any(
            url == "*"
            or url == attrs.path
            or (url.endswith("*") and attrs.path.startswith(url[:-1]))
            for url in rule.get("nonResourceURLs") or []
        )
    names = rule.get("resourceNames") or []
    return (
        _has(rule.get("apiGroups"), attrs.api_group)
        and _resource_matches(rule, attrs)
        and (not names or attrs.name in names)
    )


def _subject_applies(subject: dict[str, Any], user: User, binding_namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return bool(subject.get("name") == user.name)
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        # A RoleBinding's ServiceAccount subject without a namespace is in the binding's.
        namespace = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{namespace}:{subject.get('name')}"
    return False


def _describe_subject(subject: dict[str, Any], binding_namespace: str) -> str:
    if subject.get("kind") == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return f'ServiceAccount "{subject.get("name")}/{namespace}"'
    return f'{subject.get("kind")} "{subject.get("name")}"'


class Policy:
    """The RBAC objects and service accounts the emulator stores, by (plural, namespace, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}

    def record(self, plural: str, event_type: str, obj: dict[str, Any]) -> None:
        """Follow one stored change of a policy object."""
        meta = obj.get("metadata") or {}
        key = (plural, meta.get("namespace") or "", meta.get("name") or "")
        if event_type == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj

    def _of(self, plural: str, namespace: str = "") -> list[dict[str, Any]]:
        return [o for (p, ns, _), o in self.objects.items() if p == plural and ns == namespace]

    def account_exists(self, namespace: str, name: str) -> bool:
        return name == "default" or ("serviceaccounts", namespace, name) in self.objects

    def _rules(self, binding: dict[str, Any], namespace: str) -> tuple[list[Any], str]:
        """The rules a binding's roleRef names, or the RBAC error when the role is missing."""
        ref = binding.get("roleRef") or {}
        if ref.get("kind") == "ClusterRole":
            role = self.objects.get(("clusterroles", "", ref.get("name") or ""))
            missing = f'clusterrole.rbac.authorization.k8s.io "{ref.get("name")}" not found'
        else:
            role = self.objects.get(("roles", namespace, ref.get("name") or ""))
            missing = f'role.rbac.authorization.k8s.io "{ref.get("name")}" not found'
        if role is None:
            return [], missing
        return list(role.get("rules") or []), ""

    def authorize(self, attrs: Attributes) -> tuple[bool, str]:
        """(allowed, reason) as kube-apiserver's privileged-group and RBAC authorizers say."""
        if MASTERS in attrs.user.groups:
            return True, ""
        errors: list[str] = []
        bindings = [("", b) for b in self._of("clusterrolebindings")]
        if attrs.namespace:
            bindings += [(attrs.namespace, b) for b in self._of("rolebindings", attrs.namespace)]
        for namespace, binding in bindings:
            subject = next(
                (
                    s
                    for s in binding.get("subjects") or []
                    if _subject_applies(s, attrs.user, namespace)
                ),
                None,
            )
            if subject is None:
                continue
            rules, error = self._rules(binding, namespace)
            if error:
                errors.append(error)
            if any(rule_allows(rule, attrs) for rule in rules):
                ref = binding["roleRef"]
                name = binding["metadata"]["name"]
                source = f'ClusterRoleBinding "{name}"'
                if namespace:
                    source = f'RoleBinding "{name}/{namespace}"'
                return True, (
                    f'RBAC: allowed by {source} of {ref["kind"]} "{ref["name"]}" to '
                    f"{_describe_subject(subject, namespace)}"
                )
        reason = f"RBAC: [{', '.join(errors)}]" if len(errors) > 1 else ""
        if len(errors) == 1:
            reason = f"RBAC: {errors[0]}"
        return False, reason


# -- what the API server answers ----------------------------------------------------------


def status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict:
    """A `Status` object, as kube-apiserver writes errors."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def unauthorized() -> dict[str, Any]:
    return status(401, "Unauthorized", "Unauthorized")


def forbidden_message(attrs: Attributes, reason: str = "") -> str:
    """responsewriters.Forbidden's message: who cannot do what, where, and RBAC's reason."""
    user = attrs.user.name
    if not attrs.resource_request:
        what = f'User "{user}" cannot {attrs.verb} path "{attrs.path}"'
    else:
        resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
        scope = (
            f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
        )
        what = (
            f'User "{user}" cannot {attrs.verb} resource "{resource}" in API group '
            f'"{attrs.api_group}" {scope}'
        )
    return f"{what}: {reason}" if reason else what


def forbidden(resource: str, group: str, name: str, message: str) -> dict[str, Any]:
    """apierrors.NewForbidden: `pods "x" is forbidden: ...` or `jobs.batch is forbidden: ...`."""
    qualified = f"{resource}.{group}" if group else resource
    subject = f'{qualified} "{name}"' if name else qualified
    details: dict[str, Any] = {"kind": resource}
    if group:
        details["group"] = group
    if name:
        details = {"name": name, **details}
    return status(403, "Forbidden", f"{subject} is forbidden: {message}", details)


def denied(attrs: Attributes, reason: str) -> dict[str, Any]:
    """The 403 a request the authorizer denied gets."""
    if not attrs.resource_request:
        return status(403, "Forbidden", f"forbidden: {forbidden_message(attrs, reason)}")
    return forbidden(attrs.resource, attrs.api_group, attrs.name, forbidden_message(attrs, reason))


def missing_service_account(pod: dict[str, Any], namespace: str, policy: Policy) -> dict | None:
    """The ServiceAccount admission plugin's 403 for a pod whose account does not exist."""
    account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
    if policy.account_exists(namespace, account):
        return None
    meta = pod.get("metadata") or {}
    # Admission runs before the API server generates a name, so a Job controller's pod is
    # named by its generateName (`JOB-`); the test Job controller names its pods itself.
    name = meta.get("generateName") or meta.get("name") or "Unknown"
    message = (
        f"error looking up service account {namespace}/{account}: "
        f'serviceaccount "{account}" not found'
    )
    return forbidden("pods", "", name, message)


def access_review(user: User, review: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """The answer to a SelfSubjectAccessReview: its spec, and status allowed/reason."""
    spec = review.get("spec") or {}
    resource = spec.get("resourceAttributes")
    non_resource = spec.get("nonResourceAttributes")
    if resource is not None:
        attrs = Attributes(
            user=user,
            verb=resource.get("verb") or "",
            api_group=resource.get("group") or "",
            api_version=resource.get("version") or "",
            resource=resource.get("resource") or "",
            subresource=resource.get("subresource") or "",
            namespace=resource.get("namespace") or "",
            name=resource.get("name") or "",
        )
    else:
        attrs = Attributes(
            user=user,
            verb=(non_resource or {}).get("verb") or "",
            path=(non_resource or {}).get("path") or "",
            resource_request=False,
        )
    allowed, reason = policy.authorize(attrs)
    result: dict[str, Any] = {"allowed": allowed}
    if reason:
        result["reason"] = reason
    return {
        "kind": "SelfSubjectAccessReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "spec": spec,
        "status": result,
    }

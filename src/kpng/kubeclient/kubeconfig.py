"""A kubeconfig file (``kind: Config``, ``apiVersion: v1``) as typed msgspec Structs, and the one
place where msgspec's refusals become messages naming the field.

The Structs hold every field of client-go's ``clientcmd/api/v1`` types (``types.go`` of
client-go v0.37.2, the same fields since at least v0.34): the preferences, extensions, exec
plugins, auth providers, impersonation and basic-auth fields that kpng hands to
kubernetes_asyncio, as well as the plain ones it reads itself (``config.plain_kubeconfig``). So
any file kubectl reads passes, and a field that is none of them is refused, naming where it is:
client-go's decoder is not strict and would drop a misspelt ``sever:`` or ``tokenfile:``
silently, leaving kpng to fail later against the wrong server, or unauthenticated, with a
message that does not point at the typo. A field a newer client-go adds would be refused too,
until it is added here.

Every field may be null, and so may an entry of a list: Go's JSON decoding leaves the field
unset then, as these Structs do (None). ``extensions[].extension`` holds anything
(``runtime.RawExtension``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kpng.errors import field_problem


class _Fields(msgspec.Struct, forbid_unknown_fields=True):
    """Fields by client-go's names, none but those."""


class NamedExtension(_Fields):
    name: str | None = None
    extension: Any = None


Extensions = list[NamedExtension | None] | None


class Preferences(_Fields):
    colors: bool | None = None
    extensions: Extensions = None


class Cluster(_Fields, rename="kebab"):
    server: str | None = None
    tls_server_name: str | None = None
    insecure_skip_tls_verify: bool | None = None
    certificate_authority: str | None = None
    certificate_authority_data: str | None = None
    """Base64, decoded by its reader (``config._file``)."""
    proxy_url: str | None = None
    disable_compression: bool | None = None
    extensions: Extensions = None


class AuthProviderConfig(_Fields):
    name: str | None = None
    config: dict[str, str | None] | None = None


class ExecEnvVar(_Fields):
    name: str | None = None
    value: str | None = None


class ExecConfig(_Fields, rename="camel"):
    command: str | None = None
    args: list[str | None] | None = None
    env: list[ExecEnvVar | None] | None = None
    api_version: str | None = None
    install_hint: str | None = None
    provide_cluster_info: bool | None = None
    interactive_mode: str | None = None


class AuthInfo(_Fields, rename="kebab"):
    client_certificate: str | None = None
    client_certificate_data: str | None = None
    client_key: str | None = None
    client_key_data: str | None = None
    token: str | None = None
    token_file: str | None = msgspec.field(default=None, name="tokenFile")
    impersonate: str | None = msgspec.field(default=None, name="as")
    impersonate_uid: str | None = msgspec.field(default=None, name="as-uid")
    impersonate_groups: list[str | None] | None = msgspec.field(default=None, name="as-groups")
    impersonate_user_extra: dict[str, list[str | None] | None] | None = msgspec.field(
        default=None, name="as-user-extra"
    )
    username: str | None = None
    password: str | None = None
    auth_provider: AuthProviderConfig | None = None
    exec: ExecConfig | None = None
    extensions: Extensions = None


class Context(_Fields):
    cluster: str | None = None
    user: str | None = None
    namespace: str | None = None
    extensions: Extensions = None


class NamedCluster(_Fields):
    name: str | None = None
    cluster: Cluster | None = None


class NamedAuthInfo(_Fields):
    name: str | None = None
    user: AuthInfo | None = None


class NamedContext(_Fields):
    name: str | None = None
    context: Context | None = None


class Config(_Fields, rename="kebab"):
    kind: str | None = None
    api_version: str | None = msgspec.field(default=None, name="apiVersion")
    preferences: Preferences | None = None
    clusters: list[NamedCluster | None] | None = None
    users: list[NamedAuthInfo | None] | None = None
    contexts: list[NamedContext | None] | None = None
    current_context: str | None = None
    extensions: Extensions = None

    def context(self, name: str | None) -> Context | None:
        """The context called ``name`` (None: the current context), if there is one."""
        wanted = self.current_context if name is None else name
        return next((e.context for e in self.contexts or () if e and e.name == wanted), None)

    def cluster(self, name: str | None) -> Cluster | None:
        return next((e.cluster for e in self.clusters or () if e and e.name == name), None)

    def user(self, name: str | None) -> AuthInfo | None:
        return next((e.user for e in self.users or () if e and e.name == name), None)


class KubeconfigFieldError(ValueError):
    """A field of a kubeconfig that is unknown, or holds a value of the wrong type."""


_TYPE_WORDS = {
    "str": "a string",
    "bool": "true or false",
    "array": "a list",
    "object": "a mapping",
}
_ENTRIES = {"clusters": "cluster", "users": "user", "contexts": "context"}


def decode(document: object) -> Config:
    """``document`` (a kubeconfig's YAML, as a mapping) as typed; KubeconfigFieldError naming
    the field that is unknown or of the wrong type, and the entry it is in."""
    try:
        return msgspec.convert(document, Config)
    except msgspec.ValidationError as exc:
        problem = field_problem(exc)
        where = problem.dotted
        if problem.key:
            what = f'unknown field "{_join(where, problem.bad_key(document))}"'
        elif problem.unknown is not None:
            what = f'unknown field "{_join(where, problem.unknown)}"'
        elif problem.expected is not None:
            wanted = _TYPE_WORDS.get(problem.expected, f"a {problem.expected}")
            what = f'field "{where}" must be {wanted}, not {problem.value(document)!r}'
        else:
            what = f'field "{where}": {problem.detail}'
        if problem.path[:1] and problem.path[0] in _ENTRIES and len(problem.path) > 1:
            entry = _entry_name(document, problem.path)
            if entry is not None:
                what += f" (in {_ENTRIES[str(problem.path[0])]} {entry!r})"
        raise KubeconfigFieldError(what) from None


def _entry_name(document: object, path: tuple[str | int, ...]) -> object:
    """The name of the list entry ``path`` leads through (``clusters[1]``'s name)."""
    entries = document.get(path[0]) if isinstance(document, dict) else None
    index = path[1]
    if not isinstance(entries, list) or not isinstance(index, int) or index >= len(entries):
        return None
    entry = entries[index]
    return entry.get("name") if isinstance(entry, dict) else None


def _join(where: str, name: object) -> str:
    return f"{where}.{name}" if where else str(name)

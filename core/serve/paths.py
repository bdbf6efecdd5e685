"""API keys and ``tinker://`` checkpoint paths, confined to the storage root.

Path format (the SDK's ``ParsedCheckpointTinkerPath``): ``tinker://<model_id>/<kind>/<name>``,
exactly three ``/``-separated parts, ``kind`` in ``weights`` (``save_state``),
``sampler_weights`` (``save_weights_for_sampler``) or ``external_weights`` (``save_weights_external``). On disk it is
``<storage>/checkpoints/<model_id>/<kind>/<name>``. A model id is ``<session_id>:train:<n>``;
names and ids are limited to ``[A-Za-z0-9._:-]`` with no leading dot, so ``..``, absolute
paths, separators and hidden files are refused before any filesystem call, and the resolved
directory is checked to lie under the root.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ferrule import envs

__all__ = ["PathError", "CheckpointPath", "parse_tinker_path", "check_name", "load_api_keys", "KEYS_ENV"]

KEYS_ENV = "FERRULE_SERVE_API_KEYS"
KINDS = ("weights", "sampler_weights", "external_weights")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}$")


class PathError(ValueError):
    """A checkpoint name or ``tinker://`` path that is malformed or escapes the storage root."""


def check_name(name: str, what: str = "checkpoint name") -> str:
    """Return ``name`` if it is a safe single path component, else raise :class:`PathError`."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise PathError(f"{what} {name!r} is not allowed: use 1-128 characters from [A-Za-z0-9._:-], not starting "
                        "with '.' and without '..' or '/' (checkpoints live under the server's storage root).")
    return name


@dataclass(frozen=True)
class CheckpointPath:
    model_id: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def directory(self, root: Path) -> Path:
        root = Path(root).resolve()
        d = (root / "checkpoints" / self.model_id / self.kind / self.name).resolve()
        if not d.is_relative_to(root):
            raise PathError(f"{self.uri} resolves outside the storage root; refused.")
        return d


def parse_tinker_path(uri: str) -> CheckpointPath:
    """``tinker://<model_id>/<weights|sampler_weights>/<name>`` -> :class:`CheckpointPath`.

    Raises:
        PathError: another scheme, not three parts, an unknown kind, or an unsafe component.
    """
    if not isinstance(uri, str) or not uri.startswith("tinker://"):
        raise PathError(f"checkpoint path {uri!r} must start with 'tinker://' (tinker://<model_id>/weights/<name>).")
    parts = uri[len("tinker://"):].split("/")
    if len(parts) != 3:
        raise PathError(f"checkpoint path {uri!r} must have exactly three parts: tinker://<model_id>/<kind>/<name>.")
    model_id, kind, name = parts
    if kind not in KINDS:
        raise PathError(f"checkpoint path {uri!r}: kind {kind!r} is not one of {', '.join(KINDS)}.")
    return CheckpointPath(check_name(model_id, "model id"), kind, check_name(name))


def _tenant_of(key: str) -> str:
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def load_api_keys(path: str | os.PathLike | None = None, env: str | None = None) -> dict[str, str]:
    """API key -> tenant name, from a file (one ``tml-KEY [tenant]`` per line, ``#`` comments)
    and/or ``$FERRULE_SERVE_API_KEYS`` (comma-separated ``tml-KEY[=tenant]``). A key without
    a tenant name is its own tenant.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a key without the ``tml-`` prefix the SDK requires, or one key given to
            two tenants.
    """
    entries: list[tuple[str, str | None, str]] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--api-keys {path}: no such file (one 'tml-KEY [tenant]' per line).")
        for n, line in enumerate(p.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                fields = line.split()
                entries.append((fields[0], fields[1] if len(fields) > 1 else None, f"{path}:{n}"))
    raw = (envs.get(KEYS_ENV) or "") if env is None else env
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, _, tenant = item.partition("=")
        entries.append((key.strip(), tenant.strip() or None, KEYS_ENV))
    keys: dict[str, str] = {}
    for key, tenant, where in entries:
        if not key.startswith("tml-") or len(key) < 8:
            raise ValueError(f"{where}: API key {key[:8]!r}... must start with 'tml-' and be at least 8 characters "
                             "(the tinker SDK refuses other keys before sending them).")
        tenant = tenant or _tenant_of(key)
        if keys.get(key, tenant) != tenant:
            raise ValueError(f"{where}: key {key[:8]}... is given to two tenants ({keys[key]!r}, {tenant!r}).")
        keys[key] = tenant
    return keys

"""The base models one ``ferrule serve`` process serves (``--base-model`` repeated, or
``--models-file``), by the name clients pass as ``base_model``.

Each base is an :class:`~ferrule.serve.backend.EngineBackend` (its training clients' engines,
its rollout engine, its unnamed sampler snapshots). Only its ``config.json`` is read at start
(the first base is also loaded then); a base's weights are loaded when a request first needs
them (a training client is created, or a sampling request of it runs). At most
``max_loaded`` bases are loaded at once (``--max-loaded-bases``): loading one more unloads the
least recently used loaded base that has no live training client (its rollout engine, base
copy and unnamed snapshots are dropped; a later request loads it again). When every loaded
base has live training clients the request fails naming the limit; ``unload_model`` of a
training client (or finishing its session) frees its engine.

Every method except :meth:`BaseRegistry.get` / :meth:`BaseRegistry.names` runs on the service's
single worker thread (the backends' load hook calls :meth:`BaseRegistry._make_room` there).
"""

from __future__ import annotations

import collections
import gc
import time
from pathlib import Path
from typing import Any, Sequence

from .backend import MAX_SNAPSHOTS, EngineBackend
from .scheduler import UserError
from .memory import backend_bytes, fmt_bytes, load_need

__all__ = ["BaseRegistry", "parse_models_file", "DEFAULT_MAX_LOADED"]

#: bases loaded at once by default: a trained base plus one frozen teacher / reference base
DEFAULT_MAX_LOADED = 2


def parse_models_file(path: str | Path) -> list[tuple[str | None, Path]]:
    """A ``--models-file``: one ``DIR [NAME]`` per line (whitespace between; ``#`` starts a
    comment; blank lines skipped; NAME defaults to the directory name); relative DIRs are
    resolved against the file's folder.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line with more than two fields.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--models-file {path}: no such file; write one 'DIR [NAME]' per line.")
    out: list[tuple[str | None, Path]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"--models-file {path}:{number}: {line.strip()!r} has {len(fields)} fields; expected "
                             "'DIR [NAME]'.")
        directory = Path(fields[0]).expanduser()
        out.append((fields[1] if len(fields) == 2 else None, directory if directory.is_absolute()
                    else path.parent / directory))
    return out


class BaseRegistry:
    """The served bases by name, loaded on first use, unloaded least-recently-used.

    Args:
        bases: ``(name or None, directory)`` per base, the first being the default
            (``get_server_capabilities`` lists them in this order).
        max_loaded: most bases holding weights at once (>= 1).
        max_loaded_bytes: most bytes the loaded bases hold together (``--max-loaded-bytes``; what
            :func:`ferrule.serve.memory.backend_bytes` counts: sampler weights and swap copy, training
            clients, snapshots), or None; a base about to load counts as
            :func:`ferrule.serve.memory.load_need` (its sampler weights and swap copy).
        optimizer, max_snapshots, sampler_dtype, sampler_checkpoints, engine_settings: passed to every
            :class:`EngineBackend`.

    Raises:
        ValueError: no base, two bases with one name, or ``max_loaded < 1``.
        FileNotFoundError: a directory that is no checkpoint (from :class:`EngineBackend`).
    """

    def __init__(self, bases: Sequence[tuple[str | None, str | Path] | EngineBackend], *,
                 max_loaded: int = DEFAULT_MAX_LOADED, optimizer: Any = None, max_snapshots: int = MAX_SNAPSHOTS,
                 sampler_dtype: str | None = "auto", sampler_checkpoints: str = "auto",
                 engine_settings: Any = None, max_loaded_bytes: int | None = None):
        if not bases:
            raise ValueError("no base model: give --base-model DIR (repeatable) or --models-file FILE.")
        if max_loaded < 1:
            raise ValueError(f"--max-loaded-bases {max_loaded}: keep at least 1 base loaded.")
        if max_loaded_bytes is not None and max_loaded_bytes < 1:
            raise ValueError(f"--max-loaded-bytes {max_loaded_bytes}: expected a size >= 1 byte.")
        self.max_loaded = max_loaded
        #: bytes the loaded bases may hold together (``--max-loaded-bytes``), or None
        self.max_loaded_bytes = max_loaded_bytes
        self._backends: dict[str, EngineBackend] = {}
        for i, base in enumerate(bases):
            backend = base if isinstance(base, EngineBackend) else EngineBackend(
                base[1], model_name=base[0], optimizer=optimizer, max_snapshots=max_snapshots, eager=i == 0,
                sampler_dtype=sampler_dtype, sampler_checkpoints=sampler_checkpoints,
                engine_settings=engine_settings)
            if backend.model_name in self._backends:
                raise ValueError(f"two base models are named {backend.model_name!r}; give each its own name "
                                 "(--model-name per --base-model, or NAME in the models file).")
            backend.on_load = self._make_room
            backend.on_use = self._touch
            self._backends[backend.model_name] = backend
        self._used: collections.OrderedDict[str, None] = collections.OrderedDict(
            (n, None) for n, b in self._backends.items() if b.loaded)
        self.unloads: list[str] = []   # names unloaded to make room, oldest first (logs, tests)

    @property
    def names(self) -> list[str]:
        return list(self._backends)

    @property
    def default(self) -> EngineBackend:
        return next(iter(self._backends.values()))

    def get(self, name: Any) -> EngineBackend:
        """The backend serving ``name`` (nothing is loaded).

        Raises:
            ValueError: ``name`` is not served, naming the served ones.
        """
        try:
            return self._backends[name]
        except (KeyError, TypeError):
            raise ValueError(f"base_model {name!r} is not served here; this server serves "
                             f"{', '.join(repr(n) for n in self._backends)}.") from None

    def backends(self) -> list[EngineBackend]:
        """Every served base's backend, in order."""
        return list(self._backends.values())

    def loaded(self) -> list[str]:
        """Names of the bases holding weights now, least recently used first."""
        return [n for n in self._used if self._backends[n].loaded]

    def _touch(self, backend: EngineBackend) -> None:
        self._used[backend.model_name] = None
        self._used.move_to_end(backend.model_name)

    def _make_room(self, backend: EngineBackend) -> None:
        """Called by ``backend`` before it loads weights while holding none: unload least recently
        used idle bases until it fits under :attr:`max_loaded` and :attr:`max_loaded_bytes`. Whether it
        can fit is decided first: a refusal unloads nothing.

        Raises:
            UserError: it does not fit even with every idle base unloaded (naming the limit).
        """
        others = [n for n in self.loaded() if n != backend.model_name]
        idle = [n for n in others if not self._backends[n].engines]
        busy = [n for n in others if n not in idle]
        if len(busy) >= self.max_loaded:
            raise UserError(
                f"cannot load base model {backend.model_name!r}: the server's limit --max-loaded-bases = "
                f"{self.max_loaded} is reached by {', '.join(repr(n) for n in busy)}, each with live training "
                "clients; unload_model a training client (or finish its session), or start the server with a "
                "larger --max-loaded-bases.")
        need = load_need(backend)
        held = {n: backend_bytes(self._backends[n], set()) for n in others}
        if self.max_loaded_bytes is not None and sum(held[n] for n in busy) + need > self.max_loaded_bytes:
            raise UserError(
                f"cannot load base model {backend.model_name!r}: it needs about {fmt_bytes(need)} (its sampler "
                f"weights and their swap copy), and the bases with live training clients hold "
                f"{fmt_bytes(sum(held[n] for n in busy))} of the server's limit --max-loaded-bytes = "
                f"{fmt_bytes(self.max_loaded_bytes)}"
                + (f" ({', '.join(f'{n!r}: {fmt_bytes(held[n])}' for n in busy)})" if busy else "")
                + "; unload_model a training client (or finish its session), or start the server with a larger "
                "--max-loaded-bytes.")
        while idle and (len(others) >= self.max_loaded or (
                self.max_loaded_bytes is not None and sum(held[n] for n in others) + need > self.max_loaded_bytes)):
            victim = idle.pop(0)
            self.unload(victim, why=f"least recently used, to load {backend.model_name!r} under "
                                    + (f"--max-loaded-bases = {self.max_loaded}" if len(others) >= self.max_loaded
                                       else f"--max-loaded-bytes = {fmt_bytes(self.max_loaded_bytes)}"))
            others.remove(victim)
        self._touch(backend)

    def unload(self, name: str, why: str = "unloaded") -> None:
        """Drop the weights of base ``name`` (it must have no live training client)."""
        self._backends[name].unload(f"base model {name!r} was unloaded at {time.strftime('%H:%M:%S')} ({why})")
        self._used.pop(name, None)
        self.unloads.append(name)
        gc.collect()

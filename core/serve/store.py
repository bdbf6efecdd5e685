"""The service's records in SQLite (SQLAlchemy Core, WAL journal): sessions, models, futures,
sampling sessions and checkpoints.

One file, ``<storage>/serve.sqlite3``. Every write is one transaction; readers see committed
rows only (WAL lets the request handlers read while the worker writes). What survives a
restart: every row. At start-up :meth:`Store.fail_unfinished` marks futures that were still
queued or running when the previous process stopped as failed with a message saying so, so a
client polling one gets a clear error instead of waiting forever; their results are not
recomputable because the engine state they ran against is gone.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

__all__ = ["Store", "DB_FILE"]

DB_FILE = "serve.sqlite3"

_meta = sa.MetaData()
sessions = sa.Table(
    "sessions", _meta,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("tenant", sa.String, nullable=False, index=True),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("last_heartbeat", sa.Float, nullable=False),
    sa.Column("tags", sa.Text, nullable=False, default="[]"),
    sa.Column("finished", sa.String, nullable=True),
)
models = sa.Table(
    "models", _meta,
    sa.Column("model_id", sa.String, primary_key=True),
    sa.Column("session_id", sa.String, nullable=False),
    sa.Column("tenant", sa.String, nullable=False, index=True),
    sa.Column("base_model", sa.String, nullable=False),
    sa.Column("lora_rank", sa.Integer, nullable=True),
    sa.Column("created", sa.Float, nullable=False),
)
futures = sa.Table(
    "futures", _meta,
    sa.Column("request_id", sa.String, primary_key=True),
    sa.Column("tenant", sa.String, nullable=False, index=True),
    sa.Column("model_id", sa.String, nullable=True),
    sa.Column("seq_id", sa.Integer, nullable=True),
    sa.Column("op", sa.String, nullable=False),
    sa.Column("idempotency_key", sa.String, nullable=True, index=True),
    sa.Column("status", sa.String, nullable=False),          # pending | done | failed
    sa.Column("content_type", sa.String, nullable=True),     # application/json | application/x-protobuf
    sa.Column("result", sa.LargeBinary, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("category", sa.String, nullable=True),          # user | server
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("finished", sa.Float, nullable=True),
    sa.UniqueConstraint("model_id", "seq_id", name="uq_model_seq"),
)
sampling_sessions = sa.Table(
    "sampling_sessions", _meta,
    sa.Column("sampling_session_id", sa.String, primary_key=True),
    sa.Column("tenant", sa.String, nullable=False),
    sa.Column("session_id", sa.String, nullable=False),
    # None: the base model; tinker://...: a sampler checkpoint; ephemeral:...: an in-memory snapshot
    sa.Column("model_path", sa.String, nullable=True),
    sa.Column("base_model", sa.String, nullable=False),
)
checkpoints = sa.Table(
    "checkpoints", _meta,
    sa.Column("path", sa.String, primary_key=True),     # tinker://<model_id>/<kind>/<name>
    sa.Column("tenant", sa.String, nullable=False, index=True),
    sa.Column("model_id", sa.String, nullable=False),
    sa.Column("kind", sa.String, nullable=False),       # weights | sampler_weights
    sa.Column("name", sa.String, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("size_bytes", sa.Integer, nullable=False),
)
# added by issue 26 as tables of their own, so a database of an older server gains them on open
model_info = sa.Table(
    "model_info", _meta,
    sa.Column("model_id", sa.String, primary_key=True),
    sa.Column("user_metadata", sa.Text, nullable=True),      # JSON {str: str}
    sa.Column("lora_config", sa.Text, nullable=True),        # JSON: the create request's lora_config
)
checkpoint_info = sa.Table(
    "checkpoint_info", _meta,
    sa.Column("path", sa.String, primary_key=True),
    sa.Column("expires_at", sa.Float, nullable=True),        # unix seconds; None = never
    sa.Column("user_metadata", sa.Text, nullable=True),
)


class Store:
    """Thread-safe access to the service database (one writer lock, WAL readers)."""

    def __init__(self, storage: str | Path):
        self.path = Path(storage) / DB_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = sa.create_engine(f"sqlite:///{self.path}", connect_args={"check_same_thread": False})

        @sa.event.listens_for(self.engine, "connect")
        def _pragmas(dbapi_conn, _record):  # WAL: readers do not block the writer
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        _meta.create_all(self.engine)
        self._lock = threading.Lock()

    def journal_mode(self) -> str:
        with self.engine.connect() as c:
            return str(c.exec_driver_sql("PRAGMA journal_mode").scalar())

    def _write(self, stmt: Any) -> Any:
        with self._lock, self.engine.begin() as c:
            return c.execute(stmt)

    def _one(self, stmt: Any) -> dict | None:
        with self.engine.connect() as c:
            row = c.execute(stmt).mappings().first()
        return dict(row) if row is not None else None

    def _all(self, stmt: Any) -> list[dict]:
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(stmt).mappings().all()]

    # ---------------------------------------------------------------- sessions / models
    def add_session(self, session_id: str, tenant: str, tags: list) -> None:
        now = time.time()
        self._write(sessions.insert().values(session_id=session_id, tenant=tenant, created=now, last_heartbeat=now,
                                             tags=json.dumps(tags)))

    def session(self, session_id: str) -> dict | None:
        return self._one(sessions.select().where(sessions.c.session_id == session_id))

    def sessions(self, tenant: str) -> list[dict]:
        """The tenant's sessions, oldest first."""
        return self._all(sessions.select().where(sessions.c.tenant == tenant).order_by(sessions.c.created))

    def session_samplers(self, session_id: str) -> list[str]:
        """Ids of the sampling sessions created in ``session_id``."""
        return [r["sampling_session_id"] for r in self._all(
            sampling_sessions.select().where(sampling_sessions.c.session_id == session_id))]

    def heartbeat(self, session_id: str) -> None:
        self._write(sessions.update().where(sessions.c.session_id == session_id).values(last_heartbeat=time.time()))

    def finish_session(self, session_id: str, reason: str) -> None:
        self._write(sessions.update().where(sessions.c.session_id == session_id).values(finished=reason))

    def add_model(self, model_id: str, session_id: str, tenant: str, base_model: str, lora_rank: int | None) -> None:
        self._write(models.insert().prefix_with("OR IGNORE").values(
            model_id=model_id, session_id=session_id, tenant=tenant, base_model=base_model, lora_rank=lora_rank,
            created=time.time()))

    def session_models(self, session_id: str) -> list[str]:
        return [r["model_id"] for r in self._all(models.select().where(models.c.session_id == session_id))]

    def model(self, model_id: str) -> dict | None:
        return self._one(models.select().where(models.c.model_id == model_id))

    # ---------------------------------------------------------------- futures
    def add_future(self, request_id: str, tenant: str, op: str, model_id: str | None, seq_id: int | None,
                   idempotency_key: str | None) -> None:
        self._write(futures.insert().values(request_id=request_id, tenant=tenant, op=op, model_id=model_id,
                                            seq_id=seq_id, idempotency_key=idempotency_key, status="pending",
                                            created=time.time()))

    def future(self, request_id: str) -> dict | None:
        return self._one(futures.select().where(futures.c.request_id == request_id))

    def future_by_key(self, tenant: str, idempotency_key: str) -> dict | None:
        return self._one(futures.select().where(futures.c.tenant == tenant, futures.c.idempotency_key == idempotency_key))

    def future_by_seq(self, model_id: str, seq_id: int) -> dict | None:
        return self._one(futures.select().where(futures.c.model_id == model_id, futures.c.seq_id == seq_id))

    def max_seq(self, model_id: str) -> int | None:
        with self.engine.connect() as c:
            return c.execute(sa.select(sa.func.max(futures.c.seq_id)).where(futures.c.model_id == model_id)).scalar()

    def complete(self, request_id: str, content_type: str, result: bytes) -> None:
        self._write(futures.update().where(futures.c.request_id == request_id).values(
            status="done", content_type=content_type, result=result, finished=time.time()))

    def fail(self, request_id: str, error: str, category: str) -> None:
        self._write(futures.update().where(futures.c.request_id == request_id).values(
            status="failed", error=error, category=category, finished=time.time()))

    def fail_unfinished(self) -> int:
        """Mark every pending future failed (called once at start-up); returns how many."""
        res = self._write(futures.update().where(futures.c.status == "pending").values(
            status="failed", category="server", finished=time.time(),
            error="the server restarted before this request finished; its result was lost. Resubmit it "
                  "(training state is what the last saved checkpoint holds)."))
        return int(res.rowcount or 0)

    # ---------------------------------------------------------------- sampling sessions / checkpoints
    def add_sampling_session(self, sid: str, tenant: str, session_id: str, model_path: str | None, base_model: str) -> None:
        self._write(sampling_sessions.insert().prefix_with("OR REPLACE").values(
            sampling_session_id=sid, tenant=tenant, session_id=session_id, model_path=model_path, base_model=base_model))

    def sampling_session(self, sid: str) -> dict | None:
        return self._one(sampling_sessions.select().where(sampling_sessions.c.sampling_session_id == sid))

    def add_checkpoint(self, path: str, tenant: str, model_id: str, kind: str, name: str, size_bytes: int) -> None:
        self._write(checkpoints.insert().prefix_with("OR REPLACE").values(
            path=path, tenant=tenant, model_id=model_id, kind=kind, name=name, created=time.time(),
            size_bytes=size_bytes))

    def checkpoint(self, path: str) -> dict | None:
        return self._one(checkpoints.select().where(checkpoints.c.path == path))

    # ---------------------------------------------------------------- run / checkpoint metadata (issue 26)
    def set_model_info(self, model_id: str, user_metadata: dict | None, lora_config: dict | None) -> None:
        self._write(model_info.insert().prefix_with("OR REPLACE").values(
            model_id=model_id, user_metadata=None if user_metadata is None else json.dumps(user_metadata),
            lora_config=None if lora_config is None else json.dumps(lora_config)))

    def model_info(self, model_id: str) -> dict:
        row = self._one(model_info.select().where(model_info.c.model_id == model_id)) or {}
        return {k: (json.loads(row[k]) if row.get(k) else None) for k in ("user_metadata", "lora_config")}

    def models(self, tenant: str) -> list[dict]:
        return self._all(models.select().where(models.c.tenant == tenant).order_by(models.c.created))

    def last_request_time(self, model_id: str) -> float | None:
        with self.engine.connect() as c:
            return c.execute(sa.select(sa.func.max(futures.c.created)).where(futures.c.model_id == model_id)).scalar()

    def set_checkpoint_info(self, path: str, expires_at: float | None, user_metadata: dict | None) -> None:
        self._write(checkpoint_info.insert().prefix_with("OR REPLACE").values(
            path=path, expires_at=expires_at, user_metadata=None if user_metadata is None else json.dumps(user_metadata)))

    def checkpoint_info(self, path: str) -> dict:
        row = self._one(checkpoint_info.select().where(checkpoint_info.c.path == path)) or {}
        return {"expires_at": row.get("expires_at"),
                "user_metadata": json.loads(row["user_metadata"]) if row.get("user_metadata") else None}

    def delete_checkpoint(self, path: str) -> None:
        with self._lock, self.engine.begin() as c:
            c.execute(checkpoints.delete().where(checkpoints.c.path == path))
            c.execute(checkpoint_info.delete().where(checkpoint_info.c.path == path))

    def expired_checkpoints(self, now: float) -> list[str]:
        return [r["path"] for r in self._all(checkpoint_info.select().where(
            checkpoint_info.c.expires_at.is_not(None), checkpoint_info.c.expires_at <= now))]

    def checkpoints(self, tenant: str, model_id: str | None = None) -> list[dict]:
        q = checkpoints.select().where(checkpoints.c.tenant == tenant)
        if model_id is not None:
            q = q.where(checkpoints.c.model_id == model_id)
        return self._all(q.order_by(checkpoints.c.created))

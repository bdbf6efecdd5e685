"""The tinker 0.38 SDK's routes that ``ferrule serve`` does not serve, answered with a message that
names the SDK call and says why, instead of a bare ``404 Not Found`` / ``405 Method Not Allowed``
(the SDK shows the server's message in its exception).

:data:`UNSERVED` lists them (path pattern -> SDK call, reason); :func:`install` adds the answer for
any ``/api/`` path that no route serves (404 or 405; other unknown paths get a message pointing at
docs/serve.md).
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


__all__ = ["UNSERVED", "install", "explain"]

#: ``(regex over the path, SDK call, why it is not served)``
UNSERVED: tuple[tuple[str, str, str], ...] = (
    (r"/api/v1/training_runs/[^/]+/checkpoints/.+/publish", "RestClient.publish_checkpoint / unpublish_checkpoint",
     "checkpoints are private to their tenant here; there is no public checkpoint store"),
    (r"/api/v1/copy_weights", "RestClient.copy_weights", "there is no second project or store to copy to"),
    (r"/api/v1/(cancel_future|retrieve_futures)", "cancel_future / retrieve_futures",
     "the client config turns them off (sample_cancel_enabled, sample_use_retrieve_futures)"),
    (r"/api/v1/create_custom_loss", "forward_backward_custom with a server-side loss",
     "run the custom loss client-side (custom_loss_server_side is off)"),
    (r"/api/v1/join_sampling_session", "join_sampling_session", "sample_join_sampling_session is off"),
    (r"/api/v1/sessions/search", "RestClient.search_sessions", "use list_sessions and get_session"),
    (r"/api/v1/sessions/[^/]+/(project|trace_export)", "RestClient session projects / trace export",
     "sessions have no projects or traces here"),
    (r"/api/v1/auth/.*", "JWT / API-key introspection (tinker auth)",
     "keys are the server's --api-keys file; there is no token service"),
    (r"/api/v1/(billing|audit)(/.*)?", "billing / audit", "a self-hosted server bills and audits nothing"),
)
_COMPILED = tuple((re.compile(p + r"/?"), call, why) for p, call, why in UNSERVED)


def explain(method: str, path: str) -> str | None:
    """The message for an SDK route this server does not serve, or None if ``path`` is not one."""
    for pattern, call, why in _COMPILED:
        if pattern.fullmatch(path):
            return f"ferrule serve does not serve {method} {path} ({call}): {why}."
    return None


def install(app: FastAPI) -> None:
    """Add the named 404 / 405 answers to ``app``."""

    @app.exception_handler(StarletteHTTPException)
    async def _named(request: Request, exc: StarletteHTTPException):
        path = request.url.path
        if exc.status_code in (404, 405) and path.startswith("/api/") and exc.detail in ("Not Found",
                                                                                      "Method Not Allowed"):
            message = explain(request.method, path) or (
                f"ferrule serve has no route {request.method} {path} (a tinker SDK call this server does not "
                "know); docs/serve.md lists what it serves.")
            return JSONResponse({"detail": message}, status_code=exc.status_code)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

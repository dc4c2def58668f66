"""The kernel's own routes; every other route comes from a plugin."""

from __future__ import annotations

from typing import Any


def kernel_routes(*, metrics: bool) -> list[Any]:
    from . import config, diagnostics, health, instances, jobs, keys, models, plugins, server, session, tls, updates

    out: list[Any] = [*health.ROUTES, *config.ROUTES, *plugins.ROUTES, *keys.ROUTES, *session.ROUTES,
                      *jobs.ROUTES, *server.ROUTES, *models.ROUTES, *tls.ROUTES, *updates.ROUTES,
                      *diagnostics.ROUTES, *instances.ROUTES]
    if metrics:
        out.extend(server.METRICS_ROUTES)
    return out

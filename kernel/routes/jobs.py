"""Background jobs: list, inspect, follow (SSE: replay then follow), cancel."""

from __future__ import annotations

from typing import Any

from litestar import Request

from ..errors import LocalmError
from ..routing import get, post
from .common import kernel_of, principal_of, sse


def _visible(request: Request, job_id: str) -> Any:
    k = kernel_of(request)
    caller = principal_of(request)
    job = k.jobs.get(job_id)
    if job is None or not (caller.is_owner or job.owner == caller.owner_tag):
        raise LocalmError(404, f"No job {job_id}")
    return job


@get("/api/jobs", scope=None, summary="Jobs this caller started (every job, for the owner)")
async def list_jobs(request: Request) -> dict[str, Any]:
    caller = principal_of(request)
    jobs = [j.summary() for j in kernel_of(request).jobs.all() if caller.is_owner or j.owner == caller.owner_tag]
    return {"jobs": jobs}


@get("/api/jobs/{job_id:str}", scope=None, summary="One job's state")
async def read_job(request: Request, job_id: str) -> dict[str, Any]:
    return _visible(request, job_id).summary()


@get("/api/jobs/{job_id:str}/events", scope=None,
     summary="A job's events as server-sent events: every past event, then new ones until it ends")
async def job_events(request: Request, job_id: str) -> Any:
    job = _visible(request, job_id)
    after = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    try:
        start = max(0, int(after))
    except ValueError as exc:
        raise LocalmError(400, "after (or Last-Event-ID) must be an event number") from exc
    return sse(job.follow(start))


@post("/api/jobs/{job_id:str}/cancel", scope=None, summary="Ask a job to stop")
async def cancel_job(request: Request, job_id: str) -> dict[str, Any]:
    job = _visible(request, job_id)
    kernel_of(request).jobs.cancel(job)
    return job.summary()


ROUTES = [list_jobs, read_job, job_events, cancel_job]

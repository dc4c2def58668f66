"""Starts jobs that step through a count, logging and reporting progress at each step."""

import asyncio
import time

from localm import sdk


@sdk.post("/jobber/start")
async def start(request: sdk.Request) -> dict:
    body = await request.json()
    steps, delay, threaded = int(body.get("steps", 3)), float(body.get("delay", 0.05)), bool(body.get("thread"))
    fail_at = body.get("fail_at")

    async def run_async(ctx: sdk.JobContext) -> dict:
        for i in range(1, steps + 1):
            await asyncio.sleep(delay)
            ctx.log(f"step {i}")
            ctx.progress(i / steps, f"{i}/{steps}")
            if i == fail_at:
                raise RuntimeError(f"failed at step {i}")
        return {"steps": steps}

    def run_thread(ctx: sdk.JobContext) -> dict:
        for i in range(1, steps + 1):
            time.sleep(delay)
            ctx.check_cancelled()
            ctx.log(f"step {i}")
            ctx.progress(i / steps, f"{i}/{steps}")
        return {"steps": steps}

    owner = sdk.caller(request).owner_tag
    job = sdk.plugin_of(request).start_job(run_thread if threaded else run_async, kind="count",
                                           title=f"Count to {steps}", owner=owner)
    return {"job_id": job.id}


@sdk.hookimpl
def register_routes(register):
    register(start)


@sdk.hookimpl
def register_commands(register):
    import click

    @click.command("jobber-run")
    @click.argument("steps", type=int)
    def run_command(steps: int) -> None:
        """Start a counting job on the running server and follow it."""
        server = sdk.connect()
        job_id = server.call("POST", "/jobber/start", json={"steps": steps, "delay": 0.01})["job_id"]
        for event in server.events(f"/api/jobs/{job_id}/events"):
            if event["type"] == "log":
                click.echo(event["line"])
            elif event["type"] == "end":
                click.echo(f"result: {event['result']}")

    register(run_command)

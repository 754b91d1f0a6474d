"""``vitkit serve`` under load: requests per second, p50 / p95 / p99 latency and the server's CPU use of a closed-loop
client at concurrency 1, 2, 4 and 8, beside the model's own offline figures and a plain FastAPI endpoint.

The model is ViT-S/16 at 224 px (random weights: the figures are times), saved as a model folder, exported to ONNX
and quantized to int8 (``vitkit export --int8``, calibrated on crops of scikit-image's photographs). The servers, all
started before the first measurement and measured in interleaved rounds (each concurrency, every server in turn, so
load and clock drift hit all alike; the servers not being measured are stopped with SIGSTOP, as an idle LitServe
server polls its queues):

- ``vitkit serve`` of the int8 ONNX file, of the fp32 ONNX file and of the PyTorch model folder (its defaults:
  batches of up to 8, one worker of all the cores' threads);
- the same int8 file with ``--max-batch-size 1``: LitServe without batching;
- a plain FastAPI endpoint, what a user writes first: one ``async`` route that decodes the image, prepares it as
  ``vitkit predict`` does and runs the same ONNX session on it, one request at a time (uvicorn, one process).

The client sends scikit-image's 14 photographs (JPEG, 300 to 640 px a side) as raw bytes with httpx, each of
``concurrency`` connections sending its next request when its last is answered, after a warm-up at that concurrency.
It runs on the same machine, so it takes some of the CPU from the servers (its own use is in the table). The server's
CPU use is the CPU time of its processes (psutil) over the wall time, in cores.

    python benchmarks/serve.py --out benchmarks/results/serve_$(python benchmarks/cpu_sizes.py --cpu-slug).md
"""

import argparse
import asyncio
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {"topk": 5, "max_patches": None, "mode": "whole"}


def photographs() -> tuple[list[str], list[bytes]]:
    """scikit-image's photographs at their own sizes as JPEG bytes, and their names."""
    from packing import PHOTOS  # benchmarks/packing.py, beside this script
    from PIL import Image
    from skimage import data

    names, files = [], []
    for name in PHOTOS:
        pixels = getattr(data, name)()
        image = Image.fromarray(pixels).convert("RGB")
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=90)
        names.append(name)
        files.append(out.getvalue())
    return names, files


def build_files(tmp: Path, names: list[str]) -> dict[str, Path]:
    """The model folder, its fp32 ONNX export and the int8 file quantized from it."""
    import torch
    from packing import photographs as crops

    import vitkit

    torch.manual_seed(0)
    net = vitkit.create_model("vit_small_patch16_224", num_classes=len(names)).eval()
    out = {"folder": vitkit.save_pretrained(net, tmp / "vit_s16", class_names=names)}
    from PIL import Image

    for i, crop in enumerate(crops(len(names) * 24, seed=1)):  # 200 to calibrate, the rest to score
        folder = tmp / "calibrate" / names[i % len(names)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((crop.clamp(0, 1) * 255).byte().permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
    out["fp32"], out["int8"] = tmp / "vit_s16.onnx", tmp / "vit_s16.int8.onnx"
    for args in ([str(out["folder"]), "-o", str(out["fp32"])],
                 [str(out["fp32"]), "--int8", "--calibrate", str(tmp / "calibrate"), "--max-drop", "100", "-o",
                  str(out["int8"])]):
        subprocess.run([sys.executable, "-m", "vitkit.cli", "export", *args], check=True, stdout=subprocess.DEVNULL)
    return out


def plain_server(model: str, port: int) -> None:
    """The plain FastAPI endpoint: decode, prepare, run the session at batch 1, the top 5; one request at a time."""
    import uvicorn
    from fastapi import FastAPI, Request
    from PIL import Image

    from vitkit.serving.model import load_predictor

    predictor, _ = load_predictor(("onnx", model), OPTIONS, len(os.sched_getaffinity(0)))
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/predict")  # (this module has no `from __future__ import annotations`: FastAPI reads `Request`)
    async def predict(request: Request) -> dict:
        image = Image.open(io.BytesIO(await request.body())).convert("RGB")
        output = predictor.run([predictor.prepare(image)])[0]
        return {"predictions": [predictor.result(image, output, OPTIONS).record]}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    import httpx

    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{' '.join(command)} stopped: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{' '.join(command)} was not ready in 300 s: {log.read_text()[-2000:]}")


def pause(pid: int, paused: bool) -> None:
    """Stop or continue a server's processes (SIGSTOP / SIGCONT): an idle LitServe server polls its queues, and
    the servers not being measured must take no CPU from the one that is."""
    import psutil

    parent = psutil.Process(pid)
    for p in [parent, *parent.children(recursive=True)]:
        try:
            p.suspend() if paused else p.resume()
        except psutil.NoSuchProcess:
            pass


def stop(processes: list[subprocess.Popen]) -> None:
    """Continue every server, ask each to stop (SIGTERM), and kill what is still there after a minute."""
    import psutil

    trees = []
    for process in processes:
        pause(process.pid, False)
        try:
            trees.append([psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)])
        except psutil.NoSuchProcess:
            continue
        process.terminate()
    _, alive = psutil.wait_procs([p for tree in trees for p in tree], timeout=60)
    for p in alive:
        p.kill()


def cpu_seconds(pid: int) -> float:
    """The CPU time of a process and of every process under it."""
    import psutil

    total = 0.0
    parent = psutil.Process(pid)
    for p in [parent, *parent.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


async def load(port: int, files: list[bytes], concurrency: int, seconds: float) -> list[float]:
    """Latencies (s) of ``concurrency`` connections sending one photograph after another for ``seconds``."""
    import httpx

    latencies: list[float] = []
    url = f"http://127.0.0.1:{port}/predict"
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        stop = time.perf_counter() + seconds

        async def connection(k: int) -> None:
            while time.perf_counter() < stop:
                t = time.perf_counter()
                r = await client.post(url, content=files[k % len(files)], headers={"content-type": "image/jpeg"})
                if r.status_code != 200:
                    raise SystemExit(f"{url} answered {r.status_code}: {r.text[:500]}")
                latencies.append(time.perf_counter() - t)
                k += concurrency

        await asyncio.gather(*(connection(i) for i in range(concurrency)))
    return latencies


def offline(model: Path, files: list[bytes], batch: int, rounds: int = 20) -> tuple[float, float, float]:
    """(images/s of the session at ``batch``, its median batch-1 latency in ms, the median ms to decode and prepare
    one photograph), all cores, the session's figures on images prepared beforehand."""
    from PIL import Image

    from vitkit.serving.model import load_predictor

    predictor, _ = load_predictor(("onnx", str(model)), OPTIONS, len(os.sched_getaffinity(0)))
    prepared, prep = [], []
    for _ in range(3):
        prepared.clear()
        for f in files:
            t = time.perf_counter()
            prepared.append(predictor.prepare(Image.open(io.BytesIO(f)).convert("RGB")))
            prep.append(time.perf_counter() - t)
    stack = [prepared[i % len(prepared)] for i in range(batch)]
    for _ in range(3):
        predictor.run(stack)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        predictor.run(stack)
        times.append(time.perf_counter() - t)
    ones = []
    for i in range(rounds * 2):
        t = time.perf_counter()
        predictor.run([prepared[i % len(prepared)]])
        ones.append(time.perf_counter() - t)
    return batch / statistics.median(times), 1000 * statistics.median(ones), 1000 * statistics.median(prep)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per server and concurrency a round")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--plain-server", nargs=2, metavar=("MODEL", "PORT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.plain_server:
        return plain_server(a.plain_server[0], int(a.plain_server[1]))
    import litserve
    import onnxruntime
    import psutil
    import torch

    from vitkit.benchmarking.bench import cpu_name, publish

    names, files = photographs()
    vitkit_serve = [sys.executable, "-m", "vitkit.cli", "serve"]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_files(Path(tmp), names)
        b8, batch1_ms, prep_ms = offline(model["int8"], files, 8)
        b8_fp32, batch1_fp32_ms, _ = offline(model["fp32"], files, 8)
        servers = {"vitkit serve, int8 ONNX": [*vitkit_serve, str(model["int8"])],
                   "vitkit serve, fp32 ONNX": [*vitkit_serve, str(model["fp32"])],
                   "vitkit serve, PyTorch folder": [*vitkit_serve, str(model["folder"])],
                   "LitServe without batching, int8 ONNX": [*vitkit_serve, str(model["int8"]), "--max-batch-size", "1"],
                   "plain FastAPI, int8 ONNX": [sys.executable, str(Path(__file__).resolve()), "--plain-server",
                                                str(model["int8"])]}
        running, ports = {}, {}
        try:
            for name, command in servers.items():
                ports[name] = port = free_port()
                command = [*command, str(port)] if "--plain-server" in command else [*command, "--port", str(port)]
                running[name] = start(command, port, Path(tmp) / f"{len(running)}.log")
                pause(running[name].pid, True)
            results = {(n, c): {"latencies": [], "rates": [], "cpu": [], "client": []}
                       for n in servers for c in a.concurrency}
            me = psutil.Process()
            for _ in range(a.rounds):
                for c in a.concurrency:
                    for name in servers:
                        pause(running[name].pid, False)
                        asyncio.run(load(ports[name], files, c, a.warmup))
                        cpu, mine, t = cpu_seconds(running[name].pid), me.cpu_times(), time.perf_counter()
                        latencies = asyncio.run(load(ports[name], files, c, a.seconds))
                        wall = time.perf_counter() - t
                        mine_after = me.cpu_times()
                        r = results[(name, c)]
                        r["latencies"] += latencies
                        r["rates"].append(len(latencies) / wall)
                        r["cpu"].append((cpu_seconds(running[name].pid) - cpu) / wall)
                        r["client"].append((mine_after.user + mine_after.system - mine.user - mine.system) / wall)
                        pause(running[name].pid, True)
        finally:
            stop(list(running.values()))
    from cpu_sizes import cpu_family  # benchmarks/cpu_sizes.py, beside this script

    lines = [f"CPU: {cpu_name()} ({cpu_family()}, {len(os.sched_getaffinity(0))} cores); torch {torch.__version__}, "
             f"onnxruntime {onnxruntime.__version__}, LitServe {litserve.__version__}; ViT-S/16 at 224 px; "
             f"{a.rounds} interleaved rounds of {a.seconds:g} s per server and concurrency, after "
             f"{a.warmup:g} s of warm-up", "",
             f"Offline, the same sessions in one process, all cores: int8 {b8:.1f} images/s at batch 8, "
             f"{batch1_ms:.1f} ms at batch 1; fp32 {b8_fp32:.1f} images/s at batch 8, {batch1_fp32_ms:.1f} ms at "
             f"batch 1. Decoding a photograph and preparing it (resize, crop, normalize) takes {prep_ms:.1f} ms "
             f"more, which the offline figures leave out and a server does for every request: at batch 8 the "
             f"int8 session and that preparation together come to {8 / (8 / b8 + 8 * prep_ms / 1000):.1f} images/s "
             "on these cores.", "",
             "| server | concurrency | requests/s | p50 ms | p95 ms | p99 ms | server CPU (cores) | client CPU "
             "(cores) |",
             "|---|---|---|---|---|---|---|---|"]
    for (name, c), r in results.items():
        q = np.percentile(1000 * np.array(r["latencies"]), [50, 95, 99])
        lines.append(f"| {name} | {c} | {statistics.mean(r['rates']):.1f} | {q[0]:.0f} | {q[1]:.0f} | {q[2]:.0f} | "
                     f"{statistics.mean(r['cpu']):.2f} | {statistics.mean(r['client']):.2f} |")
    top, low = max(a.concurrency), min(a.concurrency)
    served = statistics.mean(results[("vitkit serve, int8 ONNX", top)]["rates"])
    plain = statistics.mean(results[("plain FastAPI, int8 ONNX", top)]["rates"])
    p99 = float(np.percentile(1000 * np.array(results[("vitkit serve, int8 ONNX", low)]["latencies"]), 99))
    lines += ["", "Targets (int8 ONNX):", "",
              f"- at concurrency {top}, {served:.1f} requests/s = {served / b8:.2f} of the session's offline "
              f"throughput at batch 8 (target: 0.90 or more)",
              f"- at concurrency {top}, {served / plain:.2f}x the plain FastAPI endpoint (target: 1.5x or more)",
              f"- at concurrency {low}, p99 {p99:.0f} ms against 1.3 x {batch1_ms:.1f} + 5 = "
              f"{1.3 * batch1_ms + 5:.0f} ms (target: within)"]
    publish("\n".join(lines), a.out)


if __name__ == "__main__":
    main()

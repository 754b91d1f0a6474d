"""What each rank holds when training under DDP and under FSDP2, measured on 2 CPU processes (gloo).

Per rank, after one AdamW step: the bytes of its parameters, gradients and optimizer state (the local shards
under FSDP2), and the peak resident memory of the process. The model is sharded as vitkit's ImageClassifier
shards it under FSDP2 (every block, then the root: ``vitkit.training.sharding.shard``).

    python benchmarks/sharded_memory.py --models vit_base_patch16_224,vit_large_patch16_224 \
        --out benchmarks/results/sharded_memory_cpu.csv

Writes the CSV and, beside it, the same rows as JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLUMNS = ["model", "strategy", "rank", "params_mb", "grads_mb", "optimizer_mb", "state_mb", "peak_rss_mb",
           "state_vs_ddp", "device", "torch"]


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _rank(rank: int, world: int, port: int, name: str, strategy: str, img: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    from torch.distributed.device_mesh import init_device_mesh

    import vitkit
    from vitkit.training.sharding import shard

    model = vitkit.create_model(name, img_size=img)
    if strategy == "fsdp2":
        shard(model, init_device_mesh("cpu", (world,)))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1, 3, img, img)
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    params = _bytes(model.parameters())
    grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
    state = _bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    queue.put(dict(model=name, strategy=strategy, rank=rank, params_mb=round(params / 2**20, 1),
                   grads_mb=round(grads / 2**20, 1), optimizer_mb=round(state / 2**20, 1),
                   state_mb=round((params + grads + state) / 2**20, 1), peak_rss_mb=round(peak, 1)))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="vit_base_patch16_224,vit_large_patch16_224")
    p.add_argument("--strategies", default="ddp,fsdp2")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--out", default="benchmarks/results/sharded_memory_cpu.csv")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    # A process of its own per rank and run (its peak RSS is its own), forked from a server that has imported torch
    # and vitkit once, instead of one that imports them again for each.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "vitkit", "vitkit.training.sharding"])
    rows = []
    for name in a.models.split(","):
        for strategy in a.strategies.split(","):
            queue = ctx.Queue()
            port = _free_port()
            procs = [ctx.Process(target=_rank, args=(r, a.world, port, name, strategy, a.img_size, queue))
                     for r in range(a.world)]
            for proc in procs:
                proc.start()
            got = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
            for proc in procs:
                proc.join()
                if proc.exitcode:
                    raise SystemExit(f"{name} under {strategy}: a rank exited with {proc.exitcode}")
            rows += got
    ddp = {(r["model"], r["rank"]): r["state_mb"] for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        base = ddp.get((r["model"], r["rank"]))
        r.update(state_vs_ddp=round(r["state_mb"] / base, 3) if base else None,
                 device=platform.processor() or platform.machine(), torch=torch.__version__)
    from vitkit.benchmarking.bench import write_rows

    out = Path(a.out)
    write_rows(rows, out, COLUMNS)
    cols = COLUMNS[:-2]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    for r in rows:
        print({k: r[k] for k in COLUMNS[:-2]})
    return rows


if __name__ == "__main__":
    main()

"""``vitkit serve MODEL``: a model file behind an HTTP endpoint, on LitServe (its workers, dynamic batching, ``/health``
and request timeouts): ``POST /predict`` answers what ``vitkit predict`` says of an image, through the model's task
(``vitkit.tasks``), with the same preparation; ``/`` is a page to try it, ``/openapi.json`` describes the API and
``/metrics`` counts requests and their times (``vitkit/serving/``)."""

from __future__ import annotations

import os
import signal
import sys
import warnings

from vitkit.errors import UsageError

from .common import command_parser


def parser():
    p = command_parser("serve")
    p.add_argument("model", help="a checkpoint, a saved model folder, an ONNX file (fp32, int8 or --packed), an int8 "
                   ".pt2, or with --pretrained a timm or torchvision name")
    p.add_argument("--pretrained", action="store_true", help="MODEL is a name: its pretrained weights")
    p.add_argument("--host", default="127.0.0.1", help="the interface to listen on (127.0.0.1: this machine only; "
                   "0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1, help="inference processes; each gets the cores divided by "
                   "the workers as its threads, so that more workers never oversubscribe the CPU")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests run together in one batch (LitServe's "
                   "dynamic batching; 1: one at a time)")
    p.add_argument("--batch-timeout", type=float, default=0.005, help="seconds a batch waits for more requests")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a request may wait in the queue for a worker")
    p.add_argument("--max-body-mb", type=float, default=20.0, help="the largest request body, in MiB")
    p.add_argument("--max-images", type=int, default=64, help="images one request may hold (each request's images "
                   "run in batches of --max-batch-size)")
    p.add_argument("--api-key", default=None, help="every path but /health asks for this key (the X-API-Key header, "
                   "or Authorization: Bearer KEY); "
                   "default: the VITKIT_API_KEY environment variable, else none")
    p.add_argument("--topk", type=int, default=5, help="a classifier's classes per image")
    p.add_argument("--max-patches", type=int, default=None, metavar="N", help="a ViT classifier: each image whole "
                   "within N patches at its aspect ratio (as vitkit predict --max-patches)")
    p.add_argument("--mode", choices=("whole", "slide"), default="whole", help="a segmenter, as vitkit predict")
    p.add_argument("--threshold", type=float, default=None, metavar="S", help="a detector: the least score of the "
                   "boxes it answers and draws (default 0.5)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per worker (default: the cores over "
                   "--workers)")
    return p


def taken(host: str, port: int) -> None:
    """One line, before anything starts, where ``host:port`` cannot be listened on (another server has it)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}): another process has it, or give "
                             "another with --port") from None


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    for name in ("workers", "max_batch_size", "port", "max_images"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} expects 1 or more, got {getattr(args, name)}")
    if args.batch_timeout < 0 or args.timeout <= args.batch_timeout or args.max_body_mb <= 0:
        raise UsageError("--batch-timeout takes 0 or more seconds, below --timeout; --max-body-mb more than 0")
    try:
        import litserve as ls
    except ImportError as e:
        raise UsageError(f"vitkit serve runs on LitServe ({e}); pip install 'vitkit[serve]'") from None
    from vitkit.serving.api import VitkitAPI
    from vitkit.serving.gate import Gate
    from vitkit.serving.model import load_predictor, source_of

    source = source_of(args.model, args.pretrained)
    options = {"topk": args.topk, "max_patches": args.max_patches, "mode": args.mode, "threshold": args.threshold}
    threads = args.threads or max(1, cores() // args.workers)
    taken(args.host, args.port)
    try:  # here, before any worker starts: a damaged file, or one no task serves, ends in one line
        predictor, task = load_predictor(source, options, threads)
        from PIL import Image

        predictor.prepare(Image.new("RGB", (64, 64)))  # what the file must record to prepare an image
    except UsageError as e:  # a damaged file, one no task serves: the loaders' refusals, each naming the file
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot serve {args.model}: {said}") from None
    del predictor
    key = args.api_key or os.environ.get("VITKIT_API_KEY") or None
    with warnings.catch_warnings():  # LitServe's note that batches of 1 leave batch() unused: --max-batch-size 1 is
        warnings.filterwarnings("ignore", message=".*batch and unbatch methods implemented.*")  # as asked
        api = VitkitAPI(source, options, threads, max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout)
    about = {"model": os.path.basename(os.path.normpath(args.model)), "task": task}
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=args.workers, timeout=args.timeout,
                          middlewares=[(Gate, {"api_key": key, "max_body": int(args.max_body_mb * 2**20),
                                                "about": about, "max_images": args.max_images})],
                          model_metadata=about)
    print(f"serving {args.model} ({task}) at http://{args.host}:{args.port}/ with {args.workers} worker(s) of "
          f"{threads} thread(s), batches of up to {args.max_batch_size}" + ("; API key required" if key else ""),
          file=sys.stderr, flush=True)
    main_pid = os.getpid()

    def stop(signum: int, frame) -> None:  # SIGTERM to the server as Ctrl-C: LitServe's graceful shutdown, which
        if os.getpid() != main_pid:  # answers the requests in flight; its worker processes stop as they would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    server.run(host=args.host, port=args.port, num_api_servers=1, generate_client_file=False, log_level="warning")
    return 0

import os
import tempfile

# torch.compile's on-disk cache is not keyed on ATEN_CPU_CAPABILITY: kernels cached by a run on another
# kernel path were reused, and flex attention then disagreed with the reference by up to 0.8. A run that
# sets the variable (to reproduce another CPU) gets a cache of its own.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}")

# Under pytest-xdist (`make test` runs 2 processes) each process takes its share of the cores, and so do the
# processes the tests start (DDP ranks, killed runs), which read OMP_NUM_THREADS. With 2 threads in each of
# the 2 processes on 2 cores the suite took 814 s instead of 484 s.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402
import torch
from hypothesis import HealthCheck, settings

if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" in os.environ:  # torch may predate the variable
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Property tests: a few dozen examples each, the same ones on every run in CI (derandomized), many more on
# demand with `pytest -m fuzz` (or `make fuzz`); `--hypothesis-seed N` draws another set locally.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", max_examples=25, **_COMMON)
settings.register_profile("ci", max_examples=25, derandomize=True, **_COMMON)
settings.register_profile("fuzz", max_examples=2000, **_COMMON)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", None):  # --hypothesis-profile NAME wins
        return
    fuzz = "fuzz" in (config.option.markexpr or "") and "not fuzz" not in config.option.markexpr
    settings.load_profile("fuzz" if fuzz else "ci" if os.environ.get("CI") else "dev")


# The files that run longest start first, longest first (their seconds in one `--durations` run, 2 workers), so
# that under `--dist loadfile` the two workers finish together instead of one starting a two-minute file while the
# other runs out of work. A file not listed starts after these, in collection order.
LONGEST_FIRST = (
    "tests/lit/test_sharded_checkpoints.py",  # 166 s: multi-process runs
    "tests/lit/test_headless.py",  # 150
    "tests/models/test_swin.py",  # 140 with a cold torch.compile cache
    "tests/models/test_vit.py",  # 119
    "tests/lit/test_train.py",  # 95
    "tests/test_export.py",  # 84
    "tests/models/test_pretrained.py",  # 82
    "tests/lit/test_streaming_mix.py",  # 67
    "tests/lit/test_streaming.py",  # 66
    "tests/lit/test_faults.py",  # 52
    "tests/test_cli.py",  # 44
    "tests/models/test_seq2seq.py",  # 42
    "tests/benchmarks/test_sharded_memory.py",  # 40
    "tests/lit/test_sharded.py",  # 40
    "tests/lit/test_distributed.py",  # 38
    "tests/layers/test_attention.py",  # 38
    "tests/lit/test_seq2seq_train.py",  # 36
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    # Trainer(deterministic=True) switches deterministic algorithms on for the whole process; left on, it
    # changes torch.compile's cache key, and every later compile in the session started cold (8 s -> 60 s)
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])

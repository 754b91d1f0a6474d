import atexit
import os
import shutil
import tempfile
from pathlib import Path

# torch.compile's on-disk cache is not keyed on ATEN_CPU_CAPABILITY: kernels cached by a run on another
# kernel path were reused, and flex attention then disagreed with the reference by up to 0.8. A run that
# sets the variable (to reproduce another CPU) gets a cache of its own.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}")

# The datasets the tests build (Hugging Face's parquet, image-folder and arrow builders) go to a cache of the
# run's own, not to the user's ~/.cache/huggingface/datasets; a test of the cache's layout sets its own.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="vitkit-tests-datasets-")  # removed at exit (below)
# The same for the help of `vitkit train` and `vitkit evaluate` that vitkit keeps (vitkit/cli/help_cache.py).
os.environ["VITKIT_CACHE"] = tempfile.mkdtemp(prefix="vitkit-tests-cache-")

# Under pytest-xdist (`make test` runs 2 processes) each process takes its share of the cores, and so do the
# processes the tests start (DDP ranks, killed runs), which read OMP_NUM_THREADS: more threads than cores would
# make every process wait on the others.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
# The same share for inductor's C++ compiles: with one core a process, its pool of compile processes (one per core
# by default) only adds their start and hand-offs.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch
from hypothesis import HealthCheck, settings

atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
atexit.register(shutil.rmtree, os.environ["VITKIT_CACHE"], ignore_errors=True)

if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" in os.environ:  # torch may predate the variable
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# torch writes TORCHINDUCTOR_CACHE_DIR into the environment when torch._inductor.config is first imported (its
# default, or the value made absolute). Settled here, before any test runs: where a fork server
# (tests/forkserver.py) had started before that import, the changed environment made every later process a fresh
# interpreter (seen with tests/test_cli.py run alone under a plugin that imported it first).
from torch._inductor.runtime.cache_dir_utils import cache_dir  # noqa: E402

cache_dir()

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


# Tiers, by marker (pyproject.toml): `slow` marks a test of more than a few seconds (full-size parity, compiling,
# training to an accuracy, starting processes), and with it every test of its work unit (below), whose shared fixture
# is what makes it slow; `make test-fast` is `-m "not slow"`.
#
# The two test processes of `make test` (pytest-xdist, --dist loadgroup) take work units in the order of the
# collection, each when it is almost out of work. A unit is one test, or every test of a file that shares a fixture
# of module scope (built once, in one process): an ``xdist_group`` named after the file, or every test that uses one
# of the expensive session fixtures of SHARED_EXPENSIVE. Units with a slow test go first, so that the two processes
# finish together on quick ones.

# session fixtures of a conftest that take long to build: the tests that use one are one work unit, whatever their file
SHARED_EXPENSIVE = {"digits_run"}


def _work_unit(item: pytest.Item) -> str | None:
    """The group an item runs in: the name of an expensive shared fixture it uses, else its file when it uses a fixture
    of module scope or one of session scope its own file defines (a conftest's others are cheap and built in each
    process); None for a test that can run anywhere."""
    module = getattr(getattr(item, "module", None), "__name__", None)
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in SHARED_EXPENSIVE & set(defs):
        return name
    for fixture in defs.values():
        d = fixture[-1] if fixture else None
        if d is not None and (d.scope in ("module", "class", "package") or
                              d.scope == "session" and getattr(d.func, "__module__", None) == module):
            return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (it appends "@group" to the node ids)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = _work_unit(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        units.setdefault(group or item.nodeid, []).append(item)
    slow = {k for k, unit in units.items() if any(i.get_closest_marker("slow") for i in unit)}
    for key in slow:  # a unit goes whole: the tests that share a slow test's fixture are slow too
        for item in units[key]:
            if not item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.slow)
    items[:] = [i for key in sorted(units, key=lambda k: k not in slow) for i in units[key]]  # stable otherwise


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    # Trainer(deterministic=True) switches deterministic algorithms on for the whole process; left on, it
    # changes torch.compile's cache key, and every later compile in the session would start cold
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


@pytest.fixture(scope="session")
def upgraded(tmp_path_factory):
    """A checkpoint of before the modules' parts (``tests/fixtures/before_*``) as ``vitkit convert OLD NEW``
    upgrades it, once per session: ``upgraded(path)`` is the new file."""
    from vitkit.cli import main

    folder = tmp_path_factory.mktemp("upgraded")

    def get(path: Path) -> Path:
        new = folder / f"{path.parent.name}_{path.name}"
        if not new.exists():
            assert main(["convert", str(path), str(new)]) == 0, path
        return new

    return get

"""The tests' prepared interpreter (tests/forkserver.py): a process the tests start is a fork of it, also after
torch has compiled in the test process, and it runs as ``python ARGS`` would, with the environment, folder and
path it was given."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests import forkserver

CODE = ("import json, os, sys; print(json.dumps(dict(cwd=os.getcwd(), marker=os.environ.get('MARKER'), "
        "argv=sys.argv, path=sys.path, vitkit='vitkit' in sys.modules, lightning='lightning' in sys.modules)))")
TESTS = str(Path(forkserver.__file__).resolve().parent)


@pytest.mark.slow
@pytest.mark.skipif(forkserver.DISABLED, reason="VITKIT_TEST_FORKSERVER=0: every process a fresh interpreter")
def test_a_process_is_forked_after_torch_compiled_and_runs_as_python_would(tmp_path):
    """The server that imported vitkit (most tests' processes). The other two are checked by their users: the
    installed wheel's, which did not import vitkit (tests/test_cli.py, whose processes assert that vitkit came from
    the wheel), and the one with torch alone (tests/models/test_pretrained.py, test_vit.py)."""
    forkserver.run(["-c", "pass"], timeout=120)  # the server runs (it may have started with an earlier test)
    torch.compile(lambda x: x * 2, backend="inductor")(torch.ones(3))  # torch writes its compile cache's folder
    proc = forkserver.popen(["-c", CODE, "a", "b"], env={**os.environ, "MARKER": "m", "PYTHONPATH": str(tmp_path)},
                            cwd=tmp_path)
    assert isinstance(proc, forkserver.ForkedProcess), type(proc)  # not a fresh interpreter
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert got["cwd"] == str(tmp_path) and got["marker"] == "m" and got["argv"] == ["-c", "a", "b"]
    assert got["path"][:2] == [str(tmp_path), str(tmp_path)], got["path"]  # PYTHONPATH, then the folder
    assert TESTS not in got["path"], got["path"]  # the server's own folder is not the child's
    assert got["vitkit"] and got["lightning"], got


HANGS = """
import multiprocessing as mp, time

def wait_in_worker():
    time.sleep(600)

if __name__ == "__main__":
    mp.get_context("fork").Process(target=wait_in_worker).start()
    print("started", flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(forkserver.DISABLED, reason="VITKIT_TEST_FORKSERVER=0: every process a fresh interpreter")
def test_a_child_that_hangs_shows_where_it_and_its_workers_stand(tmp_path):
    """What a multi-process test reports when its processes run past the timeout (tests/tasks/conftest.launch)."""
    (tmp_path / "hangs.py").write_text(HANGS)
    proc = forkserver.popen([str(tmp_path / "hangs.py")], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "started" not in Path(proc._out).read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(subprocess.TimeoutExpired) as timeout:
            proc.communicate(timeout=0.5)
        stacks = str(forkserver.Hung(timeout.value, [proc]))
    finally:
        for pid in forkserver.descendants(proc.pid):
            os.kill(pid, 9)
        proc.kill()
    assert proc.wait(timeout=60) == -9
    assert "wait_in_worker" in stacks and "<module>" in stacks, stacks  # the forked worker's and the child's


def test_a_server_that_is_closed_exits_as_an_interpreter_does():
    """Closed at the end of the test process, a server returns instead of being killed, so the exit handlers of what
    it imported run (timm imports wandb, whose temporary folders are removed by them)."""
    server = forkserver._Server("torch")
    server.close()
    assert server.proc.returncode == 0, server.proc.returncode  # not -9: it was not killed
    assert not os.path.exists(server.dir)

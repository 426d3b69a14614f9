"""Type checkers see the API as it is: mypy finds no error in the package
itself, the native module's stub (``_native.pyi``) matches the module's
signatures (``mypy.stubtest``), and typical user code checks cleanly with
``--strict`` while calls with wrong arguments are reported.

mypy comes with the test requirements (``scripts/test.sh`` installs it);
these tests skip, saying so, where it is missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import multiworld_rs
from multiworld_rs import _native

pytest.importorskip("mypy.version", minversion="2.4",
                    reason="mypy 2.4 or later is not installed (scripts/test.sh installs it)")

#: Cold mypy runs take tens of seconds on a busy 2-core machine.
pytestmark = pytest.mark.timeout(600)

#: The directory that holds the package's sources.
SOURCES = Path(multiworld_rs.__file__).resolve().parent.parent
#: What only the nccl build has.
NCCL_ONLY = ("Nccl", "nccl_world")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module's runs (numpy's stubs analysed once)."""
    return tmp_path_factory.mktemp("mypy-cache")


def mypy(*args: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_package_type_checks(cache: Path) -> None:
    r = mypy("-p", "multiworld_rs", cwd=SOURCES, cache=cache)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_native_stub_matches_the_module_signatures(tmp_path: Path, cache: Path) -> None:
    allow = tmp_path / "allowlist.txt"
    lines = [] if _native.nccl_built() else [f"multiworld_rs._native.{n}" for n in (*NCCL_ONLY, "__all__")]
    allow.write_text("\n".join(lines) + "\n")
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {cache}\n")
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "multiworld_rs._native",
                        "--allowlist", str(allow), "--ignore-unused-allowlist",
                        "--mypy-config-file", str(config)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


USER_CODE = '''
    import asyncio
    from typing import List, Optional

    import numpy as np

    import multiworld_rs as mw
    from multiworld_rs import aio


    def serve() -> None:
        with mw.WorldManager() as m:
            addr: str = m.serve_store("127.0.0.1:0")
            w: mw.World = m.join("w", 0, 2, addr, op_timeout=5.0)
            x = mw.zeros((4,), "float32")
            w.send(x, 1)
            src: int = w.recv_into(x, 1)
            y: np.ndarray = w.recv(1, dtype="float32", shape=(4,))
            w.all_reduce(x, mw.ReduceOp.SUM)
            work: Optional[mw.Work] = w.all_reduce(x, "max", async_op=True)
            if work is not None:
                work.wait()
            handle: mw.Work = w.irecv(x, 1)
            done: bool = handle.is_completed()
            outs: List[np.ndarray] = [np.zeros(4, np.float32) for _ in range(w.size)]
            w.all_gather(outs, x)
            w.all_to_all_single(np.zeros(8, np.float32), np.zeros(8, np.float32), [4, 4], [4, 4])
            try:
                w.barrier()
            except mw.BrokenWorldError as e:
                print(e.world, e.generation, e.cause, e.rank, e.detail)
            except mw.WorldTimeoutError:
                pass
            names: List[str] = [i.name for i in m.worlds()]
            for ev in m.events():
                print(ev.kind, ev.world, ev.generation, ev.cause)
                break
            m.leave("w")
            print(src, y, done, names)


    async def leader(aw: aio.AsyncWorld) -> int:
        x = np.zeros(4, np.float32)
        got: int = await aw.recv_into(x, 1)
        await aw.send(x, 1)
        await aw.all_reduce(x)
        return got


    asyncio.run(leader(aio.AsyncWorld(mw.WorldManager().join("w", 0, 1, "127.0.0.1:0"))))
'''

WRONG_CODE = '''
    import numpy as np

    import multiworld_rs as mw

    w = mw.WorldManager().join("w", 0, 2, "127.0.0.1:1")
    w.send(np.zeros(1), "1")
    w.recv(1)
    w.all_reduce(np.zeros(1), async_op="yes")
'''


def test_user_code_type_checks_strictly_and_wrong_calls_are_reported(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "user_code.py").write_text(textwrap.dedent(USER_CODE))
    r = mypy("--strict", "user_code.py", cwd=tmp_path, cache=cache)
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "wrong.py").write_text(textwrap.dedent(WRONG_CODE))
    r = mypy("--strict", "wrong.py", cwd=tmp_path, cache=cache)
    assert r.returncode == 1, r.stdout + r.stderr
    for expected in ('Argument 2 to "send" of "World" has incompatible type "str"',
                     'Missing named argument "dtype" for "recv"',
                     'Missing named argument "shape" for "recv"',
                     'Argument "async_op" to "all_reduce" of "World" has incompatible type "str"'):
        assert expected in r.stdout, r.stdout

"""An example's command line, run in the ranks of a pool (tests/rank_pool.py) instead of in new processes.

``python main.py fit --config ...`` on 2 processes spends most of a short run importing torch and
Lightning, once in the first process and then again in the one Lightning launches. A pool's ranks
have done that: each runs the script as ``__main__`` with the command's arguments, and Lightning,
told that the processes exist (``lightning_models.lightning_env``), launches nothing and uses the
pool's group. Lightning's own launch of the other ranks is run as written by the README quickstart
and the Fabric example tests, and the hung-rank and exit tests.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist
from lightning_models import lightning_env


def run_script(script: str | Path, args: list[str]) -> str:
    """In a rank of a pool: ``python script *args`` from the script's folder, on the pool's ranks; what it printed.

    The script's folder comes first on ``sys.path`` and its modules are imported afresh (the examples share names
    such as ``data`` and ``model``); the working directory, ``sys.path``, ``sys.argv``, the environment and the
    modules the rank had are restored after.
    """
    script = Path(script).resolve()
    own = {path.stem for path in script.parent.glob("*.py")}
    modules = {name: sys.modules.pop(name) for name in own if name in sys.modules}
    cwd, path, argv, environ = os.getcwd(), sys.path[:], sys.argv, dict(os.environ)
    lightning_env(dist.get_rank(), dist.get_world_size())
    os.chdir(script.parent)
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), *args]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_info:
        if exit_info.code not in (None, 0):
            raise AssertionError(f"{script.name} exited with {exit_info.code}:\n{printed.getvalue()[-3000:]}") from None
    finally:
        os.chdir(cwd)
        sys.path[:], sys.argv = path, argv
        os.environ.clear()
        os.environ.update(environ)
        for name in own:
            sys.modules.pop(name, None)
        sys.modules.update(modules)
    return printed.getvalue()

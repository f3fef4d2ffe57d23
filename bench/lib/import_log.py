"""Which installed distributions a set of commands imports, every Python process they start
included.

Each command runs with a `sitecustomize` first on PYTHONPATH that asks the other import finders
for every module and appends the name and the file it comes from to one log (a line per module,
written at once, so processes that end by `os._exit` or a signal have said it). The files are
then matched to the distributions whose RECORD lists them: an editable install (kvgate) and the
standard library list none and are left out.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.lib.gpu_image import canonical

_SITECUSTOMIZE = '''
import os, sys

class _Logged:
    """Finds nothing itself: logs where the other finders find each module."""

    log = os.environ["KVGATE_IMPORT_LOG"]

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is cls or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                with open(cls.log, "a") as f:
                    f.write(f"{name}\\t{spec.origin or ''}\\n")
                return spec
        return None

sys.meta_path.insert(0, _Logged)
'''


def run_logged(commands: Sequence[Sequence[str]], cwd: Path, log: Path) -> None:
    """Run each command (to completion, its output shown) with every import logged to `log`."""
    with tempfile.TemporaryDirectory(prefix="kvgate-imports-") as hook:
        Path(hook, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        env = dict(os.environ, KVGATE_IMPORT_LOG=str(log))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [hook, str(cwd), env.get("PYTHONPATH")]))
        for cmd in commands:
            print(f"  $ {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, cwd=cwd, env=env, check=True)


def distributions(log: Path) -> dict[str, str]:
    """{canonical name: version} of the installed distributions whose files the log names."""
    origins = {
        os.path.realpath(origin)
        for line in log.read_text().splitlines()
        for origin in [line.partition("\t")[2]]
        if origin and os.path.isabs(origin)
    }
    owners: dict[str, tuple[str, str]] = {}
    for dist in md.distributions():
        for f in dist.files or ():
            path = os.path.realpath(dist.locate_file(f))
            if path in origins:
                owners[path] = (canonical(dist.metadata["Name"]), dist.version)
    return dict(sorted(owners.values()))

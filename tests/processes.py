"""What every test that starts processes checks about how they ended."""

from __future__ import annotations

import subprocess

ABORT_MARK = "terminate called"


def assert_clean_exit(result: subprocess.CompletedProcess) -> None:
    """Exit code 0 and no abort message from the program or any rank it launched.

    Ranks that Lightning launches share the program's stdout and stderr, and the program's exit
    code does not carry theirs: an abort at exit of one of them shows only as its message.
    """
    output = (result.stdout or "") + (result.stderr or "")
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    assert result.returncode == 0, f"exit code {result.returncode}:\n{output[-3000:]}"
    assert ABORT_MARK not in output, f"a process aborted at exit:\n{output[-3000:]}"

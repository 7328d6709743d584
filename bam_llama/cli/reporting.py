"""How every command stops: one line on stderr and an exit status, never a traceback.

    2    bad input: a setting, a file or folder that is missing or not writable, weights that are not finite
    1    a failure while running: a full disk (whatever library wrote) or another I/O error, a training loss that
         diverged
    130  Ctrl-C (KeyboardInterrupt); SIGTERM is SystemExit(143) (`outputs.exit_on_sigterm`)

Outputs are staged (`files/outputs.py`), so whatever stops a command leaves no partial file and keeps earlier results.
"""

import sys

from ..files.outputs import disk_full_error, os_error_message
from ..runtime.library_warnings import keep_first_screen_quiet

PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)


def run_reported(prog: str, function, *args, bad_input: tuple = (ValueError,), failures: tuple = ()) -> int:
    """Run `function(*args)` and return the command's exit status (0 when it returns)."""
    keep_first_screen_quiet()
    try:
        function(*args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing partial was left (earlier complete outputs are kept)", file=sys.stderr)
        return 130
    except PATH_ERRORS as error:
        return report(prog, os_error_message(error), 2)
    except OSError as error:
        return report(prog, os_error_message(error), 1)
    except failures as error:
        return report(prog, str(error), 1)
    except bad_input as error:
        return report(prog, str(error), 2)
    except Exception as error:  # a full disk another library reports its own way (outputs.disk_full_error)
        full = disk_full_error(error)
        if full is None:
            raise
        return report(prog, os_error_message(full), 1)
    return 0


def report(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status

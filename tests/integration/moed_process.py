"""A moed process for an integration test, and the record of checks every
test reports into (not a test itself: ctest runs test_*.py). It imports
neither the oracle library nor tritonclient, so that every test can use it.

env: MOED (server binary)."""
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

MOED = os.environ["MOED"]
READY_S = 30  # for the port file: moed listens within a second, a sanitizer build on a loaded machine in a few
LOG_TAIL = 3000  # characters of moed's log shown with a failure
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def exit_with_summary():
    print(f"{len(failures)} failures")
    sys.exit(1 if failures else 0)


class StartFailed(SystemExit):
    """moed exited or did not listen in time; the message ends with its log's tail."""


def log_tail(tmp, start=0):
    """The last LOG_TAIL characters of moed's log in tmp, from byte `start` on."""
    path = os.path.join(tmp, "moed.log")
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")[-LOG_TAIL:]


def print_log_tail(tmp):
    """After failures: the end of moed's log in tmp (what the server said about them)."""
    if failures:
        print(f"--- the end of {os.path.join(tmp, 'moed.log')}:\n{log_tail(tmp)}")


def end(p, timeout):
    """SIGTERM to a running p, up to `timeout` s for its exit, then SIGKILL; p
    is reaped. Its exit code, None where it had to be killed."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


@contextlib.contextmanager
def moed(tmp, *flags, preexec_fn=None, env=None, exit_check="clean exit", exit_timeout=30):
    """moed on free loopback ports with the flags `flags` (later flags override
    the defaults here), its output appended to tmp/moed.log; yields (process,
    gRPC port, HTTP port), the REST port as process.rest_port. env: variables
    added to ours.

    Leaving the block ends the process (end()). After a body that ran through,
    it is asked to stop here and check(exit code 0 within exit_timeout,
    exit_check); exit_check=None is for a test that signals moed and checks
    its exit itself (a second SIGTERM would cut moed's drain short)."""
    os.makedirs(tmp, exist_ok=True)
    port_file = os.path.join(tmp, "ports")
    if os.path.exists(port_file):
        os.unlink(port_file)
    with open(os.path.join(tmp, "moed.log"), "ab") as log:
        log_start = log.tell()
        p = subprocess.Popen([MOED, "--address", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
                              "--rest-port", "0", "--port-file", port_file, "--workers", "2", *flags],
                             stdout=log, stderr=log, preexec_fn=preexec_fn, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + READY_S
    while not os.path.exists(port_file):  # written whole, then renamed into place
        if p.poll() is not None or time.monotonic() > deadline:
            why = f"exited {p.returncode}" if p.poll() is not None else f"not listening after {READY_S} s"
            end(p, 0)
            raise StartFailed(f"moed {' '.join(flags)}: {why}; its log ends:\n{log_tail(tmp, log_start)}")
        time.sleep(0.05)
    with open(port_file) as f:
        grpc_port, http_port, p.rest_port = (int(v) for v in f.read().split())
    try:
        yield p, grpc_port, http_port
    finally:
        rc = end(p, exit_timeout)
    if exit_check is not None:
        got = f"killed: no exit within {exit_timeout} s" if rc is None else f"exit {rc}"
        check(rc == 0, exit_check if rc == 0 else f"{exit_check} ({got})")


def run_tests(*tests):
    """Runs each test(tmp) in one temporary directory, prints the log's tail on failures, exits."""
    with tempfile.TemporaryDirectory() as tmp:
        for t in tests:
            t(tmp)
        print_log_tail(tmp)
    exit_with_summary()

"""``background.signals_held``: a SIGTERM or SIGINT that arrives inside the block is
delivered after its last statement, once, to the handler installed at entry, even while
another thread whose mask lets signals through is alive (the kernel hands a process
signal to any such thread; a pyarrow pool thread after the data scan is one). Each case
runs in a fresh interpreter: the signals are real and go to that process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

PRELUDE = textwrap.dedent("""
    import os, signal, sys, threading, time
    sys.path.insert(0, {repo!r})
    from elastic_ddp.background import signals_held

    # A thread started before the block, signals unblocked in its mask.
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()

    def send(signum):
        t = threading.Thread(target=os.kill, args=(os.getpid(), signum))
        t.start()
        t.join()
        time.sleep(0.2)  # ample time for CPython to run a handler that is not held

    steps = []
""")


def _run(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE.format(repo=str(REPO)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_raising_sigterm_handler_runs_after_the_block_once():
    p = _run("""
        calls = []
        def stop(signum, frame):
            calls.append(signum)
            raise RuntimeError("stopped")
        signal.signal(signal.SIGTERM, stop)
        try:
            with signals_held():
                steps.append("sent")
                send(signal.SIGTERM)
                send(signal.SIGTERM)
                steps.append("finished")
        except RuntimeError:
            steps.append("raised")
        print(steps, calls == [signal.SIGTERM], signal.getsignal(signal.SIGTERM) is stop)
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["['sent',", "'finished',", "'raised']", "True", "True"], p.stdout


def test_ctrl_c_inside_the_block_raises_keyboard_interrupt_after_it():
    p = _run("""
        try:
            with signals_held():
                send(signal.SIGINT)
                steps.append("finished")
        except KeyboardInterrupt:
            steps.append("interrupted")
        print(steps, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["['finished',", "'interrupted']", "True"], p.stdout


def test_the_default_sigterm_action_still_ends_the_process_after_the_block():
    p = _run("""
        with signals_held():
            send(signal.SIGTERM)
            print("finished", flush=True)
        print("not reached", flush=True)
    """)
    assert p.returncode == -15, (p.returncode, p.stderr)
    assert p.stdout.split() == ["finished"], p.stdout


def test_a_block_without_signals_changes_no_handler():
    p = _run("""
        def stop(signum, frame):
            raise RuntimeError("stopped")
        signal.signal(signal.SIGTERM, stop)
        with signals_held():
            steps.append("finished")
        print(steps, signal.getsignal(signal.SIGTERM) is stop,
              signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.pthread_sigmask(signal.SIG_BLOCK, set()) == set())
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["['finished']", "True", "True", "True"], p.stdout


def test_a_sigterm_while_ray_init_holds_its_own_handler_still_stops_before_training():
    """``driver.stop.EarlySignals``: ``ray.init`` installs ``sys.exit(15)`` as the SIGTERM
    handler when it starts. A SIGTERM then ends the early block as ``SystemExit(15)``,
    which leaves it as ``StoppedBeforeTraining`` (the CLI's exit 143 and message);
    after ``reinstall`` the early handler raises it directly."""
    p = _run("""
        from elastic_ddp.driver.stop import EarlySignals, StoppedBeforeTraining

        for reinstall in (False, True):
            try:
                with EarlySignals() as early:
                    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s))  # what ray.init does
                    if reinstall:
                        early.reinstall()
                    send(signal.SIGTERM)
                    steps.append("not stopped")
            except StoppedBeforeTraining as e:
                steps.append("stopped")
        print(steps, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['stopped', 'stopped'] True", p.stdout


def test_a_signal_swallowed_by_an_at_fork_callback_is_raised_after_the_call():
    """``driver.stop.EarlySignals``: a Ctrl-C or SIGTERM whose exception is raised inside an
    at-fork callback (``ray.init`` forks; ``logging`` has such a callback) is printed as
    "Exception ignored" and dropped by CPython; ``reinstall`` (after ``ray.init``) and
    ``hand_over`` (before ``fit``) raise it. Without a signal, neither raises, and both
    handlers are put back."""
    p = _run("""
        from elastic_ddp.driver.stop import EarlySignals, StoppedBeforeTraining

        signum = None
        def deliver():  # runs in the parent after each fork, as logging's _releaseLock does
            if signum is not None:
                os.kill(os.getpid(), signum)
                time.sleep(0.2)  # the handler runs (and raises) here

        os.register_at_fork(after_in_parent=deliver)

        def fork():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)

        for signum, then in ((signal.SIGINT, "reinstall"), (signal.SIGTERM, "hand_over"),
                             (None, "hand_over")):
            try:
                with EarlySignals() as early:
                    fork()
                    steps.append("forked")
                    getattr(early, then)()
                    steps.append("on")
            except (KeyboardInterrupt, StoppedBeforeTraining) as e:
                steps.append(type(e).__name__)
        print(steps, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
              signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """)
    assert p.returncode == 0, p.stderr
    assert "Exception ignored" in p.stderr, p.stderr  # CPython dropped the handler's exception
    assert p.stdout.strip() == ("['forked', 'KeyboardInterrupt', 'forked', 'StoppedBeforeTraining', "
                                "'forked', 'on'] True True"), (p.stdout, p.stderr)

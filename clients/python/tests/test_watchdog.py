"""The sync guard's watchdog: the one thread that sends the cancel
requests of calls whose server has not answered by their deadline."""

from __future__ import annotations

import threading
import time

from conftest import wait_for
from idem_pg.guard import _Watchdog


def test_fires_in_deadline_order_and_not_when_disarmed():
    w = _Watchdog()
    fired = []
    late = w.arm(0.3, lambda: fired.append("late"))
    w.arm(0.1, lambda: fired.append("early"))
    gone = w.arm(0.05, lambda: fired.append("disarmed"))
    w.disarm(gone)
    wait_for(lambda: len(fired) == 2, timeout=10, what="both actions")
    time.sleep(0.2)
    assert fired == ["early", "late"]
    assert late[0] is None                    # a fired entry cannot fire again


def test_a_blocking_action_delays_no_other():
    w = _Watchdog()
    release = threading.Event()
    fired = []
    w.arm(0.05, lambda: (release.wait(10), fired.append("blocked")))
    w.arm(0.1, lambda: fired.append("next"))
    wait_for(lambda: fired == ["next"], timeout=10, what="the second action")
    release.set()
    wait_for(lambda: fired == ["next", "blocked"], timeout=10, what="the first action")


def test_disarmed_entries_leave_the_heap():
    w = _Watchdog()
    for _ in range(1000):
        w.disarm(w.arm(0.05, lambda: None))
    fired = threading.Event()
    w.arm(0.1, fired.set)
    assert fired.wait(10)
    wait_for(lambda: len(w._heap) == 0, timeout=10, what="an empty heap")

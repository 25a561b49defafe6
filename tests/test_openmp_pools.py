"""The server's event-loop thread gives up its OpenMP workers (sluice/engine/openmp.py), so that
the engine thread's pool is the only one and libgomp keeps its workers spinning between the
parallel regions of a step instead of waking them through the kernel every time."""
import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r'''
    import json, os, threading, time
    import torch
    from sluice.engine.openmp import release_calling_thread_pool

    def tasks():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    x = torch.randn(1 << 22)
    for _ in range(3):
        (x * 2).sum()                  # parallel regions on the main thread: it now has a worker
    before = tasks()
    ok = release_calling_thread_pool()
    deadline = time.monotonic() + 5
    while tasks() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    after = tasks()
    seen = {}

    def engine_thread():
        (x * 2).sum()
        seen["threads"] = torch.get_num_threads()
        seen["tasks"] = tasks()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    (x * 2).sum()                      # the main thread's later torch work runs on itself alone
    # The joined thread's task and its pool's worker leave /proc a moment after the join (seen
    # once under load: both still listed); a new pool of the main thread's would stay.
    deadline = time.monotonic() + 5
    while tasks() > after and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps({"ok": ok, "before": before, "after": after, "main_threads": torch.get_num_threads(),
                      "other_threads": seen["threads"], "other_tasks": seen["tasks"], "end_tasks": tasks()}))
''')


def test_the_calling_thread_releases_its_workers_and_other_threads_keep_theirs():
    if not sys.platform.startswith("linux"):
        pytest.skip("libgomp thread pools: Linux only")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["ok"]:
        pytest.skip("torch here does not run on libgomp")
    assert r["after"] == r["before"] - 1, r          # the main thread's one worker exited
    assert r["main_threads"] == 1, r
    assert r["other_threads"] == 2, r                 # another thread still computes on two
    # That thread's pool (itself + one worker) was the only one; once it is gone, the main thread
    # did not start a new one.
    assert r["other_tasks"] == r["after"] + 2, r
    assert r["end_tasks"] <= r["after"], r

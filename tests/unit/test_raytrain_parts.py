"""Ray Train pieces that need no cluster (the whole path runs in tests/e2e/test_remote_ray.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

from lodger.config import RemoteConfig
from lodger.remote import raytrain

CHILD = """
import sys, threading
from lodger.remote.raytrain import ignore_pause_signal
t = threading.Thread(target=ignore_pause_signal)  # as in a Ray Train worker: not the main thread
t.start(); t.join()
print("ready", flush=True)
sys.stdin.readline()  # returns once the test has signalled us
"""


def test_a_rank_run_in_a_thread_survives_the_pause_signal():
    # `lodger pause` signals rank 0's process when it runs on this machine; SIGUSR1's default ends it.
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGUSR1)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()


def test_only_a_job_on_more_than_one_node_goes_through_ray_train():
    class Job:
        def __init__(self, nodes):
            self.remote = RemoteConfig(nodes=nodes)

    assert not raytrain.wanted(Job(None)) and not raytrain.wanted(Job(1))
    assert raytrain.wanted(Job(2))


def test_ranks_get_lodgers_settings_and_no_secret():
    # A Ray Train worker's runtime env is kept in Ray's metadata and shown by its dashboard.
    driver = {"LODGER_HOME": "/s/run/home", "LODGER_REMOTE": "1", "HF_HUB_OFFLINE": "1", "LODGER_API_TOKEN": "t",
              "HF_TOKEN": "hf", "AWS_SECRET_ACCESS_KEY": "k", "AWS_ACCESS_KEY_ID": "id", "PATH": "/bin"}
    assert raytrain.rank_env(driver) == {"LODGER_HOME": "/s/run/home", "LODGER_REMOTE": "1", "HF_HUB_OFFLINE": "1"}

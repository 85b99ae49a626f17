"""A shorter Flower heartbeat for the SuperNodes the federated tests start (on PYTHONPATH for
them only; tests/e2e/test_federated.py).

Flower's SuperNode declares a 30 s heartbeat (``flwr.common.constant.HEARTBEAT_DEFAULT_INTERVAL``,
no option or variable sets it) and the SuperLink counts a node gone after two missed beats: a
test that SIGKILLs a SuperNode mid-round waits up to a minute, idle, for Flower to say "Node
Unavailable". 10 s is Flower's own lower bound (``HEARTBEAT_MIN_INTERVAL``). What lodger does with
an unavailable node (the round short, asked again) does not depend on how soon Flower says so.
Every other process that inherits the path (the ClientApp, lodger's runs) is left alone.
"""

import os
import sys

if os.path.basename(sys.argv[0] if sys.argv else "") == "flower-supernode":
    import flwr.common.constant as _constant

    _constant.HEARTBEAT_DEFAULT_INTERVAL = _constant.HEARTBEAT_MIN_INTERVAL

"""The owner's side of the house: what keeps the machine theirs.

``control`` (how a running job is told to pause, hold, continue or stop, and how it answers),
``runlock`` (the lock a training process holds on its run folder), ``machine`` (what the machine
is doing and whether a policy says to yield), ``restarts`` (when a dead managed run is started
again) and ``agent`` (`lodger agent`: policies, restarts, the queue). ``control``, ``runlock``,
``machine`` and ``restarts`` import only the floor and never torch (commands that only read or
signal use them); ``agent`` sits above the run's life, which it starts.
"""

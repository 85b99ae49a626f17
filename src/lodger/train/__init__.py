"""Training: the loop (loop.py), optimizer and schedule (optim.py), numeric guards."""
